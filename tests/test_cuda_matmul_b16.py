"""The fused groups of the GEMMs whose b goes in as 16-bit rows (fusion.B16_PATHS: cuBLAS and mmq_wgmma, a prefill's
products): a rms_norm -> mul before one product or a pair (convert_norm writes the normed values as the products'
b), a glu before one (convert_glu writes act(gate) * up as its b), and the add after one (cuBLAS adds a contiguous
residual as its C; mmq_wgmma adds a bias or residual as mmq does). Planning on the H200 description (which groups
fuse, the declines and their reasons, the launches and their arguments), the cuBLAS specs emulated in numpy against
the reference, and on the GPU against the reference and the unfused plan."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.devices import H200
from opdispatch.graph import Graph
from opdispatch.models.llama import PRESETS, LlamaModel, random_weights
from opdispatch.plugins.cuda_matmul import bind, fusion, support
from opdispatch.plugins.cuda_matmul.specs.gemm import GemmSpec
from opdispatch.tensor import Tensor
from opdispatch.testing.metrics import nmse
from test_cuda_matmul import NMSE_MAX, Memory, check_spec, fake_ptr, fake_scratch, gpu
from test_cuda_matmul_norm import check_on_gpu

EPS = 1e-5


def leaf(name: str, shape: tuple, rng: np.random.Generator | None, dt: str = "f32") -> Tensor:
    """An input (rng None: fed at run time) or a param of uniform values in [-1, 1] stored as dt."""
    if rng is None:
        return od.input(name, shape, dt)
    return od.param(name, rng.uniform(-1, 1, shape).astype(np.float32), dt)


def norm_pair(dt: str, m: int, k: int, n: int, rng: np.random.Generator | None = None, pair: bool = True
              ) -> list[Tensor]:
    """rms_norm(x) * w read by a gate and an up product (or one product) of type dt: a decoder's MLP input."""
    h = ops.mul(ops.rms_norm(leaf("x", (n, k), rng), EPS), leaf("nw", (k,), rng))
    return [ops.mul_mat(leaf(f"w{i}", (m, k), rng, dt), h) for i in range(2 if pair else 1)]


def glu_down(dt: str, m: int, k: int, n: int, rng: np.random.Generator | None = None, residual: bool = True,
             kind: str = "swiglu") -> Tensor:
    """down(glu(gate, up)) (+ a residual of its shape): a decoder's MLP output, gate and up inputs of (n, k)."""
    y = ops.mul_mat(leaf("wd", (m, k), rng, dt), ops.glu_split(leaf("g", (n, k), rng), leaf("u", (n, k), rng), kind))
    return ops.add(y, leaf("r", (n, m), rng)) if residual else y


def product_residual(dt: str, m: int, k: int, n: int, rng: np.random.Generator | None = None) -> Tensor:
    """add(r, mul_mat(w, x)): the attention output projection and its residual."""
    return ops.add(leaf("r", (n, m), rng), ops.mul_mat(leaf("w", (m, k), rng, dt), leaf("x", (n, k), rng)))


def one_step(outputs: list[Tensor], rule: str, path: str) -> tuple[od.Plan, list[Tensor]]:
    """The plan of `outputs` on the H200 description, which must be one fused `rule` group on `path` (and the
    launches nothing else)."""
    plan = od.compile(outputs, H200)
    (step,) = plan.fusions
    assert step.kernel == rule, plan.explain()
    assert len([s for s in plan.steps if s.kind in ("kernel", "fused")]) == 1, plan.explain()
    assert {support.choose(p, H200).path for p in fusion.parts(step.nodes)[0]} == {path}, plan.explain()
    return plan, step.nodes


