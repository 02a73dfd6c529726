"""The cuda_norm plugin.

Without a GPU: plans for a device description (who takes each norm, the
fused groups, declines with their reasons), fusion checks, and the launch
specs (kernel instance, block, arguments) against norm.cu's own kernel
signatures. On a GPU: every op and fused pattern against the numpy
reference by NMSE (docs/conformance.md: <= 1e-7, inputs in [-10, 10]), odd and long rows,
strided and misaligned views, fused == unfused, poisoned outputs, aliasing,
and CUDA-graph replay == direct launches.

Random inputs come from a fresh seed each run, printed on failure; set
OPDISPATCH_TEST_SEED to replay one.
"""

from __future__ import annotations

import itertools
import re
from typing import Callable

import numpy as np
import pytest

import opdispatch as od
import opdispatch.plugins.cuda_norm as plugin
from opdispatch import ops
from opdispatch.backends.cuda.devices import H200
from opdispatch.backends.cuda.kernels import KernelSpec, kernel_param_types
from opdispatch.graph import Graph
from opdispatch.hookspecs import Device
from opdispatch.plugins.cuda_norm import fusion, support
from opdispatch.plugins.cuda_norm import specs as cn
from opdispatch.tensor import Tensor
from opdispatch.testing.harness import Status, run_case
from opdispatch.testing.metrics import nmse
from helpers import assert_graph_segments, edge_cases

gpu = pytest.mark.gpu

CPU = Device("cpu", "cpu")
NORM_OPS = ("norm", "rms_norm", "l2_norm", "group_norm")
EPS = {"norm": 1e-5, "rms_norm": 1e-6, "l2_norm": 1e-12}
NMSE_MAX = 1e-7  # docs/conformance.md: the default bound, norms included


def row_norm(op: str, x: Tensor) -> Tensor:
    return getattr(ops, op)(x, EPS[op])


def steps_of(plan: od.Plan, op: str) -> list:
    return [s for s in plan.steps if s.kind in ("kernel", "fused") and s.nodes[0].op == op]


# -- the plugin, without a GPU ---------------------------------------------------------------


def test_kernels_and_rules_are_for_cuda_devices_only() -> None:
    assert list(plugin.kernels(device=CPU)) == [] and list(plugin.fusion_rules(device=CPU)) == []
    assert sorted(k.op for k in plugin.kernels(device=H200)) == sorted(NORM_OPS)
    assert [r.name for r in plugin.fusion_rules(device=H200)] == ["rms_norm_mul_add", "rms_norm_mul", "norm_mul_add",
                                                               "norm_mul"]


@pytest.mark.parametrize("op", NORM_OPS)
def test_plans_each_norm_on_the_gpu_description(op: str) -> None:
    x = od.input("x", (2, 8, 4, 64))
    y = ops.group_norm(x, 4) if op == "group_norm" else row_norm(op, x)
    plan = od.compile(y, H200)
    (step,) = steps_of(plan, op)
    assert (step.plugin, step.kernel, step.device.name) == ("cuda_norm", f"{op}_f32", "cuda0")
    assert f"cuda_norm:{op}_f32 on cuda0" in plan.explain()


@pytest.mark.parametrize("op", ["rms_norm", "norm"])
@pytest.mark.parametrize("residual", [False, True])
def test_fuses_norm_mul_and_add(op: str, residual: bool) -> None:
    x = od.input("x", (8, 256))
    w = od.param("w", np.linspace(0.5, 1.5, 256, dtype=np.float32))
    y = ops.mul(row_norm(op, x), w)
    if residual:
        y = ops.add(y, od.input("r", (8, 256)))
    plan = od.compile(y, H200)
    rule = f"{op}_mul_add" if residual else f"{op}_mul"
    (step,) = plan.fusions
    assert (step.plugin, step.kernel, step.device.name) == ("cuda_norm", rule, "cuda0")
    assert [n.op for n in step.nodes] == [op, "mul", "add"][: 3 if residual else 2]
    assert len([s for s in plan.steps if s.kind in ("kernel", "fused")]) == 1
    assert f"cuda_norm [fused {rule}] on cuda0" in plan.explain()


