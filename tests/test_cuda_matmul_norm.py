"""The rms_norm fused into the block-format mat-vec (cuda_matmul's rms_norm_mul_mat groups): rms_norm(x) -> mul(w)
-> mul_mat, and the same before a gate/up GLU pair, run as one mmvq_stream launch that quantizes x * w and scales
each column's products by the norm's rsqrt; where other nodes read the normed values too, the launch also writes
them (rms_norm_mul_mat_share). Planning on the H200 description here (which groups fuse, what the
launch reads, the declines and their reasons); on the GPU, against the reference and the unfused plan. The
kernel's arithmetic on the CPU: tests/test_mmvq_stream_emulated.py's rms_norm cases."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.devices import H200
from opdispatch.hookspecs import Device
from opdispatch.models.llama import PRESETS, LlamaModel, random_weights
from opdispatch.models.llama.stored import random_params
from opdispatch.plugins.cuda_matmul import bind, fusion, support
from opdispatch.plugins.cuda_matmul.specs import mmv
from opdispatch.tensor import Tensor
from helpers import FakeGuard
from test_cuda_matmul import assert_close, check_spec, fake_ptr, fake_scratch, feeds_for, gpu, poison_arenas

EPS = 1e-5


def normed(dt: str, m: int, k: int, n: int, glu: bool = False, w_shape: tuple | None = None) -> Tensor:
    """rms_norm(x) * w before one product of type dt, or before a gate/up GLU pair."""
    h = ops.mul(ops.rms_norm(od.input("x", (n, k)), EPS), od.input("nw", w_shape or (k,)))
    if not glu:
        return ops.mul_mat(od.input("w", (m, k), dt), h)
    return ops.glu_split(ops.mul_mat(od.input("wg", (m, k), dt), h), ops.mul_mat(od.input("wu", (m, k), dt), h),
                         "swiglu")


@pytest.mark.parametrize("dt", ["q4_0", "q8_0", "q4_K", "q6_K", "iq4_xs"])
@pytest.mark.parametrize("glu", [False, True])
def test_norm_fuses_into_the_stream_matvec(dt: str, glu: bool) -> None:
    """One launch for the whole group; it reads x (not the mul's result), the norm weight and eps."""
    y = normed(dt, 256, 2048, 1, glu)
    plan = od.compile(y, H200)
    (step,) = plan.fusions
    assert step.kernel == ("rms_norm_mul_mat_glu" if glu else "rms_norm_mul_mat"), plan.explain()
    assert plan.summary()["launches"] == 1, plan.explain()
    norm = fusion.norm_of(step.nodes)
    assert norm is not None and (norm.x.name, norm.w.name, norm.eps) == ("x", "nw", pytest.approx(EPS))
    (launch,) = mmv.fused_specs(step.nodes, fake_ptr, fake_scratch, FakeGuard(), H200)
    check_spec(launch)
    assert launch.kernel.startswith("mmvq_stream<") and ("EPI_GLU" in launch.kernel) == glu
    args = launch.args
    assert (int(args.b), int(args.norm_w)) == (fake_ptr(norm.x), fake_ptr(norm.w))
    assert float(args.norm_eps) == pytest.approx(EPS)
    assert int(args.out) == fake_ptr(step.nodes[-1])


def test_unfused_matvec_passes_no_norm() -> None:
    y = ops.mul_mat(od.input("w", (64, 256), "q4_0"), od.input("x", (1, 256)))
    (launch,) = mmv.mmv_specs(y, y, fake_ptr, fake_scratch, device=H200)
    assert launch.kernel.startswith("mmvq_stream<") and int(launch.args.norm_w) == 0


NOT_THERE = f"the rms_norm fuses into {', '.join(fusion.NORM_PATHS)} only"


@pytest.mark.parametrize(("make", "why"), [
    (lambda: normed("f16", 256, 2048, 1), f"takes mmvf; {NOT_THERE}"),
    (lambda: normed("f16", 256, 2048, 16), f"takes mmf; {NOT_THERE}"),
    (lambda: normed("q4_0", 256, 2048, 2, w_shape=(2, 2048)), "is not one contiguous f32 row of 2048 values"),
])
def test_norm_declined_with_its_reason(make, why: str) -> None:  # noqa: ANN001
    """Where the product is not mmvq_stream, or w is not one row, the group is declined with the reason, and
    cuda_norm's rms_norm -> mul runs the norm."""
    assert_declined(make(), why, H200)


def test_norm_declined_where_the_device_takes_another_matvec() -> None:
    """The check asks the device the group binds for: on an sm_75 GPU the product takes mmvq (no cp.async), so
    the norm stays cuda_norm's, where an H200 description would have said mmvq_stream."""
    old = Device("cuda0", "cuda", "an sm_75 GPU", {**H200.props, "cc": (7, 5)})
    assert_declined(normed("q4_0", 256, 2048, 1), f"takes mmvq; {NOT_THERE}", old)


def assert_declined(y: Tensor, why: str, device: Device) -> None:
    graph = od.Graph.build(y)
    assert why in str(fusion.check(device, list(graph.nodes), graph))
    plan = od.compile(y, device)
    assert "rms_norm_mul" in [s.kernel for s in plan.fusions], plan.explain()
    assert not any(s.kernel.startswith("rms_norm_mul_mat") for s in plan.fusions), plan.explain()


def shared(n: int, k: int = 2048) -> list[Tensor]:
    """rms_norm(x) * w read by three products, as a decoder's separate q (q4_K), k (q4_K) and v (q6_K)."""
    h = ops.mul(ops.rms_norm(od.input("x", (n, k)), EPS), od.input("nw", (k,)))
    return [ops.mul_mat(od.input(name, (m, k), dt), h) for name, m, dt in
            (("wq", 512, "q4_K"), ("wk", 128, "q4_K"), ("wv", 128, "q6_K"))]


def test_norm_read_elsewhere_is_fused_and_written() -> None:
    """The normed values also feed other products: the first product's mat-vec takes the norm and writes them
    (rms_norm_mul_mat_share, the mul node its second output); the others read them. No norm launch is left."""
    outs = shared(1)
    plan = od.compile(outs, H200)
    (step,) = plan.fusions
    assert step.kernel == fusion.SHARE and [n.op for n in step.nodes] == ["rms_norm", "mul", "mul_mat"]
    assert plan.summary()["launches"] == 3, plan.explain()
    (launch,) = mmv.fused_specs(step.nodes, fake_ptr, fake_scratch, FakeGuard(), H200, share=True)
    check_spec(launch)
    assert int(launch.args.norm_out) == fake_ptr(step.nodes[1]) and int(launch.args.norm_w) == fake_ptr(
        fusion.norm_of(step.nodes).w)
    assert launch.kernel.endswith(", true>")  # the instance that writes them (KEEP)
    (plain,) = mmv.fused_specs(step.nodes, fake_ptr, fake_scratch, FakeGuard(), H200)
    assert int(plain.args.norm_out) == 0 and not plain.kernel.endswith(", true>")


def test_share_declined_above_one_column() -> None:
    """The instances that write the normed values take one column: at 4, the norm stays cuda_norm's."""
    outs = shared(4)
    graph = od.Graph.build(outs)
    assert "4 columns" in str(fusion.check_share(H200, list(graph.nodes)[:3], graph))
    plan = od.compile(outs, H200)
    assert [s.kernel for s in plan.fusions] == ["rms_norm_mul"], plan.explain()


def test_normed_graph_output_is_written_by_the_matvec() -> None:
    """The normed values a graph output: the same rule writes them."""
    h = ops.mul(ops.rms_norm(od.input("x", (1, 512)), EPS), od.input("nw", (512,)))
    y = ops.mul_mat(od.input("w", (64, 512), "q4_K"), h)
    plan = od.compile([y, h], H200)
    assert [s.kernel for s in plan.fusions] == [fusion.SHARE], plan.explain()


@pytest.mark.parametrize(("n", "path"), [(9, "mmq_small"), (16, "mmq_small"), (64, "mmq")])
@pytest.mark.parametrize("glu", [False, True])
def test_norm_fuses_into_the_gemms_quantize(n: int, path: str, glu: bool) -> None:
    """Above the mat-vecs' 8 columns the quantized GEMMs take the norm through their quantize_q8_1 launch, which
    reads x, the norm weight and eps and rounds the normed values once; a gate/up pair (whose GLU does not fuse
    on the GEMMs) shares it: one quantize, then the products' GEMMs, the gate's written for the GLU; on mmq_small
    one launch runs both (a pair: a1 and out1 the up product's weights and output)."""
    y = normed("q4_0", 512, 2048, n, glu)
    plan = od.compile(y, H200)
    step = plan.fusions[0]
    assert step.kernel == (fusion.PAIR if glu else "rms_norm_mul_mat"), plan.explain()
    assert plan.summary()["launches"] == 1 + glu, plan.explain()  # the group, and the GLU's own kernel
    norm = fusion.norm_of(step.nodes)
    prods = fusion.parts(step.nodes)[0]
    assert [support.choose(p, H200).path for p in prods] == [path] * (2 if glu else 1)
    quant, *gemms = bind.gemm_fused_specs(step.nodes, fake_ptr, fake_scratch, H200)
    for spec in (quant, *gemms):
        check_spec(spec)
    paired = glu and path == "mmq_small"
    assert quant.kernel == "quantize_q8_1<B_F32, true>" and len(gemms) == (1 if paired else len(prods))
    args = quant.args
    assert (int(args.b), int(args.nw), float(args.eps)) == (fake_ptr(norm.x), fake_ptr(norm.w), pytest.approx(EPS))
    assert all(int(g.args.bq) == int(args.bq) and g.kernel.startswith(path) for g in gemms)
    if paired:
        (g,) = gemms
        assert [int(g.args.out), int(g.args.out1)] == [fake_ptr(p) for p in prods]
        assert [int(g.args.a), int(g.args.a1)] == [fake_ptr(p.srcs[0]) for p in prods]
        assert g.grid[0] == 2 * g.args.tiles_m * g.args.splits
    else:
        assert [int(g.args.out) for g in gemms] == [fake_ptr(p) for p in prods]


def test_share_declines_ragged_rows() -> None:
    """The instances that write the normed values take rows of whole chunks: a q6_K product at K 3584 (rows of
    14 blocks, not whole 8-block chunks) declines SHARE, saying why, and its mat-vec runs the RAGGED instance."""
    k = 3584
    h = ops.mul(ops.rms_norm(od.input("x", (1, k)), EPS), od.input("nw", (k,)))
    v = ops.mul_mat(od.input("wv", (128, k), "q6_K"), h)
    nodes = [h.srcs[0], h, v]
    assert fusion.check_share(H200, nodes, od.Graph.build(v)) == (
        "rows that are not whole chunks: the kernels that write the normed values take whole chunks")
    assert support.choose(v, H200).path == "mmvq_stream"


def test_norm_declines_legacy_ragged_rows() -> None:
    """A legacy format at a K that is not whole chunks (q4_0 at 4128) has no RAGGED instance: its mat-vec runs mmvq,
    so neither norm rule fuses (each saying why)."""
    k = 4128
    h = ops.mul(ops.rms_norm(od.input("x", (1, k)), EPS), od.input("nw", (k,)))
    v = ops.mul_mat(od.input("wv", (128, k), "q4_0"), h)
    nodes = [h.srcs[0], h, v]
    graph = od.Graph.build(v)
    assert support.choose(v, H200).path == "mmvq"
    assert fusion.check_share(H200, nodes, graph) == (
        "rows that are not whole chunks: the kernels that write the normed values take whole chunks")
    assert fusion.check(H200, nodes, graph) == (
        f"mul_mat takes mmvq; the rms_norm fuses into {', '.join(fusion.NORM_PATHS)} only")


def test_pair_declined_off_the_gemms() -> None:
    """Two products of the normed values at one column (the mat-vec): no shared quantize there."""
    h = ops.mul(ops.rms_norm(od.input("x", (1, 2048)), EPS), od.input("nw", (2048,)))
    nodes = [h.srcs[0], h, *(ops.mul_mat(od.input(f"w{i}", (512, 2048), "q4_0"), h) for i in range(2))]
    assert "takes mmvq_stream; two products share" in str(fusion.check_pair(H200, nodes, od.Graph.build(nodes[2:])))


def test_decode_plan_fuses_every_norm_into_its_matvec() -> None:
    """A q4_0 decode step at batch 1 (the mat-vecs' widths: mmvq_stream): every rms_norm (two a layer and the
    final one) runs inside the mat-vec after it: no norm kernel is left."""
    cfg = attrs.evolve(PRESETS["tiny"], hidden=256, heads=4, kv_heads=2, ffn=512, dtype="q4_0")  # head size 64
    model = LlamaModel(cfg, random_weights(cfg))
    plan = od.compile(model.build(1, 20)[0], H200)
    kernels = [s.kernel for s in plan.fusions]
    assert kernels.count("rms_norm_mul_mat") == cfg.layers + 1, plan.explain()
    assert kernels.count("rms_norm_mul_mat_glu") == cfg.layers, plan.explain()
    assert not any(s.nodes[0].op == "rms_norm" and not s.kernel.startswith("rms_norm_mul_mat") for s in plan.steps)
    assert support.choose(next(s for s in plan.fusions if s.kernel == "rms_norm_mul_mat").nodes[2], H200).path == (
        "mmvq_stream")


def test_q4_k_m_decode_plan_fuses_every_norm() -> None:
    """A Q4_K_M decode step at batch 1: the layers whose attn_v is q6_K stack only q and k, so their norm is read
    by two products: rms_norm_mul_mat_share runs it in the q/k mat-vec. No norm kernel is left."""
    cfg = attrs.evolve(PRESETS["tiny"], hidden=2048, heads=16, kv_heads=4, ffn=1024, layers=4, vocab=512,
                       dtype="q4_K")
    model = LlamaModel(cfg, random_params(cfg, weights="Q4_K_M"))
    unstacked = sum(layer.wqkv is None for layer in model.layers)
    assert 0 < unstacked < cfg.layers
    plan = od.compile(model.build(1, 20)[0], H200)
    kernels = [s.kernel for s in plan.fusions]
    assert kernels.count(fusion.SHARE) == unstacked, plan.explain()
    assert kernels.count("rms_norm_mul_mat") == cfg.layers - unstacked + 1, plan.explain()
    assert not any(s.nodes[0].op == "rms_norm" and not s.kernel.startswith("rms_norm_mul_mat") for s in plan.steps)


def check_on_gpu(outputs: list[Tensor], fusions: list[str], what: str, rng: np.random.Generator, runs: int = 3
                 ) -> None:
    """`outputs` planned on cuda0 with exactly `fusions`, against the reference and the unfused plan, every output
    written (arenas poisoned), over a CUDA graph's capture and replays with new inputs each run."""
    plan = od.compile(outputs, "cuda0")
    assert [s.kernel for s in plan.fusions] == fusions, plan.explain()
    unfused = od.compile(outputs, "cuda0", fusion=False)
    for run in range(runs):
        feeds = feeds_for(outputs, rng)
        poison_arenas(plan)
        got = plan.run(feeds)
        ref = od.compile(outputs, "cpu").run(feeds)
        plain = unfused.run(feeds)
        for i, (g, r, u) in enumerate(zip(got, ref, plain)):
            assert_close(g, r, f"{what}: output {i}, run {run}")
            assert_close(g, u, f"{what}: output {i}, run {run}, against the unfused plan")


@gpu
@pytest.mark.parametrize("n", [9, 16, 33, 64])
@pytest.mark.parametrize("dt", ["q4_0", "q8_0", "q4_K", "q6_K"])
def test_norm_gemm_pair_on_gpu(dt: str, n: int, rng) -> None:  # noqa: ANN001
    """The norm in the GEMMs' quantize, before one product and before a gate/up pair (with its GLU after)."""
    for glu in (False, True):
        check_on_gpu([normed(dt, 300, 2048, n, glu)], [fusion.PAIR if glu else "rms_norm_mul_mat"],
                     f"{dt} n={n} glu={glu}", rng, runs=2)


@gpu
@pytest.mark.parametrize("k", [2048, 4096])
def test_norm_share_on_gpu(k: int, rng) -> None:  # noqa: ANN001
    """Three products of the normed values, and the values themselves (one column)."""
    outs = shared(1, k)
    check_on_gpu([*outs, outs[0].srcs[1]], [fusion.SHARE], f"share k={k}", rng)


@gpu
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("dt", ["q4_0", "q8_0", "q4_K", "q6_K", "iq4_xs", "mxfp4"])
def test_norm_matvec_on_gpu(dt: str, n: int, rng) -> None:  # noqa: ANN001
    check_on_gpu([normed(dt, 300, 2048, n)], ["rms_norm_mul_mat"], f"{dt} n={n}", rng)


@gpu
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dt", ["q4_0", "q4_K", "q6_K"])
def test_norm_glu_matvec_on_gpu(dt: str, n: int, rng) -> None:  # noqa: ANN001
    check_on_gpu([normed(dt, 512, 2048, n, glu=True)], ["rms_norm_mul_mat_glu"], f"glu {dt} n={n}", rng)
