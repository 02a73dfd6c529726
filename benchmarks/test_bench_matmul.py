"""cuda_matmul beside torch: GEMM TFLOP/s, mat-vec GB/s on weight bytes, fused gate/up + GLU, MoE.

- GEMM (cuBLAS path): out (N, M) = b (N, K) @ a (M, K)^T with a and b bf16 or
  f16 (so no conversion runs) and an f32 result, against torch.matmul in the
  same type (so torch writes half as many output bytes) on the same values.
  FLOPs 2*M*N*K.
- mat-vec, batch 1 (mmvf / mmvq_stream / mmvq, every weight format that has one): bytes = weight bytes + the f32 vector
  + the f32 output, against torch's f16 mat-vec of the same shape (for every
  weight type: torch has no q8_0/q4_0 kernel, and f16 is the usual baseline); and at shapes whose rows are not
  whole chunks (gpt-oss's K 2880, Qwen2.5 7B's 18944).
- mmf, 16 columns (bf16 weights, f32 b; the 1b preset's shapes, the LM head and the fused
  gate/up pair included): bytes = the weight bytes, against cuBLAS on the same nodes (b
  converted to bf16 first) and torch.matmul of the same shape in bf16.
- gate/up + swiglu at batch 1: the fused plan, with the unfused pair's time
  (same weights, fusion off) in extra_info["unfused_us"] and its ratio.
- mul_mat_id, one token, 8 of 128 experts: bytes = the 8 experts' weights read.
- MoE prefill, 512 tokens through 8 of 64 experts (2048 x 2048): mmq_id beside a dense mul_mat of the same
  active parameters and beside mmv_id_grouped (times only; the goal: mmq_id within 1.5x of dense).
- quantized GEMM (q4_0 / q8_0 / q4_K weights (M, K) = (4096, 14336), N 16 and 512): N 16 (the table's path)
  timed cold with bytes = the weight bytes (the goal: 80% of the copy bandwidth); N 512 hot with FLOPs
  2*M*N*K (the goal: no slower than torch's bf16 GEMM of the same shape, its time in extra_info["torch_us"]);
  and at the 1b preset's layer shapes, 16, 32, 64 and 128 columns, cold (batch-16 decode, the widest
  tiles of mmq_small and mmq).
- mmq_wgmma against dequant_cublas for q4_0, q4_K, q5_K and q6_K (Q4_0, Q4_K_M and Q5_K_M files' formats) at the
  1b preset's layer shapes and 512 and 2048 columns: the evidence for which formats and weights
  support.MMQ_WGMMA_TYPES and MMQ_WGMMA_MIN_VALUES take.

The mat-vecs, mmf, gate/up and MoE are timed cold (conftest.measure_cold): one plan
holds 32 or more instances taking several weight sets in turn (for MoE, sets of
8 experts), run as one CUDA graph: what a decode step does.
"""

from __future__ import annotations

import numpy as np
import pytest

import opdispatch as od
from bench import cold, interleaved_seconds, ready
from opdispatch import ops
from opdispatch.compiler import plan_cache
from opdispatch.manager import manager
from opdispatch.quants import FORMATS
from opdispatch.quants.samples import random_blocks
from opdispatch.plugins.cuda_matmul import support

pytestmark = pytest.mark.gpu
MATMUL, MATMUL_OPS = "cuda_matmul", ("mul_mat", "mul_mat_id")


def rand(*shape: int, lo: float = -1, hi: float = 1) -> np.ndarray:
    return np.random.default_rng(0).uniform(lo, hi, shape).astype(np.float32)


@pytest.mark.parametrize("size", [4096, 8192])
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_gemm(measure, torch_cuda, dt: str, size: int) -> None:  # noqa: ANN001
    torch = torch_cuda
    M = N = K = size
    va, vb = rand(M, K), rand(N, K)
    a = od.param("a", va, dt)
    b = od.input("b", (N, K), dt)
    plan = ready(ops.mul_mat(a, b), {b: vb}, MATMUL, ops=MATMUL_OPS, kernel="cublas")
    tdt = torch.bfloat16 if dt == "bf16" else torch.float16
    # the same values on both sides: tensor-core GEMMs at this speed are power-limited, and power depends on the data
    ta = torch.from_numpy(va).to("cuda", tdt)
    tb = torch.from_numpy(vb).to("cuda", tdt)
    measure(plan, 2 * (M * K + N * K) + 4 * M * N, lambda: torch.matmul(tb, ta.T), flops=2 * M * N * K)