def test_fuses_with_the_norm_on_either_side_of_mul_and_add() -> None:
    x = od.input("x", (4, 64))
    w = od.param("w", np.ones((4, 64), np.float32))  # the norm's shape: mul(w, norm) keeps it
    y = ops.add(od.input("r", (4, 64)), ops.mul(w, ops.rms_norm(x)))
    (step,) = od.compile(y, H200).fusions
    assert step.kernel == "rms_norm_mul_add"


def test_declines_strided_rows_with_the_reason_and_falls_back_to_cpu() -> None:
    x = od.input("x", (64, 8))
    plan = od.compile(ops.rms_norm(x.permute(1, 0)), H200)
    (step,) = steps_of(plan, "rms_norm")
    assert step.device.name == "cpu" and step.plugin == "cpu"
    assert ("cuda_norm", "rows must be contiguous") in step.declined
    assert "cuda_norm (rows must be contiguous)" in plan.explain()


@pytest.mark.parametrize("op", NORM_OPS)
def test_declines_a_view_at_an_odd_byte_offset(op: str) -> None:
    """An f32 view starting 2 bytes into its storage: its strides are whole floats, its offset is not."""
    x = od.input("x", (4, 2, 4, 8))
    v = x.view((2, 2, 4, 8), offset=2)
    node = ops.group_norm(v, 2) if op == "group_norm" else row_norm(op, v)
    check = support.group_norm if op == "group_norm" else support.row_norm
    assert check(H200, node) == "strides and the view offset must be whole elements"
    assert check(H200, ops.group_norm(x, 2) if op == "group_norm" else row_norm(op, x)) is True


def test_declines_group_norm_over_permuted_channels() -> None:
    x = od.input("x", (2, 4, 6, 8))
    (step,) = steps_of(od.compile(ops.group_norm(x.permute(0, 2, 1, 3), 2), H200), "group_norm")
    assert step.device.name == "cpu" and ("cuda_norm", "(C, H, W) must be contiguous") in step.declined


def test_gate_declines_devices_without_32_lane_warps() -> None:
    wide = Device("cuda0", "cuda", "a 64-lane device", {"cc": (9, 0), "warp_size": 64})
    (step,) = steps_of(od.compile(ops.rms_norm(od.input("x", (4, 64))), wide), "rms_norm")
    assert step.device.name == "cpu"
    assert ("cuda_norm", "the kernels need 32-lane warps, cuda0 has 64") in step.declined


def _group(y: Tensor) -> tuple[list[Tensor], Graph]:
    graph = Graph.build(y)
    return [n for n in graph.nodes if n.op not in ("view", "reshape", "permute", "transpose")], graph


def _weight_f16() -> Tensor:
    return ops.mul(ops.rms_norm(od.input("x", (4, 64))), od.param("w", np.ones(64), "f16"))


def _weight_strided_rows() -> Tensor:
    return ops.mul(ops.rms_norm(od.input("x", (8, 64))), od.param("w", np.ones((64, 8), np.float32)).permute(1, 0))


def _norm_broadcast_into_weight() -> Tensor:
    return ops.mul(od.param("w", np.ones((2, 8, 64), np.float32)), ops.rms_norm(od.input("x", (8, 64))))


def _residual_is_the_norm() -> Tensor:
    n = ops.rms_norm(od.input("x", (4, 64)))
    return ops.add(ops.mul(n, od.param("w", np.ones(64, np.float32))), n)


def _strided_x() -> Tensor:
    x = od.input("x", (64, 8)).permute(1, 0)
    return ops.mul(ops.rms_norm(x), od.param("w", np.ones(64, np.float32)))


@pytest.mark.parametrize(("build", "reason"), [
    (_weight_f16, r"the weight 'w' \(64,\) f16 must be f32"),
    (_weight_strided_rows, r"the weight .* rows must be contiguous"),
    (_norm_broadcast_into_weight, r"mul broadcasts the rms_norm result into \(2, 8, 64\)"),
    (_residual_is_the_norm, r"the residual of add is computed inside the group"),
    (_strided_x, r"rms_norm: rows must be contiguous"),
])
def test_fusion_check_declines_layouts_the_kernel_does_not_handle(build: Callable[[], Tensor], reason: str) -> None:
    y = build()
    nodes, graph = _group(y)
    answer = fusion.check(H200, nodes, graph)
    assert isinstance(answer, str) and re.search(reason, answer), answer
    plan = od.compile(y, H200)
    assert not plan.fusions
    for s in steps_of(plan, "rms_norm"):
        assert (s.plugin == "cuda_norm") == (build is not _strided_x)


