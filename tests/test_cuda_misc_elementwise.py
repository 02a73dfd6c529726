"""cuda_misc's elementwise.cu, unary.cu and glu.cu families: binary ops with broadcasting, maps and unary
ops, glu; multi-add, softcap.

Without a GPU: plans for a device description (which ops and dtypes the
plugin takes, its declines with their reasons), the fusion checks (matching
and not), the launch specs (path, vectors, alignment fallbacks, arguments
against the kernels' own signatures) and the op codes shared with the .cu
files. On a GPU: every op and dtype against the numpy reference by NMSE,
broadcasting over each axis, permuted, strided and misaligned sources, odd
sizes, arenas poisoned and two runs with different inputs (every output
element written), fused == unfused exactly, and outputs aliasing a source.

Random inputs come from a fresh seed each run, printed on failure; set
OPDISPATCH_TEST_SEED to replay one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pytest

import opdispatch as od
import opdispatch.plugins.cuda_misc as cm
from opdispatch import ops
from opdispatch.backends.cuda.devices import H200
from opdispatch.backends.cuda.kernels import INCLUDE_DIR, KernelSpec, kernel_param_types
from opdispatch.graph import Graph
from opdispatch.hookspecs import Device
from opdispatch.ops.elementwise import GLU_KINDS, UNARY_OPS
from opdispatch.plugins.cuda_misc import fusion
from opdispatch.plugins.cuda_misc.specs import KERNEL_SOURCES, unary
from opdispatch.plugins.cuda_misc.specs import elementwise as ew
from opdispatch.tensor import Tensor
from opdispatch.testing.harness import Status, run_case
from opdispatch.testing.metrics import nmse
from helpers import FAKE_WORD, FakeGuard, edge_cases

gpu = pytest.mark.gpu

CPU = Device("cpu", "cpu")
FLOATS = ("f32", "f16", "bf16")
#: NMSE bounds: f32 the default (docs/conformance.md); f16/bf16 results differ from the reference
#: (float64 rounded once) only where a float32 result falls on the other side of a
#: 16-bit rounding tie, far below the 1e-4 docs/conformance.md allows them
BOUND = {"f32": 1e-7, "f16": 1e-6, "bf16": 1e-5}
ULP = {"f32": 2.0**-23, "f16": 2.0**-10, "bf16": 2.0**-7}
MAPS_WITH_PARAMS = {"scale": (0.37, -0.25), "clamp": (-0.5, 0.75), "leaky_relu": (0.1,)}
EXP_LIKE = ("exp", "expm1", "softplus", "elu", "sigmoid", "silu", "gelu_quick", "gelu", "gelu_erf", "tanh")


def map_op(op: str, x: Tensor) -> Tensor:
    if op in MAPS_WITH_PARAMS:
        return getattr(ops, op)(x, *MAPS_WITH_PARAMS[op])
    return getattr(ops, op)(x)


def work_steps(plan: od.Plan) -> list:
    return [s for s in plan.steps if s.kind in ("kernel", "fused")]


def step_of(plan: od.Plan, node: Tensor):  # noqa: ANN201
    return next(s for s in work_steps(plan) if any(n is node for n in s.nodes))


def chain(n_adds: int, shape: Sequence[int] = (8, 64), dtype: str = "f32",
          b_shapes: Sequence[Sequence[int]] | None = None) -> tuple[Tensor, list[Tensor]]:
    """add(add(add(x0, x1), x2), ...) with n_adds adds; returns (result, [x0, x1, ...])."""
    xs = [od.input("x0", shape, dtype)]
    y = xs[0]
    for i in range(n_adds):
        xs.append(od.input(f"x{i + 1}", b_shapes[i] if b_shapes else shape, dtype))
        y = ops.add(y, xs[-1])
    return y, xs


def softcap(x: Tensor, s1: float = 0.02, s2: float = 50.0, bias1: float = 0.0, bias2: float = 0.0) -> Tensor:
    return ops.scale(ops.tanh(ops.scale(x, s1, bias1)), s2, bias2)


# -- registration and tables -----------------------------------------------------------------


def test_kernels_and_rules_are_for_cuda_devices_only() -> None:
    assert list(cm.kernels(device=CPU)) == [] and list(cm.fusion_rules(device=CPU)) == []
    ops_taken = {k.op for k in cm.kernels(device=H200)}
    assert {*UNARY_OPS, "add", "sub", "mul", "div", "add1", "add_id", "scale", "clamp", "leaky_relu", "sqr",
            "sqrt", "log", "sin", "cos", "glu"} <= ops_taken
    names = [r.name for r in cm.fusion_rules(device=H200)]
    assert [n for n in names if n.startswith("multi_add")] == [f"multi_add_{n}" for n in range(8, 1, -1)]
    assert "softcap" in names


def test_the_plugin_yields_every_record_and_declares_every_source() -> None:
    assert list(cm.kernels(device=H200)) == list(cm.KERNELS)
    assert list(cm.fusion_rules(device=H200)) == fusion.FUSIONS
    assert set(KERNEL_SOURCES) == set((Path(cm.__file__).parent / "kernels").resolve().glob("*.cu"))
    assert all(KERNEL_SOURCES.values())


def _codes(cu: Path, prefix: str) -> dict[str, int]:
    return {m.group(1).lower(): int(m.group(2))
            for m in re.finditer(rf"constexpr int {prefix}(\w+) = (\d+);", cu.read_text())}


def test_op_codes_match_the_kernel_sources() -> None:
    assert _codes(ew.ELEMENTWISE_CU, "OP_") == ew.BINARY_CODES
    assert _codes(unary.UNARY_CU, "OP_") == unary.UNARY_CODES
    assert _codes(INCLUDE_DIR / "activations.cuh", "GLU_") == unary.GLU_CODES
    assert set(unary.MAP_OPS) | {"softcap"} == set(unary.UNARY_CODES)
    assert set(GLU_KINDS) == set(unary.GLU_CODES)


# -- who takes what, on the device description --------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", [*unary.MAP_OPS])
def test_plans_every_map_op_and_dtype(op: str, dtype: str) -> None:
    x = od.input("x", (4, 8, 33), dtype)
    y = map_op(op, x.permute(1, 0, 2))  # any strides
    step = step_of(od.compile(y, H200), y)
    assert (step.plugin, step.kernel, step.device.name) == ("cuda_misc", "unary", "cuda0")


@pytest.mark.parametrize(("da", "db"), ew.BINARY_PAIRS)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_plans_every_binary_op_and_dtype_pair(op: str, da: str, db: str) -> None:
    y = getattr(ops, op)(od.input("a", (3, 4, 8), da), od.input("b", (4, 1), db))
    step = step_of(od.compile(y, H200), y)
    assert (step.plugin, step.kernel, step.device.name) == ("cuda_misc", "binary", "cuda0")


@pytest.mark.parametrize("dtype", FLOATS)
def test_plans_add1_add_id_and_every_glu_form(dtype: str) -> None:
    x = od.input("x", (3, 2, 16), dtype)
    nodes = [
        ops.add1(x, od.input("s", (1,), dtype)),
        ops.add_id(x, od.input("b", (5, 16), dtype), od.input("ids", (3, 2), "i32")),
        *(ops.glu(x, kind, swapped) for kind in GLU_KINDS for swapped in (False, True)),
        *(ops.glu_split(x, od.input(f"up_{kind}", (3, 2, 16), dtype), kind) for kind in GLU_KINDS),
    ]
    plan = od.compile(nodes, H200)
    for n in nodes:
        step = step_of(plan, n)
        assert (step.plugin, step.device.name) == ("cuda_misc", "cuda0"), plan.explain()


def test_declines_mixed_half_types_with_the_reason() -> None:
    y = ops.mul(od.input("a", (4, 8), "f16"), od.input("b", (8,), "bf16"))
    plan = od.compile(y, H200)
    step = step_of(plan, y)
    assert step.device.name == "cpu"
    assert ("cuda_misc", "f16 a with bf16 b not supported (mixed f16/bf16)") in step.declined
    assert "cuda_misc (f16 a with bf16 b not supported" in plan.explain()


def test_declines_strides_that_are_not_whole_elements() -> None:
    x = od.input("x", (4, 8), "f32")
    y = ops.silu(x.view((3, 8), (32, 4), 2))  # starts mid-element
    step = step_of(od.compile(y, H200), y)
    assert step.device.name == "cpu" and ("cuda_misc", "strides must be whole elements") in step.declined


def test_gate_declines_devices_without_32_lane_warps() -> None:
    wide = Device("cuda0", "cuda", "a 64-lane device", {"cc": (9, 0), "warp_size": 64, "sm_count": 8})
    y = ops.relu(od.input("x", (4, 8)))
    step = step_of(od.compile(y, wide), y)
    assert step.device.name == "cpu"
    assert ("cuda_misc", "the kernels need 32-lane warps, cuda0 has 64") in step.declined


def test_ops_of_the_other_half_are_not_taken_by_this_one() -> None:
    elementwise = {k.op for k in cm.KERNELS if k.name in ("binary", "add_id", "unary", "glu")}
    assert not {"cpy", "dup", "get_rows", "set_rows", "sum_rows", "argsort"} & elementwise


# -- fusions: multi-add ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n_adds", range(2, 9))
def test_chains_of_2_to_8_adds_fuse_into_one_launch(n_adds: int) -> None:
    y, _ = chain(n_adds)
    plan = od.compile(y, H200)
    (step,) = work_steps(plan)
    assert (step.kind, step.plugin, step.kernel) == ("fused", "cuda_misc", f"multi_add_{n_adds}")
    assert [n.op for n in step.nodes] == ["add"] * n_adds
    assert f"cuda_misc [fused multi_add_{n_adds}] on cuda0" in plan.explain()


def test_longer_chains_split_into_groups_of_at_most_8() -> None:
    y, _ = chain(11)
    kinds = [(s.kind, len(s.nodes)) for s in work_steps(od.compile(y, H200))]
    assert kinds == [("fused", 8), ("fused", 3)]
    y, _ = chain(9)
    assert [(s.kind, len(s.nodes)) for s in work_steps(od.compile(y, H200))] == [("fused", 8), ("kernel", 1)]


@pytest.mark.parametrize("dtype", FLOATS)
def test_multi_add_with_row_broadcast_and_strided_operands_fuses(dtype: str) -> None:
    wide = od.input("wide", (6, 128), dtype)
    x0 = wide.view((6, 64), wide.strides)  # rows 128 apart: the view node comes before the first add
    y = ops.add(ops.add(ops.add(x0, od.input("bias", (64,), dtype)), od.input("r", (6, 64), dtype)),
                od.input("bias2", (1, 64), dtype))
    (step,) = work_steps(od.compile(y, H200))
    assert step.kind == "fused" and step.kernel == "multi_add_3"


def test_a_view_between_adds_splits_the_chain() -> None:
    """Patterns are consecutive nodes: a view node made for an operand sits between the adds."""
    y, _ = chain(1)
    r = od.input("r", (1, 8, 64))
    y = ops.add(ops.add(y, r.reshape(8, 64)), od.input("x9", (8, 64)))
    assert [n.op for n in Graph.build(y).nodes] == ["add", "reshape", "add", "add"]
    assert [(s.kind, len(s.nodes)) for s in work_steps(od.compile(y, H200))] == [("kernel", 1), ("fused", 2)]


def _second_source_is_the_previous_add() -> Tensor:
    x0, x1, x2 = (od.input(f"x{i}", (8, 64)) for i in range(3))
    return ops.add(x2, ops.add(x0, x1))


def _add_of_itself() -> Tensor:
    s = ops.add(od.input("x0", (8, 64)), od.input("x1", (8, 64)))
    return ops.add(s, s)


def _mixed_dtypes() -> Tensor:
    y, _ = chain(1)
    return ops.add(y, od.input("h", (8, 64), "f16"))


def _column_broadcast() -> Tensor:
    y, _ = chain(1)
    return ops.add(y, od.input("col", (8, 1)))


def _transposed_operand() -> Tensor:
    y, _ = chain(1)
    return ops.add(y, od.input("t", (64, 8)).T)


def _broadcast_over_different_axes() -> Tensor:
    y, _ = chain(1, (4, 8, 64), b_shapes=[(64,)])
    return ops.add(y, od.input("p", (8, 64)))


@pytest.mark.parametrize(("build", "reason"), [
    (_second_source_is_the_previous_add, "does not read the add before it as its first source"),
    (_add_of_itself, "an operand is computed inside the group"),
    (_mixed_dtypes, "operands and results must share one dtype"),
    (_column_broadcast, "is not one block broadcast over rows"),
    (_transposed_operand, "rows are not packed at one stride"),
    (_broadcast_over_different_axes, "sources broadcast over different axes"),
])
def test_multi_add_check_declines_what_the_kernel_cannot_compute(build: Callable[[], Tensor], reason: str) -> None:
    y = build()
    graph = Graph.build(y)
    adds = [n for n in graph.nodes if n.op == "add"]
    answer = fusion.multi_add_check(H200, adds, graph)
    assert isinstance(answer, str) and reason in answer, answer
    plan = od.compile(y, H200)
    assert not plan.fusions
    for n in adds:  # each add still runs on the GPU, unfused
        assert step_of(plan, n).plugin == "cuda_misc"


def test_multi_add_does_not_fuse_an_intermediate_that_is_an_output() -> None:
    y, _ = chain(3)
    first = y.srcs[0].srcs[0]
    plan = od.compile([y, first], H200)
    assert [(s.kind, len(s.nodes)) for s in work_steps(plan)] == [("kernel", 1), ("fused", 2)]


def test_multi_add_does_not_fuse_an_intermediate_read_elsewhere() -> None:
    y, _ = chain(2)
    z = ops.mul(y, ops.relu(y.srcs[0]))
    plan = od.compile(z, H200)
    assert not plan.fusions and len(work_steps(plan)) == 4


def test_intermediate_outputs_split_the_chain_where_they_are_read() -> None:
    y, _ = chain(4)
    mid = y.srcs[0].srcs[0]  # the second add
    plan = od.compile([y, mid], H200)
    assert [(s.kind, len(s.nodes)) for s in work_steps(plan)] == [("fused", 2), ("fused", 2)]


def test_fusion_off_runs_every_add() -> None:
    y, _ = chain(5)
    plan = od.compile(y, H200, fusion=False)
    assert not plan.fusions and len(work_steps(plan)) == 5


# -- fusions: softcap -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_softcap_fuses_scale_tanh_scale(dtype: str) -> None:
    y = softcap(od.input("x", (4, 100), dtype))
    plan = od.compile(y, H200)
    (step,) = work_steps(plan)
    assert (step.kind, step.plugin, step.kernel) == ("fused", "cuda_misc", "softcap")
    assert [n.op for n in step.nodes] == ["scale", "tanh", "scale"]


@pytest.mark.parametrize(("bias1", "bias2"), [(0.5, 0.0), (0.0, -1.0)])
def test_softcap_does_not_fuse_a_scale_with_bias(bias1: float, bias2: float) -> None:
    y = softcap(od.input("x", (4, 100)), bias1=bias1, bias2=bias2)
    graph = Graph.build(y)
    assert fusion.softcap_check(H200, graph.nodes, graph) == "a scale has a bias"
    plan = od.compile(y, H200)
    assert not plan.fusions and [s.plugin for s in work_steps(plan)] == ["cuda_misc"] * 3
    assert "not fused: softcap (a scale has a bias)" in plan.explain()


def test_softcap_does_not_fuse_when_the_tanh_is_read_elsewhere() -> None:
    x = od.input("x", (4, 100))
    t = ops.tanh(ops.scale(x, 0.1))
    y = ops.scale(t, 10.0)
    plan = od.compile([y, ops.relu(t)], H200)
    assert not plan.fusions and len(work_steps(plan)) == 4


def test_softcap_check_wants_each_op_reading_the_one_before() -> None:
    x, z = od.input("x", (4, 100)), od.input("z", (4, 100))
    s1 = ops.scale(x, 0.1)
    t = ops.tanh(z)
    y = ops.scale(t, 2.0)
    graph = Graph.build([s1, y])
    assert [n.op for n in graph.nodes] == ["scale", "tanh", "scale"]
    assert fusion.softcap_check(H200, graph.nodes, graph) == "the ops do not read each other in order"
    assert not od.compile(graph, H200).fusions


# -- launch specs, without a GPU --------------------------------------------------------------------------

BASE = 0x7F00_0000_0000  # 256-byte aligned, as arena slots are


def fake_ptr(t: Tensor) -> int:
    return BASE + t.view_offset




def fields(spec: KernelSpec, *names: str) -> list[int]:
    """The named kernel arguments of a spec, as ints."""
    return [int(getattr(spec.args, name)) for name in names]


def check_spec(spec: KernelSpec) -> None:
    """The instance is compiled and the arguments have the kernel's parameter types."""
    assert spec.kernel in KERNEL_SOURCES[spec.source]
    name = spec.kernel.split("<")[0]
    assert tuple(type(a) for a in spec.arg_values) == kernel_param_types(spec.source)[name], spec.kernel
    assert 1 <= np.prod(spec.block) <= 1024 or not all(spec.grid)