#: rows a block-format weight is quantized from: its speed does not depend on the values, and the numpy
#: quantizers of the K-quants take seconds a matrix, so a benchmark weight repeats this many quantized rows
QUANT_ROWS = 64


def param_sets(name: str, values: np.ndarray, dt: str, sets: int) -> list[od.Tensor]:
    """`sets` params holding `values` in `dt` (converted once; a block format's rows repeat its first
    QUANT_ROWS quantized, or QUANT_ROWS rows of random blocks for a format without a quantizer), each its
    own device buffer."""
    if od.dtype(dt).is_quant and values.shape[-2] > QUANT_ROWS:
        if FORMATS[dt].encode is None:  # the grid I-quants (no quantizer): random valid blocks instead
            per_row = values.shape[-1] // od.dtype(dt).block_size
            rows = random_blocks(np.random.default_rng(0), dt, QUANT_ROWS * per_row).reshape(QUANT_ROWS, -1)
        else:
            rows = od.param(name, values[..., :QUANT_ROWS, :], dt).data.reshape(QUANT_ROWS, -1)
        raw = np.resize(rows, (*values.shape[:-1], rows.shape[-1]))  # np.resize repeats the rows in order
        return [od.param(f"{name}{i}", raw, dt, shape=values.shape) for i in range(sets)]
    raw = od.param(name, values, dt)
    return [od.param(f"{name}{i}", raw.data, dt, shape=raw.shape) for i in range(sets)]


#: every weight format with a batch-1 mat-vec: floats (mmvf), the block formats (mmvq_stream where rows are
#: whole chunks, else mmvq)
MATVEC_TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_K", "q5_K", "q6_K", "q2_K", "q3_K", "iq4_xs", "iq4_nl", "mxfp4",
                "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")


@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096)], ids=["4096x4096", "14336x4096"])
@pytest.mark.parametrize("dt", MATVEC_TYPES)
def test_matvec(measure_cold, torch_cuda, dt: str, shape: tuple) -> None:  # noqa: ANN001
    torch = torch_cuda
    M, K = shape
    nbytes = od.input("a", (M, K), dt).nbytes + 4 * K + 4 * M
    lay = cold(nbytes)
    weights = param_sets("a", rand(M, K), dt, lay.sets)
    x = od.input("x", (1, K))
    kernel = support.choose(ops.mul_mat(weights[0], x)).path  # the path the table gives: mmvf, mmvq_stream, mmvq
    plan = ready([ops.mul_mat(weights[lay.of(i)], x) for i in range(lay.instances)], {x: rand(1, K)}, MATMUL,
                 ops=MATMUL_OPS, kernel=kernel)
    tw = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _ in range(lay.sets)]
    tx = torch.randn(1, K, device="cuda", dtype=torch.float16)
    measure_cold(plan, lay, nbytes, lambda i: torch.matmul(tx, tw[lay.of(i)].T))


#: rows that are not whole chunks, one column (mmvq_stream's RAGGED instances, where mmvq ran them): gpt-oss's
#: 2880 x 2880 (mxfp4; q4_0 and q8_0 take mmvq there, no RAGGED instance of a legacy format: specs.RAGGED_TYPES),
#: Qwen2.5 7B's down product 3584 x 18944 (its Q4_K_M's q6_K; q3_K and q2_K: 18944 is not whole 2048- / 1024-value
#: chunks); iq4_xs at 18944 is whole chunks, the plain instances in every tree (a control). q4_K and q5_K are not
#: here: their chunks are one block, so no K of theirs is ragged (stream.ragged is False at 18944 and at every K)
RAGGED_SHAPES = {"mxfp4": (2880, 2880), "q4_0": (2880, 2880), "q8_0": (2880, 2880), "q6_K": (3584, 18944),
                 "q3_K": (3584, 18944), "q2_K": (3584, 18944), "iq4_xs": (3584, 18944)}