# -- launch specs, without a GPU --------------------------------------------------------------

BASE = 0x7F00_0000_0000  # a 256-byte-aligned address, as arena slots are


def fake_ptr(t: Tensor) -> int:
    return BASE + t.view_offset


def spec_types(spec: KernelSpec) -> tuple[type, ...]:
    return tuple(type(a) for a in spec.arg_values)


@pytest.mark.parametrize(("shape", "view", "kernel", "grid"), [
    ((16384, 4096), None, "norm_rows_f32<1, 128, true, 0>", 16384),
    ((16, 4096), None, "norm_rows_f32<1, 512, true, 0, 2>", 16),  # few rows: latency-bound variant
    ((1, 2048), None, "norm_rows_f32<1, 256, true, 0, 2>", 1),  # a decode step's single token
    ((1, 16384), None, "norm_rows_f32<1, 512, true, 0>", 1),  # too long for 2 loads a thread
    ((257, 2048), None, "norm_rows_f32<1, 128, true, 0>", 257),
    ((16, 4097), None, "norm_rows_f32<1, 1024, false, 0>", 16),
    ((3, 200001), None, "norm_rows_f32<1, 1024, false, 0>", 3),
    ((5,), None, "norm_rows_f32<1, 32, false, 0>", 1),
    ((2, 3, 4, 36), None, "norm_rows_f32<1, 64, true, 0, 2>", 24),
    ((300, 36), None, "norm_rows_f32<1, 32, true, 0>", 300),
    ((10, 64), lambda x: x.view((4, 64), (512, 4), 4), "norm_rows_f32<1, 32, false, 0>", 4),  # misaligned
    ((10, 64), lambda x: x.view((5, 64), (520, 4)), "norm_rows_f32<1, 32, false, 0>", 5),  # row stride % 16 != 0
    ((10, 64), lambda x: x.view((5, 64), (512, 4)), "norm_rows_f32<1, 64, true, 0, 2>", 5),
    ((0, 64), None, "norm_rows_f32<1, 32, true, 0>", 0),
])
def test_row_spec_picks_the_variant(shape: tuple, view: Callable | None, kernel: str, grid: int) -> None:
    x = od.input("x", shape)
    v = view(x) if view else x
    spec = cn.row_spec("rms_norm", v, ops.rms_norm(v), 1e-6, fake_ptr)
    assert (spec.kernel, spec.grid) == (kernel, grid)
    assert spec.kernel in cn.NAME_EXPRESSIONS
    assert spec_types(spec) == kernel_param_types(cn.NORM_CU)["norm_rows_f32"]


def test_row_spec_passes_outer_geometry_in_elements() -> None:
    x = od.input("x", (3, 5, 7, 40)).permute(1, 0, 2, 3)
    spec = cn.row_spec("norm", x, ops.norm(x), 1e-5, fake_ptr)
    a = spec.args
    assert (a.ncols, a.n1, a.n2) == (40, 3, 7) and a.eps == np.float32(1e-5)
    assert (a.xs0, a.xs1, a.xs2) == (7 * 40, 5 * 7 * 40, 40)