def binary_spec(a: Tensor, b: Tensor, op: str = "add") -> KernelSpec:
    y = getattr(ops, op)(a, b)
    spec = ew.binary_spec(op, a, b, y, fake_ptr, 132)
    check_spec(spec)
    return spec


@pytest.mark.parametrize(("a_shape", "b_shape", "view", "path"), [
    ((4, 1000), (4, 1000), None, "binary_flat"),
    ((4, 1000), (1,), None, "binary_flat"),  # b one element
    ((7, 13), (7, 13), None, "binary_flat"),  # odd: the tail
    ((6, 64), (64,), None, "binary_rows"),  # row broadcast
    ((2, 3, 64), (3, 64), None, "binary_rows"),  # a block of rows broadcast
    ((6, 66), (66,), None, "binary_bcast"),  # rows not whole vectors
    ((6, 64), (6, 1), None, "binary_bcast"),  # column broadcast
    ((2, 6, 64), (2, 1, 64), None, "binary_bcast"),  # broadcast between outer axes
    ((6, 64), (32,), None, "binary_bcast"),  # tiled by modulo within rows
    ((12, 64), (6, 64), lambda t: t.view((6, 64), (512, 4)), "binary_rows"),  # every other row
    ((64, 6), (6, 64), lambda t: t.T, "binary_bcast"),  # transposed
])
def test_binary_spec_picks_the_path(a_shape: tuple, b_shape: tuple, view: Callable | None, path: str) -> None:
    a = od.input("a", a_shape)
    a = view(a) if view else a
    spec = binary_spec(a, od.input("b", b_shape))
    assert spec.kernel == f"{path}<float, float>"