@pytest.mark.parametrize("dt", list(RAGGED_SHAPES))
def test_matvec_ragged(measure_cold, torch_cuda, dt: str) -> None:  # noqa: ANN001
    """test_matvec at RAGGED_SHAPES: rows not whole chunks, off 16-byte boundaries."""
    test_matvec(measure_cold, torch_cuda, dt, RAGGED_SHAPES[dt])


#: the 1b preset's weights (M, K) at batch 16: q / o, k / v, the q/k/v stack, gate / up, down, the LM head
MMF_SHAPES = {"q_o": (2048, 2048), "k_v": (512, 2048), "qkv": (3072, 2048), "gate_up": (8192, 2048),
              "down": (2048, 8192), "lm_head": (128256, 2048)}


def _mmf_and_cublas(outputs: list, feeds: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[od.Plan, od.Plan]:
    """Plans of `outputs` (16-column products of bf16 weights, b f32) with mmf selected and with cuBLAS (b
    converted to bf16 first), whatever support.MMF_MIN_N says."""
    monkeypatch.setattr(support, "MMF_MIN_N", support.MMV_MAX_N + 1)
    mmf = ready(outputs, feeds, MATMUL, ops=MATMUL_OPS)
    monkeypatch.setattr(support, "MMF_MIN_N", support.MMF_MAX_N + 1)
    # fusion=False: a plan-cache key of its own (the graph is mmf's plan's); cuBLAS products fuse nothing anyway
    cublas = od.compile(outputs, "cuda0", fusion=False)
    assert {s.kernel for s in cublas.steps if s.plugin == MATMUL and s.nodes[0].op == "mul_mat"} == {"cublas"}
    for t, v in feeds.items():
        cublas.write(t, v)
    return mmf, cublas


@pytest.mark.parametrize("shape", list(MMF_SHAPES.values()), ids=list(MMF_SHAPES))
def test_mmf_16_columns(measure_cold, benchmark, torch_cuda, monkeypatch, shape: tuple) -> None:  # noqa: ANN001
    """mmf (tensor cores, bf16 weights, f32 b) at 16 columns, the 1b preset's shapes at batch 16: bytes = the
    weight bytes; beside it cuBLAS on the same nodes (b converted to bf16 first: extra_info["cublas_us"],
    "speedup_vs_cublas", what sets support.MMF_MIN_N) and torch's bf16 matmul (b already bf16)."""
    torch = torch_cuda
    M, K, N = *shape, 16
    nbytes = od.input("a", (M, K), "bf16").nbytes
    lay = cold(nbytes)
    weights = param_sets("a", rand(M, K), "bf16", lay.sets)
    x = od.input("x", (N, K))
    plan, cublas = _mmf_and_cublas([ops.mul_mat(weights[lay.of(i)], x) for i in range(lay.instances)],
                                   {x: rand(N, K)}, monkeypatch)
    assert {s.kernel for s in plan.steps if s.plugin == MATMUL} == {"mmf"}, plan.explain()
    tw = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(lay.sets)]
    tx = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    info = measure_cold(plan, lay, nbytes, lambda i: torch.matmul(tx, tw[lay.of(i)].T), also={"cublas": cublas})
    benchmark.extra_info["speedup_vs_cublas"] = info["cublas_us"] / info["us"]