@pytest.mark.parametrize(("op", "w_shape", "r_shape", "kernel"), [
    ("rms_norm", (256,), None, "norm_rows_f32<1, 64, true, 1, 2>"),
    ("rms_norm", (256,), (8, 256), "norm_rows_f32<1, 64, true, 2, 2>"),
    ("norm", (1, 256), (256,), "norm_rows_f32<0, 64, true, 2, 2>"),
    ("rms_norm", (64,), None, "norm_rows_f32<1, 128, false, 1>"),  # columns by modulo: scalar
    ("norm", (256,), (8, 64), "norm_rows_f32<0, 128, false, 2>"),
])
def test_fused_spec(op: str, w_shape: tuple, r_shape: tuple | None, kernel: str) -> None:
    x = od.input("x", (8, 256))
    w = od.param("w", np.ones(w_shape, np.float32))
    y = ops.mul(row_norm(op, x), w)
    if r_shape:
        y = ops.add(y, od.input("r", r_shape))
    nodes, graph = _group(y)
    assert fusion.check(H200, nodes, graph) is True
    spec = cn.row_spec(op, x, nodes[-1], EPS[op], fake_ptr, *fusion.operands(nodes))
    assert spec.kernel == kernel and spec.kernel in cn.NAME_EXPRESSIONS
    assert spec_types(spec) == kernel_param_types(cn.NORM_CU)["norm_rows_f32"]
    a = spec.args
    assert (a.w0, a.w1, a.w2, a.wcols) == (1,) * (4 - len(w_shape)) + w_shape
    assert (a.r == 0) == (r_shape is None)


@pytest.mark.parametrize(("shape", "groups", "kernel", "grid", "per_group"), [
    ((2, 10, 3, 5), 4, "group_norm_f32<32, false>", 8, 3),
    ((1, 32, 8, 8), 8, "group_norm_f32<32, true>", 8, 4),
    ((2, 3, 2, 2), 8, "group_norm_f32<32, true>", 16, 1),
    ((5, 7), 3, "group_norm_f32<32, false>", 3, 1),
    ((4, 64, 32, 32), 32, "group_norm_f32<128, true>", 128, 2),
])
def test_group_spec(shape: tuple, groups: int, kernel: str, grid: int, per_group: int) -> None:
    x = od.input("x", shape)
    spec = cn.group_spec(x, ops.group_norm(x, groups), groups, 1e-6, fake_ptr)
    assert (spec.kernel, spec.grid, spec.args.per_group) == (kernel, grid, per_group)
    assert spec.kernel in cn.NAME_EXPRESSIONS
    assert spec_types(spec) == kernel_param_types(cn.NORM_CU)["group_norm_f32"]


def test_every_block_size_and_variant_is_compiled() -> None:
    for ncols in (1, 4, 100, 128, 129, 512, 1024, 2048, 4096, 4100, 8192, 8196, 16384, 16388, 200001):
        for op, rows in itertools.product(("norm", "rms_norm", "l2_norm"), (1, 2, 300)):
            x = od.input("x", (rows, ncols))
            assert cn.row_spec(op, x, row_norm(op, x), EPS[op], fake_ptr).kernel in cn.NAME_EXPRESSIONS


# -- on a GPU -------------------------------------------------------------------------------------


def uniform(rng: np.random.Generator, shape: tuple, lo: float = -10, hi: float = 10) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float32)


def assert_close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (an element not written?)"
    err = nmse(got, ref)
    assert err <= NMSE_MAX, f"{what}: NMSE {err:.3g} > {NMSE_MAX}"


def run_on_gpu(y: Tensor, feeds: dict, **kw: object) -> tuple[od.Plan, np.ndarray]:
    """Run on cuda0 with the norms taken by cuda_norm there; return the plan and the output."""
    plan = od.compile(y, "cuda0", **kw)
    for s in plan.steps:
        if s.kind in ("kernel", "fused") and s.nodes[0].op in NORM_OPS:
            assert (s.plugin, s.device.name) == ("cuda_norm", "cuda0"), plan.explain()
    (out,) = plan.run(feeds)
    return plan, out


def reference(y: Tensor, feeds: dict) -> np.ndarray:
    (out,) = od.compile(y, "cpu").run(feeds)
    return out


ROW_CASES = {
    "one element": ((1,), None),
    "rows of 1": ((3, 1), None),
    "rows of 5": ((7, 5), None),
    "rows of 8 (float4)": ((6, 8), None),
    "rows of 4096": ((5, 4096), None),
    "one row of 2048 (decode, 2 float4s a thread)": ((1, 2048), None),
    "one row of 8192 (latency variant, 1024 threads)": ((1, 8192), None),
    "one row of 8196 (past the latency variant)": ((1, 8196), None),
    "rows of 4000 (latency variant, partial last pass)": ((2, 4000), None),
    "300 rows of 2048 (throughput variant)": ((300, 2048), None),
    "rows of 4097": ((4, 4097), None),
    "rows of 200001": ((3, 200001), None),
    "rows of 40000 (float4, past the register cache)": ((3, 40000), None),
    "4 dims": ((2, 3, 4, 36), None),
    "permuted outer axes": ((6, 4, 132), lambda x: x.permute(1, 0, 2)),
    "4-d permuted": ((2, 3, 5, 68), lambda x: x.permute(2, 0, 1, 3)),
    "every other row": ((10, 64), lambda x: x.view((5, 64), (512, 4))),
    "misaligned rows": ((10, 64), lambda x: x.view((4, 64), (512, 4), 4)),
}