def test_binary_flat_vectors_and_misaligned_fallback() -> None:
    a, b = od.input("a", (1001,)), od.input("b", (1001,))
    spec = binary_spec(a, b)
    n, nvec, scalar = fields(spec, "n", "nvec", "b_scalar")
    assert (n, nvec, scalar) == (1001, 250, 0)
    big = od.input("big", (1002,))
    shifted = big.view((1001,), (4,), 4)  # 4 bytes past an aligned start
    spec = ew.binary_spec("add", shifted, b, ops.add(shifted, b), fake_ptr, 132)
    assert spec.kernel == "binary_flat<float, float>" and int(spec.args.nvec) == 0  # all as the tail
    spec = binary_spec(od.input("h", (64,), "f16"), od.input("f", (64,), "f32"))
    assert spec.kernel == "binary_flat<od::f16, float>" and int(spec.args.nvec) == 8  # 8 halves a vector
    spec = binary_spec(od.input("x", (5, 8)), od.input("s", (1,)))
    assert int(spec.args.b_scalar) == 1  # b as one element


def test_binary_rows_args_and_misaligned_fallback() -> None:
    a = od.input("a", (2, 3, 64))
    spec = binary_spec(a, od.input("b", (64,)))
    a_rs, b_rs, rows, cols = fields(spec, "a_rs", "b_rs", "rows", "cols")
    assert (a_rs, b_rs, rows, cols) == (64, 0, 6, 64)
    spec = binary_spec(a, od.input("b", (3, 64)))
    assert fields(spec, "a_rs", "b_rs", "rows", "cols") == [192, 0, 2, 192]
    wide = od.input("w", (4, 72))
    v = wide.view((4, 64), (288, 4), 16)  # rows 16-byte aligned: vectors
    assert binary_spec(v, od.input("b", (64,))).kernel.startswith("binary_rows")
    v = wide.view((4, 64), (288, 4), 8)  # 8 bytes off: the general kernel
    assert binary_spec(v, od.input("b", (64,))).kernel.startswith("binary_bcast")