def test_mmf_gate_up_16_columns(measure_cold, benchmark, torch_cuda, monkeypatch) -> None:  # noqa: ANN001
    """The 1b preset's gate/up pair + swiglu at 16 columns: one fused mmf launch against cuBLAS's (two
    conversions of b, two GEMMs, the glu): bytes = both weights' bytes."""
    M, K, N = 8192, 2048, 16
    nbytes = 2 * od.input("w", (M, K), "bf16").nbytes
    lay = cold(nbytes)
    gates, ups = param_sets("wg", rand(M, K), "bf16", lay.sets), param_sets("wu", rand(M, K), "bf16", lay.sets)
    x = od.input("x", (N, K))
    ys = [ops.glu_split(ops.mul_mat(gates[lay.of(i)], x), ops.mul_mat(ups[lay.of(i)], x), "swiglu")
          for i in range(lay.instances)]
    plan, cublas = _mmf_and_cublas(ys, {x: rand(N, K)}, monkeypatch)
    assert [s.kernel for s in plan.fusions] == ["mul_mat_glu"] * lay.instances, plan.explain()
    info = measure_cold(plan, lay, nbytes, None, also={"cublas": cublas})
    benchmark.extra_info["speedup_vs_cublas"] = info["cublas_us"] / info["us"]


@pytest.mark.parametrize("dt", ["f16", "q4_0"])
def test_gate_up_swiglu(measure_cold, benchmark, torch_cuda, dt: str) -> None:  # noqa: ANN001
    M, K = 14336, 4096
    nbytes = 2 * od.input("w", (M, K), dt).nbytes + 4 * K + 4 * M
    lay = cold(nbytes)
    gates, ups = param_sets("wg", rand(M, K), dt, lay.sets), param_sets("wu", rand(M, K), dt, lay.sets)
    x = od.input("x", (1, K))
    ys = [ops.glu_split(ops.mul_mat(gates[lay.of(i)], x), ops.mul_mat(ups[lay.of(i)], x), "swiglu")
          for i in range(lay.instances)]
    fused = ready(ys, {x: rand(1, K)}, MATMUL, ops=MATMUL_OPS)
    assert [s.kernel for s in fused.fusions] == ["mul_mat_glu"] * lay.instances, fused.explain()
    unfused = od.compile(ys, "cuda0", fusion=False)
    unfused.write(x, rand(1, K))
    info = measure_cold(fused, lay, nbytes, None, also={"unfused": unfused})
    benchmark.extra_info["speedup_vs_unfused"] = info["unfused_us"] / info["us"]


