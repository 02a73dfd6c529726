"""cuda_matmul beside torch: GEMM TFLOP/s, mat-vec GB/s on weight bytes, fused gate/up + GLU, MoE.

- GEMM (cuBLAS path): out (N, M) = b (N, K) @ a (M, K)^T with a and b bf16 or
  f16 (so no conversion runs) and an f32 result, against torch.matmul in the
  same type (so torch writes half as many output bytes) on the same values.
  FLOPs 2*M*N*K.
- mat-vec, batch 1 (mmvf / mmvq): bytes = weight bytes + the f32 vector + the
  f32 output, against torch's f16 mat-vec of the same shape (for every weight
  type: torch has no q8_0/q4_0 kernel, and f16 is the usual baseline).
- gate/up + swiglu at batch 1: the fused plan, with the unfused pair's time
  (same weights, fusion off) in extra_info["unfused_us"] and its ratio.
- mul_mat_id, one token, 8 of 128 experts: bytes = the 8 experts' weights read.
"""

from __future__ import annotations

import numpy as np
import pytest

import opdispatch as od
from bench import device_seconds, ready
from opdispatch import ops

pytestmark = pytest.mark.gpu
MATMUL, MATMUL_OPS = "cuda_matmul", ("mul_mat", "mul_mat_id")






def rand(*shape: int, lo: float = -1, hi: float = 1) -> np.ndarray:
    return np.random.default_rng(0).uniform(lo, hi, shape).astype(np.float32)


def weight_bytes(t: od.Tensor) -> int:
    return t.nbytes


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


@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096)], ids=["4096x4096", "14336x4096"])
@pytest.mark.parametrize("dt", ["f16", "bf16", "q8_0", "q4_0"])
def test_matvec(measure, torch_cuda, dt: str, shape: tuple) -> None:  # noqa: ANN001
    torch = torch_cuda
    M, K = shape
    a = od.param("a", rand(M, K), dt)
    x = od.input("x", (1, K))
    plan = ready(ops.mul_mat(a, x), {x: rand(1, K)}, MATMUL, ops=MATMUL_OPS,
                 kernel="mmvq_stream" if dt.startswith("q") else "mmvf")
    tw = torch.randn(M, K, device="cuda", dtype=torch.float16)
    tx = torch.randn(1, K, device="cuda", dtype=torch.float16)
    measure(plan, weight_bytes(a) + 4 * K + 4 * M, lambda: torch.matmul(tx, tw.T))


@pytest.mark.parametrize("dt", ["f16", "q4_0"])
def test_gate_up_swiglu(measure, benchmark, torch_cuda, dt: str) -> None:  # noqa: ANN001
    M, K = 14336, 4096
    wg, wu = od.param("wg", rand(M, K), dt), od.param("wu", rand(M, K), dt)
    x = od.input("x", (1, K))
    y = ops.glu_split(ops.mul_mat(wg, x), ops.mul_mat(wu, x), "swiglu")
    fused = ready(y, {x: rand(1, K)}, MATMUL, ops=MATMUL_OPS)
    assert [s.kernel for s in fused.fusions] == ["mul_mat_glu"], fused.explain()
    unfused = od.compile(y, "cuda0", fusion=False)
    unfused.write(x, rand(1, K))
    unfused_s = device_seconds(unfused.launch, unfused.synchronize)
    info = measure(fused, 2 * weight_bytes(wg) + 4 * K + 4 * M, None)
    benchmark.extra_info["unfused_us"] = unfused_s * 1e6
    benchmark.extra_info["speedup_vs_unfused"] = unfused_s * 1e6 / info["us"]


@pytest.mark.parametrize("dt", ["f16", "q4_0"])
def test_moe_8_of_128(measure, torch_cuda, dt: str) -> None:  # noqa: ANN001
    E, U, M, K = 128, 8, 2048, 2048
    experts = od.param("experts", rand(E, M, K), dt)
    x, ids = od.input("x", (1, 1, K)), od.input("ids", (1, U), "i32")
    chosen = np.random.default_rng(1).permutation(E)[:U].astype(np.int32).reshape(1, U)
    plan = ready(ops.mul_mat_id(experts, x, ids), {x: rand(1, 1, K), ids: chosen}, MATMUL, ops=MATMUL_OPS,
                 kernel="mmv_id")
    measure(plan, U * experts.nbytes // E + 4 * K + 4 * U * M, None)