def test_bcast_folds_axes_and_passes_b_by_modulo() -> None:
    a = od.input("a", (2, 3, 4, 5))
    spec = binary_spec(a, od.input("b", (3, 1, 5)))
    # (2, 3, 4, 5) with b (1, 3, 1, 5): axes 2, 3 fold (b 1 along 2), then 0, 1 (b 1 along 0)
    assert fields(spec, "n0", "n1", "n2", "n3") == [1, 1, 6, 20]  # the result
    assert fields(spec, "as0", "as1", "as2", "as3") == [0, 0, 20, 1]  # a
    assert fields(spec, "m0", "m1", "m2", "m3") == [1, 1, 3, 5]  # b: index i % 3, j % 5
    assert fields(spec, "bs0", "bs1", "bs2", "bs3") == [0, 0, 5, 1]
    # a row broadcast over contiguous rows folds to one axis read by modulo
    assert ew.fold((6, 5), [((6, 5), (5, 1)), ((5,), (1,))]) == ((1, 1, 1, 30), [((1, 1, 1, 30), (0, 0, 0, 1)),
                                                                                ((1, 1, 1, 5), (0, 0, 0, 1))])
    # a transposed source keeps its axes
    assert ew.fold((6, 5), [((6, 5), (1, 6))]) == ((1, 1, 6, 5), [((1, 1, 6, 5), (0, 0, 1, 6))])


@pytest.mark.parametrize(("shape", "view", "path"), [
    ((8, 1000), None, "unary_flat"),
    ((7, 13), None, "unary_flat"),
    ((8, 64), lambda t: t.T, "unary_strided"),
    ((4, 6, 64), lambda t: t.permute(1, 0, 2), "unary_strided"),
])
@pytest.mark.parametrize("dtype", FLOATS)
def test_unary_spec_picks_the_path(shape: tuple, view: Callable | None, path: str, dtype: str) -> None:
    x = od.input("x", shape, dtype)
    x = view(x) if view else x
    y = ops.gelu(x)
    spec = unary.unary_spec(unary.UNARY_CODES["gelu"], x, y, 0.0, 0.0, fake_ptr, 132)
    check_spec(spec)
    assert spec.kernel == f"{path}<{ew.CTYPES[dtype]}>"
    if path == "unary_flat":
        vec = 16 // ew.ITEMSIZE[dtype]
        assert int(spec.args.nvec) == y.size // vec