@gpu
@pytest.mark.parametrize("op", ["norm", "rms_norm", "l2_norm"])
@pytest.mark.parametrize("case", list(ROW_CASES))
def test_row_norms_match_the_reference(op: str, case: str, rng) -> None:  # noqa: ANN001
    shape, view = ROW_CASES[case]
    x = od.input("x", shape)
    y = row_norm(op, view(x) if view else x)
    feeds = {x: uniform(rng, shape)}
    _, got = run_on_gpu(y, feeds)
    assert_close(got, reference(y, feeds), f"{op} {case}")


GROUP_CASES = {
    "uneven groups": ((2, 10, 3, 5), 4, None),
    "float4": ((1, 32, 8, 8), 8, None),
    "a group per channel": ((3, 6, 4, 4), 6, None),
    "more groups than channels": ((2, 3, 2, 2), 8, None),
    "2-d": ((5, 7), 3, None),
    "1-d": ((12,), 2, None),
    "large groups": ((2, 64, 32, 32), 4, None),
    "one group past the register cache": ((1, 64, 32, 32), 1, None),
    "every other sample": ((4, 6, 4, 4), 3, lambda x: x.view((2, 6, 4, 4), (2 * 6 * 16 * 4, 64, 16, 4))),
}


@gpu
@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_group_norm_matches_the_reference(case: str, rng) -> None:  # noqa: ANN001
    shape, groups, view = GROUP_CASES[case]
    x = od.input("x", shape)
    y = ops.group_norm(view(x) if view else x, groups, 1e-6)
    feeds = {x: uniform(rng, shape)}
    _, got = run_on_gpu(y, feeds)
    assert_close(got, reference(y, feeds), f"group_norm {case}")


FUSED_CASES = {
    "weight (C,)": ((6, 64), (64,), None, False),
    "weight (1, C), full residual": ((6, 64), (1, 64), "full", False),
    "weight by modulo over outer axes": ((4, 6, 64), (2, 1, 64), "full", False),
    "weight by modulo over columns": ((6, 64), (16,), "full", False),
    "rows of 4097": ((5, 4097), (4097,), "full", False),
    "one row of 2048 (decode)": ((1, 2048), (2048,), None, False),
    "one row of 2048 with residual": ((1, 2048), (2048,), "full", False),
    "rows of 1000, residual by modulo": ((4, 1000), (1000,), (2, 1000), False),
    "300 rows of 2048 (throughput variant)": ((300, 2048), (2048,), "full", False),
    "rows of 40000": ((3, 40000), (40000,), "full", False),
    "broadcast residual": ((3, 5, 256), (256,), (5, 256), False),
    "full weight first": ((6, 64), (6, 64), "full", True),
}


def fused_graph(op: str, case: str, rng: np.random.Generator) -> tuple[Tensor, dict]:
    shape, w_shape, r_shape, weight_first = FUSED_CASES[case]
    x = od.input("x", shape)
    w = od.param("w", uniform(rng, w_shape, -2, 2))
    n = row_norm(op, x)
    y = ops.mul(w, n) if weight_first else ops.mul(n, w)
    feeds = {x: uniform(rng, shape)}
    if r_shape is not None:
        r = od.input("r", shape if r_shape == "full" else r_shape)
        y = ops.add(y, r)
        feeds[r] = uniform(rng, r.shape)
    return y, feeds