# (graph, rule, path, the launches' kinds); the cuBLAS paths: bf16 / f16 weights above mmf's 16 columns; q5_0 above
# mmq's 128 (dequant_cublas, f16); mmq_wgmma: q4_0 above 64 columns
CASES = {
    "bf16 norm pair": (lambda r: norm_pair("bf16", 48, 256, 40, r), fusion.PAIR, "cublas",
                       ["convert_norm", "gemm", "gemm"]),
    "f16 norm one": (lambda r: norm_pair("f16", 48, 256, 40, r, pair=False), "rms_norm_mul_mat", "cublas",
                     ["convert_norm", "gemm"]),
    "q5_0 norm pair": (lambda r: norm_pair("q5_0", 48, 256, 200, r), fusion.PAIR, "dequant_cublas",
                       ["convert_norm", "dequant", "gemm", "dequant", "gemm"]),
    "bf16 glu down residual": (lambda r: glu_down("bf16", 48, 512, 40, r), "glu_mul_mat_add", "cublas",
                               ["convert_glu", "gemm"]),
    "f16 glu down": (lambda r: glu_down("f16", 48, 512, 40, r, residual=False, kind="geglu"), "glu_mul_mat",
                     "cublas", ["convert_glu", "gemm"]),
    "q5_1 glu down residual": (lambda r: glu_down("q5_1", 48, 512, 200, r, kind="swiglu_oai"), "glu_mul_mat_add",
                               "dequant_cublas", ["convert_glu", "dequant", "gemm"]),
    "bf16 residual": (lambda r: product_residual("bf16", 48, 256, 40, r), "mul_mat_add", "cublas",
                      ["convert", "gemm"]),
    "f32 residual": (lambda r: product_residual("f32", 48, 256, 40, r), "mul_mat_add", "cublas", ["gemm"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cublas_groups_compute_the_graph(case: str, rng) -> None:  # noqa: ANN001
    """The launches of each cuBLAS group, run in numpy on a memory image (the conversions as the kernels round,
    the GEMMs in float64 from the 16-bit operands, cublasLt's C added): every output within mul_mat's bound of
    the reference; the prologue writes the scratch the GEMMs read as b, the addend is the GEMM's C."""
    make, rule, path, kinds = CASES[case]
    y = make(rng)
    outputs = y if isinstance(y, list) else [y]
    _, nodes = one_step(outputs, rule, path)
    memory = Memory()
    graph = Graph.build(nodes[-1] if rule != fusion.PAIR else outputs)
    for leaf in graph.leafs:
        memory.place(leaf, leaf.data)
    for t in outputs:
        memory.place(t)
    launches = bind.b16_fused_specs(nodes, memory.ptr, memory.scratch, H200)
    assert [s.kind if isinstance(s, GemmSpec) else s.kernel.split("<")[0] for s in launches] == kinds
    for s in launches:
        if not isinstance(s, GemmSpec):
            check_spec(s)
        memory.run(s)
    gemms = [s for s in launches if isinstance(s, GemmSpec)]
    if kinds[0] in ("convert_norm", "convert_glu"):
        assert all(g.b == int(launches[0].args.dst) for g in gemms)
    bias = fusion.parts(nodes)[1]
    assert [g.addend for g in gemms] == [memory.ptr(b) if b is not None else 0 for b in bias]
    refs = od.compile(outputs, "cpu").run({})
    for t, ref in zip(outputs, refs):
        got = np.array(memory.array(memory.ptr(t), t.shape, t.strides, np.dtype(np.float32)))
        assert nmse(got, ref) <= NMSE_MAX, (case, nmse(got, ref))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("front", ["norm", "glu"])
def test_mmq_wgmma_groups_read_the_written_b(front: str, residual: bool, rng) -> None:  # noqa: ANN001
    """On mmq_wgmma (q4_0, 512 columns) the prologue's bf16 rows are the kernel's b (no conversion launch of its
    own); a residual after the product is its bias (bias_col M), the add its output."""
    if front == "norm":
        outputs, rule = norm_pair("q4_0", 256, 512, 512, rng, pair=not residual), fusion.PAIR
        if residual:
            outputs = [ops.add(outputs[0], od.input("r", outputs[0].shape))]
            rule = "rms_norm_mul_mat"  # the norm and the product; the add after runs alone
    else:
        outputs, rule = [glu_down("q4_0", 256, 512, 512, rng, residual)], "glu_mul_mat" + "_add" * residual
    plan = od.compile(outputs, H200)
    step = plan.fusions[0]
    assert step.kernel == rule, plan.explain()
    launches = bind.b16_fused_specs(step.nodes, fake_ptr, fake_scratch, H200)
    for s in launches:
        check_spec(s)
    pre, *wgmma = launches
    assert pre.kernel == ("convert_norm<B_BF16>" if front == "norm" else "convert_glu<B_BF16, true>")
    assert all(s.kernel.startswith("mmq_wgmma<") and int(s.args.b) == int(pre.args.dst) for s in wgmma)
    prods, biases, _ = fusion.parts(step.nodes)
    for s, prod, bias in zip(wgmma, prods, biases):
        out = step.nodes[-1] if len(prods) == 1 else prod
        assert int(s.args.out) == fake_ptr(out)
        assert (int(s.args.bias), int(s.args.bias_col)) == ((fake_ptr(bias), 256) if bias is not None else (0, 0))


def test_prefill_layer_is_six_steps_on_cublas() -> None:
    """The 1b preset's 512-token prefill in bf16, planned on the H200 description: a layer is the norm and q/k/v
    product, the rope and cache writes, the attention, the output product with its residual, the norm and the
    gate/up pair, the glu and down product with its residual; no norm, conversion, glu or add runs alone."""
    cfg = attrs.evolve(PRESETS["1b"], layers=2)
    plan = od.compile(LlamaModel(cfg, random_weights(cfg)).build(512, 0, logits="last")[0], H200)
    kernels = [s.kernel for s in plan.fusions]
    assert kernels.count("rms_norm_mul_mat") == cfg.layers, plan.explain()
    assert kernels.count(fusion.PAIR) == cfg.layers, plan.explain()
    assert kernels.count("glu_mul_mat_add") == cfg.layers, plan.explain()
    assert kernels.count("mul_mat_add") == cfg.layers, plan.explain()
    alone = [n.op for s in plan.steps if s.kind == "kernel" for n in s.nodes]
    assert not {"glu", "add", "rms_norm"} & set(alone), plan.explain()


@pytest.mark.parametrize(("make", "why"), [
    (lambda r: norm_pair("f32", 48, 256, 40, r), "mul_mat takes cublas with f32 weights, which reads b as it is"),
    (lambda r: ops.add(ops.mul_mat(od.input("w", (48, 256), "bf16"), od.input("x", (40, 256))),
                       od.input("b", (48,))), "which adds a contiguous addend of the product's shape"),
    (lambda r: ops.mul_mat(od.input("w", (48, 512), "f32"), ops.glu_split(od.input("g", (40, 512)),
                                                                           od.input("u", (40, 512)), "swiglu")),
     "mul_mat takes cublas; a glu's result is written as b for cublas, dequant_cublas, mmq_wgmma (16-bit b) only"),
    (lambda r: ops.mul_mat(od.input("w", (48, 512), "bf16"), ops.glu(od.input("gu", (40, 1024)), "swiglu")),
     "glu over one tensor's halves"),
    (lambda r: ops.mul_mat(od.input("w", (48, 512), "bf16"), ops.glu_split(
        od.input("g", (40, 512)), od.input("u", (40, 1024)).view((40, 512), (4096, 4)), "swiglu")),
     "the glu's sources must be contiguous f32 of its shape (40, 512)"),
    (lambda r: ops.mul_mat(od.input("w", (48, 512), "bf16"), ops.glu_split(od.input("g", (2, 40, 512)),
                                                                            od.input("u", (2, 40, 512)), "swiglu")),
     "whose fused groups are one batch's, not (2, 40, 48)"),
])
def test_b16_groups_declined_with_their_reason(make, why: str, rng) -> None:  # noqa: ANN001
    """Where the product does not convert b, the addend is not C's layout or the glu not two contiguous tensors
    alike, the group is declined with its reason and its nodes run apart."""
    y = make(rng)
    outputs = y if isinstance(y, list) else [y]
    graph = Graph.build(outputs)
    nodes = list(graph.nodes)
    if nodes[0].op == "rms_norm":
        checked = fusion.check_pair(H200, nodes, graph)
    else:
        start = next(i for i, n in enumerate(nodes) if n.op in ("glu", "mul_mat"))
        checked = fusion.check(H200, nodes[start:], graph)
    assert why in str(checked), checked
    assert not any(s.kernel in ("glu_mul_mat", "glu_mul_mat_add", fusion.PAIR) for s in od.compile(outputs, H200).fusions)


# -- on a GPU -------------------------------------------------------------------------------------


#: (weights, columns) whose products take a GEMM of 16-bit b on the H200: f16/bf16 above mmf's 16 columns (cuBLAS), the
#: grid I-quants above the mat-vecs' 8 (dequant_cublas), the formats mmq takes above its 128 (mmq_wgmma for q4_0 and
#: q8_0, dequant_cublas for the others)
B16_CASES = [*((dt, n) for dt in ("bf16", "f16", "iq2_xs") for n in (40, 300, 512)),
             *((dt, n) for dt in ("q4_0", "q8_0", "q5_1", "q4_K") for n in (300, 512))]


@gpu
@pytest.mark.parametrize(("dt", "n"), B16_CASES)
def test_b16_groups_on_gpu(dt: str, n: int, rng) -> None:  # noqa: ANN001
    """Every group on the product's path (cuBLAS, dequant_cublas or mmq_wgmma; M off the tiles), over a CUDA
    graph's capture and replays: the norm pair, the glu before the down product with and without its residual,
    the product with its residual."""
    k = 512 if dt in ("bf16", "f16") else 768
    m = 300
    for outputs, rule in (
        (norm_pair(dt, m, k, n), fusion.PAIR),
        ([glu_down(dt, m, k, n)], "glu_mul_mat_add"),
        ([glu_down(dt, m, k, n, residual=False, kind="geglu")], "glu_mul_mat"),
        ([product_residual(dt, m, k, n)], "mul_mat_add"),
    ):
        prod = next(t for t in Graph.build(outputs).nodes if t.op == "mul_mat")
        path = support.choose(prod, od.compile(outputs, "cuda0").device).path
        assert path in fusion.B16_PATHS, f"{dt} n={n}: {path}"
        check_on_gpu(outputs, [rule], f"{dt} n={n} {rule} on {path}", rng, runs=2)