def test_unary_flat_misaligned_runs_as_the_tail() -> None:
    x = od.input("x", (101,)).view((100,), (4,), 4)
    spec = unary.unary_spec(0, x, ops.abs(x), 0.0, 0.0, fake_ptr, 132)
    assert spec.kernel == "unary_flat<float>" and int(spec.args.nvec) == 0 and spec.grid[0] >= 1


def test_map_params_reach_the_kernel() -> None:
    x = od.input("x", (4, 8))
    for y, p in ((ops.scale(x, 2.5, -1.0), (2.5, -1.0)), (ops.clamp(x, -0.5, 0.5), (-0.5, 0.5)),
                 (ops.leaky_relu(x, 0.2), (0.2, 0.0)), (ops.exp(x), (0.0, 0.0))):
        assert unary.map_params(y) == p


@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
def test_glu_spec_points_at_the_halves(swapped: bool, dtype: str) -> None:
    x = od.input("x", (3, 5, 128), dtype)
    y = ops.glu(x, "swiglu", swapped)
    spec = unary.glu_spec(y, fake_ptr, 132)
    check_spec(spec)
    size = ew.ITEMSIZE[dtype]
    g, u = fields(spec, "g", "u")
    assert (g - BASE, u - BASE) == ((64 * size, 0) if swapped else (0, 64 * size))
    assert fields(spec, "gs0", "gs1", "gs2") == [0, 0, 128]  # rows folded into one axis
    assert int(spec.args.vec) == 1  # vectors


def test_glu_spec_split_form_and_unaligned_rows() -> None:
    a, b = od.input("a", (4, 6, 36)), od.input("b", (6, 4, 36)).permute(1, 0, 2)
    y = ops.glu_split(a, b, "geglu")
    spec = unary.glu_spec(y, fake_ptr, 132)
    check_spec(spec)
    assert int(spec.args.vec) == 1 and fields(spec, "us0", "us1", "us2") == [0, 36, 144]
    odd = ops.glu(od.input("x", (4, 10)), "reglu")  # rows of 5: no vectors
    assert int(unary.glu_spec(odd, fake_ptr, 132).args.vec) == 0


@pytest.mark.parametrize("n_adds", [2, 5, 8])
def test_multi_add_spec(n_adds: int) -> None:
    y, xs = chain(n_adds, (6, 64), b_shapes=[(64,) if i % 2 else (6, 64) for i in range(n_adds)])
    graph = Graph.build(y)
    nodes = [n for n in graph.nodes if n.op == "add"]
    assert fusion.multi_add_check(H200, nodes, graph) is True
    spec = ew.multi_add_spec(nodes, fake_ptr, 132)
    check_spec(spec)
    strides = fields(spec, *(f"rs{i}" for i in range(len(xs))))
    assert strides == [64] + [0 if i % 2 else 64 for i in range(n_adds)]
    assert int(spec.args.n) == n_adds + 1 and int(spec.args.vec) == 1


def test_add_id_spec() -> None:
    a = od.input("a", (3, 2, 16))
    b, ids = od.input("b", (5, 16), "f16"), od.input("ids", (3, 2), "i32")
    y = ops.add_id(a, b, ids)
    guard = FakeGuard()
    spec = ew.add_id_spec(y, fake_ptr, guard, 132)
    check_spec(spec)
    assert spec.kernel == "add_id<float, od::f16>"
    assert fields(spec, "n_t", "n_u", "n_c", "n_e") == [3, 2, 16, 5]
    assert guard.uses == [(y, ids, 5, f"a bias row of {b.describe()}", "its output row is filled with NaN")]
    assert (int(spec.args.err_.word), int(spec.args.err_.tag)) == (FAKE_WORD, 0)


def test_empty_tensors_launch_nothing() -> None:
    x = od.input("x", (0, 8))
    assert unary.unary_spec(0, x, ops.abs(x), 0, 0, fake_ptr, 132).grid == (0,)
    assert 0 in ew.binary_spec("add", x, od.input("b", (8,)), ops.add(x, od.input("b", (8,))), fake_ptr, 132).grid


def test_grids_fill_the_gpu_without_exceeding_cuda_limits() -> None:
    assert ew.grid_flat(1 << 30, 132) == 132 * ew.BLOCKS_PER_SM * ew.WAVES
    assert ew.grid_flat(100, 132) == 1
    (gx, gy), (bx, by) = ew.grid_2d(5, 1 << 31, 132)
    assert bx * by == ew.THREADS and bx == 8 and gy <= 65535
    (gx, gy), (bx, by) = ew.grid_2d(1 << 20, 1, 132)
    assert bx == 256 and gy == 1 and gx == min(4096, 132 * ew.BLOCKS_PER_SM * ew.WAVES)


# -- on a GPU -----------------------------------------------------------------------------------------------


def values(rng: np.random.Generator, shape: Sequence[int], lo: float, hi: float) -> np.ndarray:
    return rng.uniform(lo, hi, tuple(shape))