@gpu
@pytest.mark.parametrize("op", ["rms_norm", "norm"])
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_matches_reference_and_unfused(op: str, case: str, rng) -> None:  # noqa: ANN001
    y, feeds = fused_graph(op, case, rng)
    plan, fused = run_on_gpu(y, feeds)
    assert len(plan.fusions) == 1, plan.explain()
    assert_close(fused, reference(y, feeds), f"{op} fused, {case}")
    unfused_plan, unfused = run_on_gpu(y, feeds, fusion=False)
    assert not unfused_plan.fusions
    assert_close(fused, unfused, f"{op} fused vs unfused, {case}")


@gpu
@pytest.mark.parametrize("build", ["rms_norm", "l2_norm 4097", "norm_mul_add", "group_norm"])
def test_every_output_element_is_written_on_each_run(build: str, rng) -> None:  # noqa: ANN001
    if build == "norm_mul_add":
        y, feeds = fused_graph("norm", "weight (1, C), full residual", rng)
    else:
        x = od.input("x", (4, 4097) if build == "l2_norm 4097" else (2, 8, 4, 64))
        y = ops.group_norm(x, 4) if build == "group_norm" else row_norm(build.split()[0], x)
        feeds = {x: uniform(rng, x.shape)}
    plan = od.compile(y, "cuda0")
    for run in range(3):  # warm-up, capture, replay
        feeds = {t: uniform(rng, v.shape) for t, v in feeds.items()}
        plan.poison()
        (got,) = plan.run(feeds)
        assert_close(got, reference(y, feeds), f"{build}, run {run}")


@gpu
@pytest.mark.parametrize(("op", "ncols"), [("norm", 5), ("rms_norm", 4096), ("l2_norm", 4097), ("group_norm", 64)])
def test_output_may_alias_the_input(op: str, ncols: int, rng) -> None:  # noqa: ANN001
    from opdispatch.backends.cuda.backend import backend_for
    from opdispatch.backends.cuda.devices import discover

    backend = backend_for(discover()[0][0])
    x = od.input("x", (6, 4, ncols))
    y = ops.group_norm(x, 2) if op == "group_norm" else row_norm(op, x)
    values = uniform(rng, x.shape)
    buf = backend.alloc(x.nbytes, "x and y")
    backend.write(buf, 0, values)
    ctx = backend.bind_context(lambda t: (buf, 0))  # x and y share storage
    spec = (cn.group_spec(x, y, 2, 1e-6, ctx.ptr) if op == "group_norm"
            else cn.row_spec(op, x, y, EPS[op], ctx.ptr))
    with backend.cuda_device:
        spec.launch(ctx.stream)()
    got = backend.read(buf, 0, x.nbytes).view(np.float32).reshape(x.shape)
    assert_close(got, reference(y, {x: values}), f"{op} in place")


@gpu
def test_cuda_graph_replay_matches_direct_launches(monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    shape = (8, 1000)
    inputs = [{"x": uniform(rng, shape), "r": uniform(rng, shape)} for _ in range(4)]
    weight = uniform(rng, shape[-1:], -2, 2)
    results = {}
    for disabled in ("1", "0"):
        monkeypatch.setenv("OPDISPATCH_DISABLE_CUDA_GRAPHS", disabled)
        x, r = od.input("x", shape), od.input("r", shape)
        w = od.param("w", weight)  # a new param: a plan of its own, bound under this setting
        y = ops.rms_norm(ops.add(ops.mul(ops.rms_norm(x), w), r))
        plan = od.compile(y, "cuda0")
        results[disabled] = [plan.run({x: v["x"], r: v["r"]})[0] for v in inputs]
        assert_graph_segments(plan, disabled)
    for direct, replayed in zip(results["1"], results["0"]):
        assert np.array_equal(direct, replayed)


@gpu
@pytest.mark.parametrize("case", edge_cases("norm", "rms_norm", "l2_norm", "group_norm"))
def test_edge_values_match_the_reference(case, seed: int) -> None:  # noqa: ANN001
    """The sweep's edge-value cases (docs/ops.md, "Edge values") on cuda_norm, NaN positions included:
    zero rows (zeros, l2_norm with eps 1e-30 too), rows with inf or NaN (NaN where the reference has it)."""
    res = run_case(case, "cuda0", plugin="cuda_norm", seed=seed)
    assert res.status is Status.PASS, res.describe()