@pytest.mark.parametrize("dt", ["f16", "q4_0"])
def test_moe_8_of_128(measure_cold, torch_cuda, dt: str) -> None:  # noqa: ANN001
    E, U, M, K = 128, 8, 2048, 2048
    experts = od.param("experts", rand(E, M, K), dt)
    nbytes = U * experts.nbytes // E + 4 * K + 4 * U * M
    lay = cold(nbytes, most_sets=E // U)  # a set is 8 experts of the 128: cold without more weights
    x = od.input("x", (1, 1, K))
    ids = [od.input(f"ids{i}", (1, U), "i32") for i in range(lay.sets)]
    chosen = np.random.default_rng(1).permutation(E).astype(np.int32).reshape(E // U, 1, U)
    plan = ready([ops.mul_mat_id(experts, x, ids[lay.of(i)]) for i in range(lay.instances)],
                 {x: rand(1, 1, K), **dict(zip(ids, chosen))}, MATMUL, ops=MATMUL_OPS, kernel="mmv_id")
    measure_cold(plan, lay, nbytes, None)


@pytest.mark.parametrize("n", [16, 512])
@pytest.mark.parametrize("dt", ["q4_0", "q8_0", "q4_K"])
def test_mmq(measure, measure_cold, torch_cuda, dt: str, n: int) -> None:  # noqa: ANN001
    torch = torch_cuda
    M, K = 4096, 14336
    vx = rand(n, K)
    x = od.input("x", (n, K))
    tx = torch.from_numpy(vx).to("cuda", torch.bfloat16)
    if n == 16:
        nbytes = od.input("a", (M, K), dt).nbytes
        lay = cold(nbytes)
        weights = param_sets("a", rand(M, K), dt, lay.sets)
        # the path the table gives (mmq, or mmq_small from support.MMQ_SMALL_MIN_N columns; measure_cold reports
        # the fraction of the copy bandwidth on the weight bytes)
        kernel = support.choose(ops.mul_mat(weights[0], x)).path
        plan = ready([ops.mul_mat(weights[lay.of(i)], x) for i in range(lay.instances)], {x: vx}, MATMUL,
                     ops=MATMUL_OPS, kernel=kernel)
        tw = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(lay.sets)]
        measure_cold(plan, lay, nbytes, lambda i: torch.matmul(tx, tw[lay.of(i)].T))
    else:
        va = rand(M, K)
        y = ops.mul_mat(od.param("a", va, dt), x)
        # the path the table gives (from support.MMQ_WGMMA_MIN_N columns mmq_wgmma for support.MMQ_WGMMA_TYPES, else
        # dequant_cublas), against torch bf16
        plan = ready(y, {x: vx}, MATMUL, ops=MATMUL_OPS, kernel=support.choose(y).path)
        ta = torch.from_numpy(va).to("cuda", torch.bfloat16)
        measure(plan, od.input("a", (M, K), dt).nbytes, lambda: torch.matmul(tx, ta.T), flops=2 * M * n * K)


#: the 1b preset's layer shapes of MMF_SHAPES (its LM head is 32000 rows, not Llama 3's 128256)
LAYER_SHAPES = {k: v for k, v in MMF_SHAPES.items() if k != "lm_head"}


@pytest.mark.parametrize("n", [16, 32, 64, 128], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("shape", list(LAYER_SHAPES.values()), ids=list(LAYER_SHAPES))
@pytest.mark.parametrize("dt", ["q4_0", "q8_0", "q4_K"])
def test_mmq_layers(measure_cold, torch_cuda, dt: str, shape: tuple, n: int) -> None:  # noqa: ANN001
    """The quantized GEMM at the 1b preset's layer shapes and n columns (16: batch-16 decode; 32: mmq_small's
    widest tiles; 64 and 128: mmq's), on the path the table gives (mmq_small or mmq), cold: bytes = the weight
    bytes (the goal at 16 columns: 80% of the copy bandwidth), against torch's bf16 matmul of the same shape."""
    torch = torch_cuda
    (M, K), N = shape, n
    nbytes = od.input("a", (M, K), dt).nbytes
    lay = cold(nbytes)
    weights = param_sets("a", rand(M, K), dt, lay.sets)
    x = od.input("x", (N, K))
    kernel = support.choose(ops.mul_mat(weights[0], x)).path
    plan = ready([ops.mul_mat(weights[lay.of(i)], x) for i in range(lay.instances)], {x: rand(N, K)}, MATMUL,
                 ops=MATMUL_OPS, kernel=kernel)
    tw = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(lay.sets)]
    tx = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    measure_cold(plan, lay, nbytes, lambda i: torch.matmul(tx, tw[lay.of(i)].T))


@pytest.mark.parametrize("shape", list(LAYER_SHAPES.values()), ids=list(LAYER_SHAPES))
@pytest.mark.parametrize("dt", ["q4_0", "q4_K", "q5_K", "q6_K"])
@pytest.mark.parametrize("n", [512, 2048])
def test_wgmma_or_dequant(benchmark, torch_cuda, monkeypatch: pytest.MonkeyPatch, n: int, dt: str,  # noqa: ANN001
                          shape: tuple) -> None:
    """The evidence for support.MMQ_WGMMA_TYPES and MMQ_WGMMA_MIN_VALUES: Q4_0's, Q4_K_M's and Q5_K_M's formats at
    the 1b preset's layer shapes and 512 or 2048 columns (prefills), mmq_wgmma (dt selected) against dequant_cublas
    (dt not selected) and torch's bf16 matmul, timed in interleaved rounds: `us` mmq_wgmma's, `dequant_us`,
    `torch_us`."""
    torch = torch_cuda
    (M, K), N = shape, n
    va, vx = rand(M, K), rand(N, K)
    plans = []
    monkeypatch.setattr(support, "MMQ_WGMMA_MIN_VALUES", {})  # the evidence for it too: every shape on mmq_wgmma
    for types in ((*support.MMQ_WGMMA_TYPES, dt), tuple(t for t in support.MMQ_WGMMA_TYPES if t != dt)):
        monkeypatch.setattr(support, "MMQ_WGMMA_TYPES", types)
        plan_cache(manager()).plans.clear()  # the same graph shape: without this the first plan comes back
        x = od.input("x", (N, K))
        y = ops.mul_mat(od.param("a", va, dt), x)
        plans.append(ready(y, {x: vx}, MATMUL, ops=MATMUL_OPS,
                           kernel="mmq_wgmma" if dt in types else "dequant_cublas"))
    ta, tx = (torch.from_numpy(v).to("cuda", torch.bfloat16) for v in (va, vx))
    ours, dequant, theirs = interleaved_seconds([*((p.launch, p.synchronize) for p in plans),
                                                 (lambda: torch.matmul(tx, ta.T), torch.cuda.synchronize)])
    benchmark.extra_info.update({"us": ours * 1e6, "dequant_us": dequant * 1e6, "torch_us": theirs * 1e6,
                                 "vs_dequant": ours / dequant, "TFLOP/s": 2 * M * N * K / ours / 1e12})
    benchmark.pedantic(lambda: (plans[0].launch(), plans[0].synchronize()), rounds=5, iterations=1)


@pytest.mark.parametrize("dt", ["q4_0", "q4_K", "mxfp4"])
def test_moe_prefill_8_of_64(benchmark, torch_cuda, monkeypatch: pytest.MonkeyPatch, dt: str) -> None:  # noqa: ANN001
    """A 512-token MoE prefill through 8 of 64 experts of 2048 x 2048 (hidden 2048) on the path the table gives
    (mmq_wgmma_id for its formats), against mmq_id (mmq_wgmma_id unselected), a dense mul_mat with the same active
    parameters ((8 * 2048) x 2048 weights, 512 columns, on the path the table gives) and mmv_id_grouped (the
    quantized GEMMs' threshold raised), timed in interleaved rounds: `us` the chosen path's, `mmq_id_us`,
    `dense_us`, `grouped_us`. The goal: us <= 1.5 dense_us."""
    E, U, M, K, T = 64, 8, 2048, 2048, 512
    row = np.broadcast_to(rand(1, K), (E * M, K))  # one row's blocks repeated (param_sets): the speed is the same
    experts = param_sets("experts", row, dt, 1)[0].reshape(E, M, K)
    chosen = np.argsort(np.random.default_rng(2).random((T, E)), axis=-1)[:, :U].astype(np.int32)
    xv = rand(T, 1, K)

    def moe_plan(path: str) -> od.Plan:
        plan_cache(manager()).plans.clear()  # the same graph shape: without this the cached plan comes back
        x, ids = od.input("x", (T, 1, K)), od.input("ids", (T, U), "i32")
        y = ops.mul_mat_id(experts, x, ids)
        return ready(y, {x: xv, ids: chosen}, MATMUL, ops=MATMUL_OPS, kernel=path or support.choose(y).path)

    plan = moe_plan("")
    monkeypatch.setattr(support, "MMQ_WGMMA_ID_TYPES", ())
    mmq_id_plan = moe_plan("mmq_id")
    dense_w = param_sets("dense", row[:U * M], dt, 1)[0]
    xd = od.input("xd", (T, K))
    dense_y = ops.mul_mat(dense_w, xd)
    dense = ready(dense_y, {xd: rand(T, K)}, MATMUL, ops=MATMUL_OPS, kernel=support.choose(dense_y).path)
    monkeypatch.setattr(support, "MMQ_ID_PAIRS_PER_EXPERT", 2**31)
    grouped = moe_plan("mmv_id_grouped")
    ours, mmq_id_s, theirs, slow = interleaved_seconds(
        [(p.launch, p.synchronize) for p in (plan, mmq_id_plan, dense, grouped)])
    benchmark.extra_info.update({"us": ours * 1e6, "mmq_id_us": mmq_id_s * 1e6, "dense_us": theirs * 1e6,
                                 "grouped_us": slow * 1e6, "vs_dense": ours / theirs, "vs_mmq_id": ours / mmq_id_s,
                                 "speedup_vs_grouped": slow / ours, "TFLOP/s": 2 * T * U * M * K / ours / 1e12})
    benchmark.pedantic(lambda: (plan.launch(), plan.synchronize()), rounds=5, iterations=1)