def run_checked(outputs: Tensor | Sequence[Tensor], draw: Callable[[], dict], bound: float, what: str,
                fusion: bool = True, expect_fused: int | None = None) -> list[list[np.ndarray]]:
    """Run on cuda0 (every elementwise node by cuda_misc there) and on the reference, twice with
    fresh inputs and poisoned arenas; each output within `bound` and changed where the reference did."""
    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    plan = od.compile(outs, "cuda0", fusion=fusion)
    for s in work_steps(plan):
        assert (s.plugin, s.device.name) == ("cuda_misc", "cuda0"), plan.explain()
    if expect_fused is not None:
        assert len(plan.fusions) == expect_fused, plan.explain()
    ref = od.compile(outs, "cpu")
    got_runs, ref_runs = [], []
    for _ in range(2):  # the first run launches directly, the second replays a captured graph
        feeds = draw()
        plan.poison()  # NaN everywhere: an element not written fails the NMSE
        got_runs.append(plan.run(feeds))
        ref_runs.append(ref.run(feeds))
    for i, o in enumerate(outs):
        for run, (got, want) in enumerate(zip(got_runs, ref_runs)):
            g, w = np.asarray(got[i], np.float64), np.asarray(want[i], np.float64)
            err = nmse(g, w)
            assert err <= bound, f"{what}, output {i}, run {run}: NMSE {err:.3g} > {bound}"
        # unwritten: equal to the previous run's value where the reference changed, and not the
        # right value (2 ulps of slack, of the value or of the output's scale: a tiny or tail value
        # the reference rounds differently may repeat by chance)
        g1, g2 = (np.asarray(r[i], np.float64) for r in got_runs)
        w1, w2 = (np.asarray(r[i], np.float64) for r in ref_runs)
        ulp = ULP[o.dtype.name]
        with np.errstate(invalid="ignore"):
            scale = np.sqrt(np.mean(w2[np.isfinite(w2)] ** 2)) if np.isfinite(w2).any() else 0.0
            stale = (g1 == g2) & (w1 != w2) & ~(np.abs(g2 - w2) <= 2 * ulp * (np.abs(w2) + scale))
        assert not stale.any(), f"{what}: {int(stale.sum())} values kept the previous run's"
    return got_runs


def input_range(op: str, dtype: str) -> tuple[float, float]:
    """The conformance ranges (docs/conformance.md): unary [-150, 150], exp-like f16/bf16 [-10, 10];
    log/sqrt positive."""
    if op in ("log", "sqrt"):
        return 0.01, 100.0
    if op in ("scale", "clamp", "leaky_relu", "sqr", "sin", "cos"):
        return -10.0, 10.0
    if dtype != "f32" and op in EXP_LIKE:
        return -10.0, 10.0
    return -150.0, 150.0


LAYOUTS: dict[str, tuple[tuple[int, ...], Callable[[Tensor], Tensor] | None]] = {
    "contiguous": ((3, 5, 1000), None),
    "odd": ((5, 7, 11, 13), None),
    "one element": ((1,), None),
    "transposed": ((33, 70), lambda t: t.T),
    "permuted": ((4, 6, 5, 40), lambda t: t.permute(2, 0, 3, 1)),
    "every other row": ((10, 64), lambda t: t.view((5, 64), (t.strides[0] * 2, t.strides[1]))),
    "misaligned": ((1001,), lambda t: t.view((1000,), t.strides, t.strides[0])),
}


@gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", list(unary.MAP_OPS))
def test_map_ops_match_the_reference(op: str, dtype: str, layout: str, rng) -> None:  # noqa: ANN001
    shape, view = LAYOUTS[layout]
    x = od.input("x", shape, dtype)
    y = map_op(op, view(x) if view else x)
    lo, hi = input_range(op, dtype)
    if layout == "one element":  # alone, a subnormal tail value's rounding would be the whole NMSE
        lo, hi = max(lo, -5.0), min(hi, 5.0)
    run_checked(y, lambda: {x: values(rng, shape, lo, hi)}, BOUND[dtype], f"{op} {dtype} {layout}")


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
def test_map_ops_on_special_values(dtype: str) -> None:
    """NaN, infinities, zeros of both signs, halves and the softplus threshold, as the reference maps them."""
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 0.5, -0.5, 1.5, -2.5, 20.0, 20.5, 19.5, 3.0, -3.0,
                        1e-3, -1e-3, 4.0, -4.0])
    x = od.input("x", special.shape, dtype)
    for op in unary.MAP_OPS:
        y = map_op(op, x)
        (got,) = od.compile(y, "cuda0").run({x: special})
        (want,) = od.compile(y, "cpu").run({x: special})
        g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
        tol = {"f32": 1e-6, "f16": 2.0**-10, "bf16": 2.0**-7}[dtype]
        with np.errstate(invalid="ignore"):  # inf - inf
            same = (g == w) | (np.isnan(g) & np.isnan(w)) | (np.abs(g - w) <= tol * np.abs(w))
        assert same.all(), f"{op} {dtype}: got {g[~same]} for {special[~same]}, want {w[~same]}"


BROADCASTS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "same shape": ((3, 4, 5, 64), (3, 4, 5, 64)),
    "row": ((3, 4, 5, 64), (64,)),
    "rows of one axis": ((3, 4, 5, 64), (5, 64)),
    "axis 0": ((3, 4, 5, 64), (3, 1, 1, 1)),
    "axis 1": ((3, 4, 5, 64), (1, 4, 1, 1)),
    "axis 2": ((3, 4, 5, 64), (5, 1)),
    "axis 3 (column)": ((3, 4, 5, 64), (3, 4, 5, 1)),
    "tiled by modulo": ((6, 4, 10, 64), (2, 1, 5, 16)),
    "one element": ((3, 4, 5, 64), (1,)),
    "odd": ((5, 7, 11, 13), (7, 1, 13)),
    "odd rows": ((9, 13), (13,)),
    "large": ((64, 4096), (4096,)),
}


@gpu
@pytest.mark.parametrize("case", list(BROADCASTS))
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_broadcasting_matches_the_reference(op: str, case: str, rng) -> None:  # noqa: ANN001
    a_shape, b_shape = BROADCASTS[case]
    a, b = od.input("a", a_shape), od.input("b", b_shape)
    lo, hi = (0.9, 1.1) if op in ("mul", "div") else (-1.0, 1.0)
    run_checked(getattr(ops, op)(a, b), lambda: {a: values(rng, a_shape, lo, hi), b: values(rng, b_shape, lo, hi)},
                BOUND["f32"], f"{op} {case}")


@gpu
@pytest.mark.parametrize(("da", "db"), ew.BINARY_PAIRS)
@pytest.mark.parametrize("case", ["same shape", "row", "axis 1", "one element", "odd"])
@pytest.mark.parametrize("op", ["add", "mul", "div"])
def test_binary_dtype_pairs_match_the_reference(op: str, case: str, da: str, db: str, rng) -> None:  # noqa: ANN001
    a_shape, b_shape = BROADCASTS[case]
    a, b = od.input("a", a_shape, da), od.input("b", b_shape, db)
    lo, hi = (0.9, 1.1) if op in ("mul", "div") else (-1.0, 1.0)
    run_checked(getattr(ops, op)(a, b), lambda: {a: values(rng, a_shape, lo, hi), b: values(rng, b_shape, lo, hi)},
                BOUND[da], f"{op} {da}/{db} {case}")


def _strided(case: str, dtype: str) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(a view, b view, leaves) of shape (48, 64) or b a row, laid out as `case` says."""
    full = lambda name, shape: od.input(name, shape, dtype)  # noqa: E731
    if case == "a transposed":
        a, b = full("a", (64, 48)), full("b", (48, 64))
        return a.T, b, [a, b]
    if case == "b transposed":
        a, b = full("a", (48, 64)), full("b", (64, 48))
        return a, b.T, [a, b]
    if case == "both transposed":
        a, b = full("a", (64, 48)), full("b", (64, 48))
        return a.T, b.T, [a, b]
    if case == "a every other row, b a row":
        a, b = full("a", (96, 64)), full("b", (64,))
        return a.view((48, 64), (a.strides[0] * 2, a.strides[1])), b, [a, b]
    if case == "a misaligned, b a row":
        a, b = full("a", (48, 65)), full("b", (64,))
        return a.view((48, 64), a.strides, a.strides[1]), b, [a, b]
    if case == "b strided rows":
        a, b = full("a", (48, 64)), full("b", (48, 72))
        return a, b.view((48, 64), b.strides), [a, b]
    raise ValueError(case)


@gpu
@pytest.mark.parametrize("case", ["a transposed", "b transposed", "both transposed", "a every other row, b a row",
                                  "a misaligned, b a row", "b strided rows"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_binary_with_strided_sources(case: str, dtype: str, rng) -> None:  # noqa: ANN001
    a, b, leaves = _strided(case, dtype)
    y = ops.mul(a, b)
    run_checked(y, lambda: {t: values(rng, t.shape, 0.9, 1.1) for t in leaves}, BOUND[dtype], f"mul {dtype} {case}")


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "misaligned"])
def test_add1_matches_the_reference(dtype: str, layout: str, rng) -> None:  # noqa: ANN001
    shape, view = LAYOUTS[layout]
    x, s = od.input("x", shape, dtype), od.input("s", (1,), dtype)
    y = ops.add1(view(x) if view else x, s)
    run_checked(y, lambda: {x: values(rng, shape, -1, 1), s: values(rng, (1,), -1, 1)}, BOUND[dtype],
                f"add1 {dtype} {layout}")


@gpu
@pytest.mark.parametrize(("da", "db"), ew.BINARY_PAIRS)
@pytest.mark.parametrize("permuted", [False, True])
def test_add_id_matches_the_reference(da: str, db: str, permuted: bool, rng) -> None:  # noqa: ANN001
    n_t, n_u, n_c, n_e = 7, 4, 130, 6
    a = od.input("a", (n_u, n_t, n_c) if permuted else (n_t, n_u, n_c), da)
    b, ids = od.input("b", (n_e, n_c), db), od.input("ids", (n_t, n_u), "i32")
    y = ops.add_id(a.permute(1, 0, 2) if permuted else a, b, ids)
    run_checked(y, lambda: {a: values(rng, a.shape, -1, 1), b: values(rng, b.shape, -1, 1),
                            ids: rng.integers(0, n_e, (n_t, n_u))}, BOUND[da], f"add_id {da}/{db}")


GLU_SHAPES = {"rows of 64": (6, 128), "4 dims": (2, 3, 5, 256), "odd": (7, 26), "long rows": (3, 2 * 11008)}


@gpu
@pytest.mark.parametrize("shape", list(GLU_SHAPES))
@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kind", GLU_KINDS)
def test_glu_fused_halves(kind: str, dtype: str, swapped: bool, shape: str, rng) -> None:  # noqa: ANN001
    dims = GLU_SHAPES[shape]
    x = od.input("x", dims, dtype)
    y = ops.glu(x, kind, swapped, alpha=1.702, limit=7.0)
    lo, hi = (-10, 10) if dtype != "f32" else (-150, 150)
    run_checked(y, lambda: {x: values(rng, dims, lo, hi)}, BOUND[dtype], f"glu {kind} {dtype} swapped={swapped}")


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kind", GLU_KINDS)
@pytest.mark.parametrize("layout", ["contiguous", "permuted rows", "strided rows"])
def test_glu_split(kind: str, dtype: str, layout: str, rng) -> None:  # noqa: ANN001
    a, b = od.input("a", (4, 6, 96), dtype), od.input("b", (6, 4, 96), dtype)
    bv = b.permute(1, 0, 2)
    if layout == "contiguous":
        b = od.input("b", (4, 6, 96), dtype)
        bv = b
    elif layout == "strided rows":
        b = od.input("b", (4, 6, 100), dtype)
        bv = b.view((4, 6, 96), b.strides, 2 * b.dtype.block_bytes)
    y = ops.glu_split(a, bv, kind, alpha=1.5, limit=3.0)
    run_checked(y, lambda: {a: values(rng, a.shape, -10, 10), b: values(rng, b.shape, -10, 10)}, BOUND[dtype],
                f"glu_split {kind} {dtype} {layout}")


MULTI_ADD_CASES = {
    "same shape": ((16, 256), None),
    "row broadcasts": ((16, 256), "row"),
    "odd rows": ((9, 13), "row"),
    "4 dims": ((2, 3, 4, 64), None),
}


@gpu
@pytest.mark.parametrize("case", list(MULTI_ADD_CASES))
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n_adds", range(2, 9))
def test_multi_add_matches_reference_and_unfused_exactly(n_adds: int, dtype: str, case: str, rng) -> None:  # noqa: ANN001
    shape, bcast = MULTI_ADD_CASES[case]
    b_shapes = [shape[-1:] if bcast and i % 2 else shape for i in range(n_adds)]
    y, xs = chain(n_adds, shape, dtype, b_shapes)
    draw = lambda: {x: values(rng, x.shape, -1, 1) for x in xs}  # noqa: E731
    fused = run_checked(y, draw, BOUND[dtype], f"multi_add {n_adds} {dtype} {case}", expect_fused=1)
    feeds = draw()
    (f,) = od.compile(y, "cuda0").run(feeds)
    (u,) = od.compile(y, "cuda0", fusion=False).run(feeds)
    assert np.array_equal(f, u), f"fused and unfused differ ({dtype}, {n_adds} adds)"
    assert fused


@gpu
def test_multi_add_with_strided_first_operand(rng) -> None:  # noqa: ANN001
    base = od.input("base", (8, 80))
    x0 = base.view((8, 64), base.strides, 16 * 4)
    y = ops.add(ops.add(ops.add(x0, od.input("x1", (8, 64))), od.input("x2", (64,))), od.input("x3", (8, 64)))
    leaves = Graph.build(y).inputs
    run_checked(y, lambda: {t: values(rng, t.shape, -1, 1) for t in leaves}, BOUND["f32"], "multi_add strided",
                expect_fused=1)


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "odd", "transposed", "misaligned"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_softcap_matches_reference_and_unfused_exactly(dtype: str, layout: str, rng) -> None:  # noqa: ANN001
    shape, view = LAYOUTS[layout]
    x = od.input("x", shape, dtype)
    y = softcap(view(x) if view else x, 1 / 30.0, 30.0)
    draw = lambda: {x: values(rng, shape, -100, 100)}  # noqa: E731
    run_checked(y, draw, BOUND[dtype], f"softcap {dtype} {layout}", expect_fused=1)
    feeds = draw()
    (f,) = od.compile(y, "cuda0").run(feeds)
    (u,) = od.compile(y, "cuda0", fusion=False).run(feeds)
    assert np.array_equal(f, u), f"fused and unfused softcap differ ({dtype}, {layout})"


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
def test_chains_reuse_buffers_in_place(dtype: str, rng) -> None:  # noqa: ANN001
    """Elementwise chains whose outputs the memory plan puts on a source's bytes."""
    x, b = od.input("x", (64, 1000), dtype), od.input("b", (1000,), dtype)
    y = ops.silu(ops.mul(ops.scale(ops.add(ops.sqr(x), b), 0.5, 0.1), b))
    plan = od.compile(y, "cuda0", fusion=False)
    slots = plan.memory["cuda0"].slots
    assert any(len(s.keys) > 1 for s in slots), "expected in-place reuse"
    run_checked(y, lambda: {x: values(rng, x.shape, -2, 2), b: values(rng, b.shape, 0.5, 1.5)}, BOUND[dtype],
                f"in-place chain {dtype}", fusion=False)


@gpu
@pytest.mark.parametrize("build", ["binary flat", "binary rows", "binary bcast", "unary flat"])
def test_output_may_alias_source_a(build: str, rng) -> None:  # noqa: ANN001
    from opdispatch.backends.cuda.backend import backend_for
    from opdispatch.backends.cuda.devices import discover

    backend = backend_for(discover()[0][0])
    a = od.input("a", (6, 4, 100))
    b = od.input("b", (6, 4, 100) if build == "binary flat" else (100,) if build == "binary rows" else (4, 1))
    y = ops.exp(a) if build.startswith("unary") else ops.sub(a, b)
    av, bv = values(rng, a.shape, -1, 1), values(rng, b.shape, -1, 1)
    buf_a, buf_b = backend.alloc(a.nbytes, "a and y"), backend.alloc(b.nbytes, "b")
    backend.write(buf_a, 0, av.astype(np.float32))
    backend.write(buf_b, 0, bv.astype(np.float32))
    ctx = backend.bind_context(lambda t: (buf_b, 0) if t is b else (buf_a, 0))  # y on a's bytes
    if build.startswith("unary"):
        spec = unary.unary_spec(unary.UNARY_CODES["exp"], a, y, 0.0, 0.0, ctx.ptr, 132)
    elif build == "binary bcast":
        spec = ew.binary_bcast_spec("sub", a, b, y, ctx.ptr, 132)
    else:
        spec = ew.binary_spec("sub", a, b, y, ctx.ptr, 132)
    with backend.cuda_device:
        spec.launch(ctx.stream)()
    got = backend.read(buf_a, 0, a.nbytes).view(np.float32).reshape(a.shape)
    (want,) = od.compile(y, "cpu").run({a: av, b: bv} if not build.startswith("unary") else {a: av})
    assert nmse(got, want) <= BOUND["f32"], build


@gpu
@pytest.mark.parametrize("case", edge_cases(
    "sqr", "sqrt", "log", "sin", "cos", "abs", "sgn", "neg", "step", "tanh", "elu", "relu", "sigmoid", "gelu",
    "gelu_erf", "gelu_quick", "silu", "hardswish", "hardsigmoid", "exp", "expm1", "softplus", "floor", "ceil",
    "round", "trunc", "leaky_relu", "scale", "clamp", "add", "sub", "mul", "div", "glu"))
def test_edge_values_match_the_reference(case, seed: int) -> None:  # noqa: ANN001
    """The sweep's edge-value cases (docs/ops.md, "Edge values") on cuda_misc, NaN positions included:
    infinities, NaN, signed zeros and subnormals through every map, the binary ops and glu: sgn/step/floor/
    ceil/sqrt/log of a subnormal as the reference gives them despite -ftz=true."""
    res = run_case(case, "cuda0", plugin="cuda_misc", seed=seed)
    assert res.status is Status.PASS, res.describe()
