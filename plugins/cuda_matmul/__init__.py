"""The cuda_matmul plugin: mul_mat, mul_mat_id, out_prod; quantized mat-vec; bias/GLU fusions.

Paths (support.py picks one per node; its name shows in `Plan.explain()`):

- mmvf / mmvq: batch N <= 8, float / block-quantized weights: kernels/mmv.cu's
  mat-vec, reading each weight byte once. Float weights take b as it is
  (f32/f16/bf16), 16-byte loads. Block formats take two launches: quantize_q8_1
  turns b into int8 codes with a scale per 32 values (ggml's q8_1) in a scratch
  buffer, once per node; then each thread of the mat-vec reads whole quant blocks
  of QROWS rows straight from global memory (the aligned 16-byte granules that
  hold each 2-byte aligned block; consecutive threads, consecutive blocks) and
  dots them with b by dp4a, no shared-memory staging. The rounding of b this adds
  is ggml's too (its CPU and CUDA backends quantize b for these types) and lies
  well inside mul_mat's NMSE bound.
- mmvq_stream: the block-format mat-vec in one launch (kernels/mmvq_stream.cu)
  wherever a row is whole 16-byte chunks of blocks (K % 256 == 0 for q4_0, q5_0,
  q8_0; K % 128 for q4_1, K % 64 for q5_1) and the weights are 16-byte aligned
  (support.stream_reason says why not; mmvq runs those). Each block quantizes
  the b columns to q8_1 in shared memory (quantize_q8_1's math) and issues its
  warps' first cp.async weight copies (b first, unless the weights are params
  whose copies go out before the PDL wait), then each warp streams whole rows
  through a ring of support.STREAM.stages stage buffers in shared memory and
  dots them with b by dp4a. A persistent-style grid (about
  support.STREAM.blocks_per_sm blocks an SM) splits the rows evenly over warps.
  mul_mat_id at one token (its mmv_id path, fused bias and gate/up included)
  takes it too, a grid batch a slot, the expert read from ids on the device;
  rows that are not whole chunks take mmvq_id, more tokens mmvq_id_grouped.
- Every mul_mat kernel launches with programmatic dependent launch (common.cuh);
  mmv and mmvq_stream, given constant weights (params: `preload`), load their
  first weights before waiting for the kernel ahead, so that load overlaps its tail.
- cublas: float weights, N > 8: cuBLAS through our own handles
  (core/backends/cuda/cublas.py, usable under CUDA-graph capture): cublasLt
  (algorithm timed once per problem) for one GEMM or strided batches when
  every operand's batches are evenly spaced, else GemmBatchedEx on pointer
  arrays (repeat-interleaved broadcast, permuted batches). The operands must
  share a type: b is converted to a's type first when it differs (an f32 b
  with f16/bf16 weights is rounded to f16/bf16, as ggml does; a rounding of b
  well inside mul_mat's NMSE bound, and it keeps the tensor cores).
- dequant_cublas: quantized weights, N > 8: kernels/convert.cu dequantizes a
  to f16 (and b is converted to f16), then cuBLAS.
- mmv_id (one token) and mmv_id_grouped (a routing kernel groups the (token,
  slot) pairs by expert on the device, then a mat-vec per expert used): no
  host synchronization, so both live inside a captured CUDA graph.
- cublas_out_prod: cuBLAS, a converted to f32 first unless it is f32.

Scratch buffers (converted b, dequantized a, the routing table) come from the
backend's `ScratchPool` (core/backends/cuda/scratch.py), by role.

A bind is split in two, as in cuda_norm: pure spec functions (`mmv_specs`,
`gemm_specs`, ...) compute kernel instances, grids, arguments and cuBLAS calls
from shapes, strides and addresses (tested without a GPU), and `_realize`
turns specs into pre-bound launches.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.devices import warp32_gate
from opdispatch.backends.cuda.kernels import GLU_CODES, KernelSpec, chain
from opdispatch.backends.cuda.scratch import Workspace
from opdispatch.hookspecs import PRIORITY_BUILTIN, Device, FusionRule, Kernel, Launch, PluginInfo, hookimpl
from opdispatch.ops.base import pad4
from opdispatch.tensor import Tensor

from . import fusion, support

if TYPE_CHECKING:
    from opdispatch.backends.cuda.backend import CudaContext

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
MMV_CU = KERNELS_DIR / "mmv.cu"
MMVQ_STREAM_CU = KERNELS_DIR / "mmvq_stream.cu"
CONVERT_CU = KERNELS_DIR / "convert.cu"

#: mm_common.cuh's weight kinds and b/destination kinds
W_KIND = {"f32": "W_F32", "f16": "W_F16", "bf16": "W_BF16", "q4_0": "W_Q4_0", "q4_1": "W_Q4_1",
          "q5_0": "W_Q5_0", "q5_1": "W_Q5_1", "q8_0": "W_Q8_0"}
B_KIND = {"f32": "B_F32", "f16": "B_F16", "bf16": "B_BF16"}
EPI_NONE, EPI_BIAS, EPI_GLU = "EPI_NONE", "EPI_BIAS", "EPI_GLU"

BLOCK = 128  # mmv.cu's mm::BLOCK
ROWS = 2  # rows of a a mat-vec block computes (the kernels' R)
NTS = (1, 2, 4, 8)  # column counts the mat-vec kernels are compiled for
ROUTE_BLOCK = 1024  # mmv.cu's ROUTE_BLOCK
CONVERT_BLOCK = 256  # convert.cu's CONVERT_BLOCK
# mmv.cu's block-format mat-vec: weight rows (streams) a block, warps a block at most,
# quantize_q8_1's threads
QROWS, QWARPS_MAX, QUANT_BLOCK = 4, 4, 256
CONVERT_GRID_MAX = 65536  # blocks of a conversion (grid-stride over rows beyond)


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def mmv_name(wt: str, tb: str, nt: int, vec: bool, epi: str) -> str:
    return f"mmv<{W_KIND[wt]}, {B_KIND[tb]}, {nt}, {ROWS}, {_b(vec)}, {epi}>"


def mmv_id_name(wt: str, tb: str, vec: bool, epi: str) -> str:
    return f"mmv_id<{W_KIND[wt]}, {B_KIND[tb]}, {ROWS}, {_b(vec)}, {epi}>"


def grouped_name(wt: str, tb: str, nt: int, vec: bool, epi: str) -> str:
    return f"mmv_id_grouped<{W_KIND[wt]}, {B_KIND[tb]}, {nt}, {ROWS}, {_b(vec)}, {epi}>"


def mmvq_name(wt: str, nt: int, epi: str) -> str:
    return f"mmvq<{W_KIND[wt]}, {nt}, {epi}>"


def stream_name(wt: str, tb: str, nt: int, epi: str, stages: int = support.STREAM.stages) -> str:
    return f"mmvq_stream<{W_KIND[wt]}, {B_KIND[tb]}, {nt}, {epi}, {stages}>"


def mmvq_id_name(wt: str, epi: str) -> str:
    return f"mmvq_id<{W_KIND[wt]}, {epi}>"


def qgrouped_name(wt: str, nt: int, epi: str) -> str:
    return f"mmvq_id_grouped<{W_KIND[wt]}, {nt}, {epi}>"


def quantize_name(tb: str) -> str:
    return f"quantize_q8_1<{B_KIND[tb]}>"


def q_threads(k: int) -> int:
    """Threads of a block-format mat-vec block: a warp per 32 quant blocks of a row, 1 to QWARPS_MAX."""
    return 32 * min(QWARPS_MAX, max(1, math.ceil(k // 32 / 32)))


def q8_padded(k: int) -> int:
    """Blocks of 32 a quantized b row holds (quantize_q8_1's nbp): k / 32 rounded up to 32."""
    return math.ceil(k // 32 / 32) * 32


def quantize_spec(b: Tensor, pb: int, scratch: Scratch) -> tuple[KernelSpec, int, int, int]:
    """quantize_q8_1 of b's rows (row (i3 * n2 + i2) * n1 + i1 of b's padded (n3, n2, n1, K)
    geometry) into the scratch buffer "bq": (spec, codes address, scales address, nbp)."""
    (n3, n2, n1, k), (s3, s2, s1, _) = _geometry(b)
    rows, nbp = n1 * n2 * n3, q8_padded(k)
    bq = scratch("bq", rows * nbp * (32 + 8))
    bds = bq + rows * nbp * 32
    spec = KernelSpec(MMV_CU, quantize_name(b.dtype.name), (max(rows, 1), max(1, math.ceil(k // 32 / 8))),
                      QUANT_BLOCK, (U64(pb), I64(_elem_stride(b)), I64(s1), I64(s2), I64(s3), I32(max(n1, 1)),
                                    I32(max(n2, 1)), I32(k), I32(nbp), U64(bq), U64(bds)))
    return spec, bq, bds, nbp


def convert_name(ts: str, td: str) -> str:
    return f"convert<{B_KIND[ts]}, {B_KIND[td]}>"


def dequant_name(wt: str, td: str) -> str:
    return f"dequant<{W_KIND[wt]}, {B_KIND[td]}>"


ROUTE_NAME = "moe_route"
FLOAT_NAMES = ("f32", "f16", "bf16")
QUANT_NAMES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
WEIGHTS = FLOAT_NAMES + QUANT_NAMES

#: every instance the specs can name, per source (tests/test_kernels_compile.py compiles them all).
#: Column counts are compiled for the common case only: b f32 (and 16-byte loads for float
#: weights) takes NTS (the grouped MoE kernels GROUPED_NTS); the rarer variants (scalar loads,
#: b f16/bf16, which only unfused mul_mat takes) are compiled for 8 columns and run fewer.
GROUPED_NTS = (1, 4, 8)
EPIS = (EPI_NONE, EPI_BIAS, EPI_GLU)
MMV_NAMES: tuple[str, ...] = (
    *(mmv_name(wt, "f32", nt, True, epi) for epi in EPIS for wt in FLOAT_NAMES for nt in NTS),
    *(mmv_name(wt, "f32", 8, False, epi) for epi in EPIS for wt in FLOAT_NAMES),
    *(mmv_name(wt, tb, 8, vec, EPI_NONE) for wt in FLOAT_NAMES for tb in ("f16", "bf16") for vec in (False, True)),
    *(quantize_name(tb) for tb in FLOAT_NAMES),
    *(mmvq_name(wt, nt, epi) for epi in EPIS for wt in QUANT_NAMES for nt in NTS),
    *(mmv_id_name(wt, "f32", vec, epi) for wt in FLOAT_NAMES for vec in (False, True) for epi in EPIS),
    *(mmvq_id_name(wt, epi) for wt in QUANT_NAMES for epi in EPIS),
    *(grouped_name(wt, "f32", nt, True, epi) for wt in FLOAT_NAMES for nt in GROUPED_NTS for epi in EPIS[:2]),
    *(grouped_name(wt, "f32", 8, False, epi) for wt in FLOAT_NAMES for epi in EPIS[:2]),
    *(qgrouped_name(wt, nt, epi) for wt in QUANT_NAMES for nt in GROUPED_NTS for epi in EPIS[:2]),
    ROUTE_NAME,
)
CONVERT_NAMES: tuple[str, ...] = (
    *(convert_name(ts, td) for ts in FLOAT_NAMES for td in FLOAT_NAMES),
    *(dequant_name(wt, td) for wt in QUANT_NAMES for td in ("f16", "f32")),
)
#: mmvq_stream: b f32 for every column count and epilogue; b f16/bf16 (unfused mul_mat only) for 8 columns
STREAM_NAMES: tuple[str, ...] = (
    *(stream_name(wt, "f32", nt, epi) for epi in EPIS for wt in QUANT_NAMES for nt in NTS),
    *(stream_name(wt, tb, 8, EPI_NONE) for tb in ("f16", "bf16") for wt in QUANT_NAMES),
)
KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {MMV_CU: MMV_NAMES, CONVERT_CU: CONVERT_NAMES,
                                               MMVQ_STREAM_CU: STREAM_NAMES}

Ptr = Callable[[Tensor], int]
#: scratch(role, nbytes) -> device address of a buffer of at least nbytes for `role`
Scratch = Callable[[str, int], int]


# -- specs: what to launch, computed from shapes, strides and addresses -----------------------------




@attrs.frozen
class GemmSpec:
    """One cuBLAS call, column-major (see cublas.py): C (m x n) = op(A) (m x k) op(B) (k x n).

    kind "gemm" (batch 1), "strided" (operand i at ptr + i * stride elements)
    or "batched" (one address per batch in `ptrs`: (a, b, c) triples)."""

    kind: str
    transa: int
    transb: int
    m: int
    n: int
    k: int
    a: int
    a_type: str
    lda: int
    b: int
    b_type: str
    ldb: int
    c: int
    ldc: int
    strides: tuple[int, int, int] = (0, 0, 0)
    batch: int = 1
    ptrs: tuple[tuple[int, int, int], ...] = ()


Spec = KernelSpec | GemmSpec
U64, I32, I64, F32 = np.uint64, np.int32, np.int64, np.float32


def nt_for(n: int, choices: Sequence[int] = NTS) -> int:
    """The fewest compiled columns that hold n (n <= 8)."""
    return next(nt for nt in choices if nt >= n)


def _geometry(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and byte strides padded to 4 dims (missing outer dims: size 1, stride 0)."""
    pad = 4 - t.ndim
    return pad4(t.shape), (0,) * pad + tuple(t.strides)


def _aligned(ptr: int, strides_sizes: Sequence[tuple[int, int]], to: int = 16) -> bool:
    """ptr and every stride of an axis longer than 1 are multiples of `to`."""
    return ptr % to == 0 and all(s % to == 0 for s, n in strides_sizes if n > 1)


def _b_vec(b: Tensor, ptr: int) -> bool:
    """b's rows are packed and every row starts 16-byte aligned (K % 4 == 0 is the caller's)."""
    (n3, n2, n1, k), (s3, s2, s1, s0) = _geometry(b)
    return (k == 1 or s0 == b.dtype.block_bytes) and _aligned(ptr, ((s1, n1), (s2, n2), (s3, n3)))


def _a_vec(a: Tensor, ptr: int) -> bool:
    """Float rows of a read with 16-byte loads: K % 8 == 0, rows and batches 16-byte aligned."""
    (n3, n2, m, k), (s3, s2, s1, _) = _geometry(a)
    return k % 8 == 0 and _aligned(ptr, ((s1, m), (s2, n2), (s3, n3)))


def _elem_stride(t: Tensor) -> int:
    """Byte stride of t's last axis (any value when it has one element)."""
    return t.strides[-1] if t.shape[-1] > 1 else t.dtype.block_bytes


def _epilogue(glu: Tensor | None, bias0: Tensor | None) -> tuple[str, int, float, float]:
    if glu is not None:
        return EPI_GLU, GLU_CODES[glu.params["kind"]], glu.params["alpha"], glu.params["limit"]
    return (EPI_BIAS if bias0 is not None else EPI_NONE), 0, 0.0, 0.0


def _addr(ptr: Ptr, t: Tensor | None) -> np.uint64:
    return U64(ptr(t) if t is not None else 0)


def _preload(a: Tensor, a1: Tensor | None, ids: Tensor | None = None) -> np.int32:
    """mmv's and mmvq_stream's `preload` argument: 1 where the weights (and mul_mat_id's ids, which
    pick them) are constant (params), so the kernel loads its first weights before waiting for the
    kernel ahead (programmatic dependent launch)."""
    return I32(all(t is None or t.is_constant for t in (a, a1, ids)))


def _stream_addresses(ptr: Ptr, a: Tensor, a1: Tensor | None) -> bool:
    """The device addresses mmvq_stream needs (support.stream_reason checks the strides): the weights,
    and a fused GLU's up weight, 16-byte aligned. Should an arena ever place one otherwise, the
    two-launch kernel runs though explain() names the stream path."""
    return ptr(a) % 16 == 0 and (a1 is None or (a1.view_offset % 16 == 0 and ptr(a1) % 16 == 0))


#: mmvq_stream's mul_mat_id arguments (ids, ids_t, ids_u, E, bias_e) for a mul_mat
NO_IDS = (U64(0), I64(0), I64(0), I32(0), I64(0))


def stream_spec(node: Tensor, args: tuple, epi: str, device: Device | None,
                cfg: support.StreamConfig | None = None, a1: Tensor | None = None,
                id_args: tuple = NO_IDS) -> KernelSpec | None:
    """mmvq_stream for mul_mat or mul_mat_id `node` (mmv's arguments `args`, then mul_mat_id's
    `id_args`; `a1` the GLU's up weight), or None when it does not fit: cfg's warps halved until the
    block's shared memory fits, the grid from stream_grid (a mul_mat_id batch a (token, slot))."""
    cfg = cfg or support.STREAM
    a, b = node.srcs[:2]
    if node.op == "mul_mat_id":
        (_, m, k), (t, _, _) = a.shape, b.shape
        b3, b2, n = t, node.srcs[2].shape[1], 1
    else:
        (_, _, m, k), _ = _geometry(a)
        (b3, b2, n, _), _ = _geometry(b)
    dt, tb = a.dtype.name, b.dtype.name
    warps = support.stream_warps(dt, k, n, device, cfg)
    if not warps:
        return None
    smem = support.stream_smem(dt, k, n, warps, cfg.stages)
    layout = support.stream_layout(dt, k, epi == EPI_GLU)
    sm_count = (device.props if device is not None else {}).get("sm_count", 132)
    per_sm = support.stream_blocks_per_sm(smem, device, cfg)
    grid = (support.stream_grid(layout, m, b2 * b3, warps, per_sm, sm_count) if n else 0, b2, b3)
    nt = nt_for(max(n, 1)) if tb == "f32" else 8
    ids = node.srcs[2] if node.op == "mul_mat_id" else None
    return KernelSpec(MMVQ_STREAM_CU, stream_name(dt, tb, nt, epi, cfg.stages), grid, 32 * warps,
                      (*args, *id_args, _preload(a, a1, ids)), smem=smem)


def mmv_specs(node: Tensor, out: Tensor, ptr: Ptr, scratch: Scratch, *, a1: Tensor | None = None,
              bias0: Tensor | None = None, bias1: Tensor | None = None, glu: Tensor | None = None,
              device: Device | None = None, stream: support.StreamConfig | None = None, path: str | None = None
              ) -> list[KernelSpec]:
    """mmv (float weights), mmvq_stream or mmvq (block formats) for mul_mat `node` writing `out`
    (node itself, or the last node of a fused group) on `device` (None: an H200's description).

    mmvq_stream where support.choose picks it (and a1, for a fused GLU, is aligned as a is), with
    `stream` (default support.STREAM) as its configuration; mmvq, quantize_q8_1 first, else, or
    when `path` is "mmvq" (scratch/mmvq_stream_sweep.py times both on the same weights), or when
    the device addresses do not suit it (_stream_addresses)."""
    a, b = node.srcs
    (a3, a2, m, k), (sa3, sa2, sa1, _) = _geometry(a)
    (b3, b2, n, _), (sb3, sb2, sb1, _) = _geometry(b)
    pa, pb, tb = ptr(a), ptr(b), b.dtype.name
    epi, kind, alpha, limit = _epilogue(glu, bias0)
    args = (U64(pa), _addr(ptr, a1), I64(sa1), I64(sa2), I64(sa3), I32(b2 // a2), I32(b3 // a3),
            U64(pb), I64(sb1), I64(_elem_stride(b)), I64(sb2), I64(sb3), U64(ptr(out)), I32(m), I32(k), I32(n),
            _addr(ptr, bias0), _addr(ptr, bias1), I32(kind), F32(alpha), F32(limit))
    streamed = (a.dtype.is_quant and path != "mmvq" and support.choose(node, device).path == "mmvq_stream"
                and _stream_addresses(ptr, a, a1))
    if streamed:
        spec = stream_spec(node, args, epi, device, stream, a1)
        if spec is not None:
            return [spec]
    if a.dtype.is_quant:
        quant, bq, bds, nbp = quantize_spec(b, pb, scratch)
        qargs = (*args[:7], U64(bq), U64(bds), I32(nbp), *args[12:])
        rows = QROWS // (2 if epi == EPI_GLU else 1)
        grid = (math.ceil(m / rows) if n else 0, b2, b3)
        return [quant, KernelSpec(MMV_CU, mmvq_name(a.dtype.name, nt_for(max(n, 1)), epi), grid, q_threads(k),
                                  qargs)]
    vec = (k % 4 == 0 and _b_vec(b, pb) and _a_vec(a, pa) and (a1 is None or ptr(a1) % 16 == 0))
    nt = nt_for(max(n, 1)) if vec and tb == "f32" else 8
    grid = (math.ceil(m / ROWS) if n else 0, b2, b3)
    return [KernelSpec(MMV_CU, mmv_name(a.dtype.name, tb, nt, vec, epi), grid, BLOCK, (*args, _preload(a, a1)))]


def _id_b(node: Tensor, ptr: Ptr) -> tuple[int, int, int, int, bool]:
    """mul_mat_id's b as the kernels read it: (address, token stride, slot stride, element
    stride, 16-byte loads for float experts)."""
    as_, b, _ = node.srcs
    vec = b.shape[-1] % 4 == 0 and _b_vec(b, ptr(b)) and _a_vec(as_, ptr(as_))
    return ptr(b), b.strides[0], b.strides[1], _elem_stride(b), vec


def mmv_id_specs(node: Tensor, out: Tensor, ptr: Ptr, scratch: Scratch, *, a1: Tensor | None = None,
                 bias0: Tensor | None = None, bias1: Tensor | None = None, glu: Tensor | None = None,
                 device: Device | None = None, stream: support.StreamConfig | None = None) -> list[KernelSpec]:
    """mmvq_stream, mmv_id or mmvq_id for mul_mat_id `node` (a grid z index a token) writing `out`:
    mmvq_stream (configuration `stream`, default support.STREAM) for block formats where
    support.stream_reason allows (and a1 is aligned as the experts are), mmvq_id, quantize_q8_1
    first, for the others."""
    as_, b, ids = node.srcs
    e, m, k = as_.shape
    t, ub, _ = b.shape
    u = ids.shape[1]
    pb, b_t, b_u, b_es, vec = _id_b(node, ptr)
    vec = vec and (a1 is None or ptr(a1) % 16 == 0)
    epi, kind, alpha, limit = _epilogue(glu, bias0)
    bias_e = bias0.strides[0] if bias0 is not None else 0
    if as_.dtype.is_quant and not support.stream_reason(node, device) and _stream_addresses(ptr, as_, a1):
        sargs = (U64(ptr(as_)), _addr(ptr, a1), I64(as_.strides[1]), I64(as_.strides[0]), I64(0), I32(1), I32(1),
                 U64(pb), I64(0), I64(b_es), I64(b_u if ub > 1 else 0), I64(b_t), U64(ptr(out)), I32(m), I32(k), I32(1),
                 _addr(ptr, bias0), _addr(ptr, bias1), I32(kind), F32(alpha), F32(limit))
        id_args = (U64(ptr(ids)), I64(ids.strides[0]), I64(ids.strides[1]), I32(e), I64(bias_e // 4))
        spec = stream_spec(node, sargs, epi, device, stream, a1, id_args)
        if spec is not None:
            return [spec]
    args = (U64(ptr(as_)), _addr(ptr, a1), I64(as_.strides[1]), I64(as_.strides[0]), I32(e),
            U64(ptr(ids)), I64(ids.strides[0]), I64(ids.strides[1]),
            U64(pb), I64(b_t), I64(b_u), I32(ub), I64(b_es), U64(ptr(out)), I32(m), I32(k),
            _addr(ptr, bias0), _addr(ptr, bias1), I64(bias_e), I32(kind), F32(alpha), F32(limit))
    if as_.dtype.is_quant:
        quant, bq, bds, nbp = quantize_spec(b, pb, scratch)
        qargs = (*args[:8], U64(bq), U64(bds), I32(nbp), I32(ub), *args[13:])
        rows = QROWS // (2 if epi == EPI_GLU else 1)
        return [quant, KernelSpec(MMV_CU, mmvq_id_name(as_.dtype.name, epi), (math.ceil(m / rows), u, t),
                                  q_threads(k), qargs)]
    return [KernelSpec(MMV_CU, mmv_id_name(as_.dtype.name, "f32", vec, epi), (math.ceil(m / ROWS), u, t), BLOCK,
                       args)]


def route_words(n_experts: int, pairs: int) -> int:
    """int32 words of moe_route's table."""
    return 1 + 3 * n_experts + pairs


def grouped_specs(node: Tensor, out: Tensor, ptr: Ptr, scratch: Scratch, *, bias: Tensor | None = None
                  ) -> list[KernelSpec]:
    """moe_route, then mmv_id_grouped / mmvq_id_grouped for mul_mat_id `node`."""
    as_, b, ids = node.srcs
    e, m, k = as_.shape
    t, ub, _ = b.shape
    u = ids.shape[1]
    pairs = t * u
    route = scratch("route", 4 * route_words(e, pairs))
    pb, b_t, b_u, b_es, vec = _id_b(node, ptr)
    specs = [KernelSpec(
        MMV_CU, ROUTE_NAME, (1,), ROUTE_BLOCK,
        (U64(ptr(ids)), I64(ids.strides[0]), I64(ids.strides[1]), I32(t), I32(u), I32(e), U64(route),
         U64(ptr(out)), I32(m)),
        smem=2 * 4 * e)]
    quant = as_.dtype.is_quant
    nt = nt_for(min(support.MMV_MAX_N, max(1, math.ceil(pairs / min(e, pairs)))), GROUPED_NTS)
    nt = nt if vec or quant else 8
    epi = EPI_BIAS if bias is not None else EPI_NONE
    args = (U64(ptr(as_)), I64(as_.strides[1]), I64(as_.strides[0]), I32(e), U64(route),
            U64(pb), I64(b_t), I64(b_u), I32(ub), I64(b_es), U64(ptr(out)), I32(m), I32(k), I32(u),
            _addr(ptr, bias), I64(bias.strides[0] if bias is not None else 0))
    if quant:
        qspec, bq, bds, nbp = quantize_spec(b, pb, scratch)
        qargs = (*args[:5], U64(bq), U64(bds), I32(nbp), I32(ub), *args[10:])
        specs += [qspec, KernelSpec(MMV_CU, qgrouped_name(as_.dtype.name, nt, epi),
                                    (math.ceil(m / QROWS), min(e, pairs)), q_threads(k), qargs)]
    else:
        specs.append(KernelSpec(MMV_CU, grouped_name(as_.dtype.name, "f32", nt, vec, epi),
                                (math.ceil(m / ROWS), min(e, pairs)), BLOCK, args))
    return specs


def _conversion(src: Tensor, dst_type: str, dst: int) -> KernelSpec:
    """convert/dequant of `src` (rows on its last axis) into a contiguous `dst_type` buffer at `dst`."""
    (n3, n2, n1, n0), (s3, s2, s1, s0) = _geometry(src)
    rows = n1 * n2 * n3
    grid = (max(1, min(rows, CONVERT_GRID_MAX)),)
    if src.dtype.is_quant:
        return KernelSpec(CONVERT_CU, dequant_name(src.dtype.name, dst_type), grid, CONVERT_BLOCK,
                          (U64(0), I32(n0), I32(n1), I32(n2), I32(n3), I64(s1), I64(s2), I64(s3), U64(dst)))
    return KernelSpec(CONVERT_CU, convert_name(src.dtype.name, dst_type), grid, CONVERT_BLOCK,
                      (U64(0), I32(n0), I32(n1), I32(n2), I32(n3), I64(s0), I64(s1), I64(s2), I64(s3), U64(dst)))


def conversion(src: Tensor, dst_type: str, src_ptr: int, dst: int) -> KernelSpec:
    spec = _conversion(src, dst_type, dst)
    return attrs.evolve(spec, args=(U64(src_ptr), *spec.args[1:]))


ELEM = {"f32": 4, "f16": 2, "bf16": 2}


@attrs.frozen
class Operand:
    """A matrix operand of a batched GEMM: base address, per-batch byte strides (outer, inner),
    leading dimension (elements), transpose flag and element type."""

    ptr: int
    s3: int
    s2: int
    ld: int
    trans: int
    dtype: str


def batched(spec_args: dict, a: Operand, b: Operand, c: Operand, batches: tuple[int, int],
            ratios: tuple[int, int]) -> GemmSpec:
    """One GemmSpec over batches (B3, B2) with a repeat-interleaved by `ratios` (r3, r2):
    batch (i3, i2) reads a's (i3 // r3, i2 // r2). Strided when every operand's addresses
    step evenly over the flattened batches, else pointer arrays."""
    n3, n2 = batches
    r3, r2 = ratios
    trip = [(a.ptr + (i3 // r3) * a.s3 + (i2 // r2) * a.s2, b.ptr + i3 * b.s3 + i2 * b.s2, c.ptr + i3 * c.s3 + i2 * c.s2)
            for i3 in range(n3) for i2 in range(n2)]
    common = dict(transa=a.trans, transb=b.trans, a_type=a.dtype, lda=a.ld, b_type=b.dtype, ldb=b.ld, ldc=c.ld,
                  **spec_args)
    if len(trip) == 1:
        return GemmSpec("gemm", a=trip[0][0], b=trip[0][1], c=trip[0][2], **common)
    steps = [trip[1][j] - trip[0][j] for j in range(3)]
    even = all(trip[i][j] - trip[i - 1][j] == steps[j] for i in range(1, len(trip)) for j in range(3))
    sizes = (ELEM[a.dtype], ELEM[b.dtype], 4)
    if even and all(s >= 0 and s % z == 0 for s, z in zip(steps, sizes)):
        return GemmSpec("strided", a=trip[0][0], b=trip[0][1], c=trip[0][2],
                        strides=tuple(s // z for s, z in zip(steps, sizes)), batch=len(trip), **common)
    return GemmSpec("batched", a=trip[0][0], b=trip[0][1], c=trip[0][2], batch=len(trip), ptrs=tuple(trip), **common)


def compute_type(a: Tensor) -> str:
    """The type both GEMM operands take: f16 for block formats, else a's own."""
    return "f16" if a.dtype.is_quant else a.dtype.name


def gemm_specs(node: Tensor, ptr: Ptr, scratch: Scratch) -> list[Spec]:
    """cublas / dequant_cublas for mul_mat `node`.

    Row-major out (N, M) = b (N, K) @ a (M, K)^T, in cuBLAS' column-major terms:
    a's row-major (M, K) buffer (row stride lda >= K) read column-major is a
    K x M matrix A'; b's row-major (N, K) buffer (row stride ldb) read column-
    major is a K x N matrix B'; out's (N, M) buffer is a column-major M x N
    matrix C (ldc = M). C = A'^T B': gemm(transa=T, transb=N, m=M, n=N, k=K,
    A=a, lda, B=b, ldb, C=out, ldc=M). A b with its N axis packed instead (a
    transposed view) is a column-major N x K matrix (ld = its K stride) and
    goes in with transb=T; any other b layout is copied first.
    """
    from opdispatch.backends.cuda import cublas

    a, b = node.srcs
    (a3, a2, m, k), (sa3, sa2, sa1, _) = _geometry(a)
    (b3, b2, n, _), (sb3, sb2, sb1, sb0) = _geometry(b)
    ct = compute_type(a)
    es = ELEM[ct]
    specs: list[Spec] = []
    if a.dtype.is_quant:
        dst = scratch("a", a3 * a2 * m * k * es)
        specs.append(conversion(a, ct, ptr(a), dst))
        a_op = Operand(dst, a2 * m * k * es, m * k * es, k, cublas.CUBLAS_OP_T, ct)
    else:
        a_op = Operand(ptr(a), sa3, sa2, sa1 // es if m > 1 else k, cublas.CUBLAS_OP_T, ct)
    b_elem = b.dtype.block_bytes
    if b.dtype.name == ct and (k == 1 or sb0 == b_elem) and (n == 1 or sb1 >= k * b_elem):
        b_op = Operand(ptr(b), sb3, sb2, sb1 // b_elem if n > 1 else k, cublas.CUBLAS_OP_N, ct)
    elif b.dtype.name == ct and n > 1 and sb1 == b_elem and (k == 1 or sb0 >= n * b_elem):
        b_op = Operand(ptr(b), sb3, sb2, sb0 // b_elem if k > 1 else n, cublas.CUBLAS_OP_T, ct)
    else:
        dst = scratch("b", b3 * b2 * n * k * es)
        specs.append(conversion(b, ct, ptr(b), dst))
        b_op = Operand(dst, b2 * n * k * es, n * k * es, k, cublas.CUBLAS_OP_N, ct)
    c_op = Operand(ptr(node), b2 * n * m * 4, n * m * 4, m, 0, "f32")
    r3, r2 = b3 // a3, b2 // a2
    nn, batches, ratios = n, (b3, b2), (r3, r2)
    if r2 > 1 and b_op.trans == cublas.CUBLAS_OP_N and b_op.s2 == n * b_op.ld * es:
        # b's batches r2 at a time are one (r2 * N, K) matrix against the same a: fold them
        nn, batches, ratios = n * r2, (b3, a2), (r3, 1)
        b_op = attrs.evolve(b_op, s2=b_op.s2 * r2)
        c_op = attrs.evolve(c_op, s2=c_op.s2 * r2)
    specs.append(batched(dict(m=m, n=nn, k=k), a_op, b_op, c_op, batches, ratios))
    return specs


def out_prod_specs(node: Tensor, ptr: Ptr, scratch: Scratch) -> list[Spec]:
    """cublas_out_prod: out[n, m] = sum_k b[k, n] * a[k, m] per batch.

    Column-major: a's row-major (K, M) buffer (row stride lda >= M) is an M x K
    matrix A; out's (N, M) buffer an M x N matrix C (ldc = M); C = A op(B) with
    op(B)[k, n] = b[k, n]: b's row-major (K, N) rows read column-major are an
    N x K matrix, so transb=T with ldb = its K stride; a b with its K axis
    packed (a transposed view) is already K x N: transb=N, ldb = its N stride.
    gemm(transa=N, transb, m=M, n=N, k=K, A=a, lda, B=b, ldb, C=out, ldc=M).
    Weights other than f32 are converted to f32 first; other b layouts copied.
    """
    from opdispatch.backends.cuda import cublas

    a, b = node.srcs
    (a3, a2, k, m), (sa3, sa2, sa1, _) = _geometry(a)
    (b3, b2, _, n), (sb3, sb2, sb1, sb0) = _geometry(b)
    specs: list[Spec] = []
    if a.dtype.name == "f32":
        a_op = Operand(ptr(a), sa3, sa2, sa1 // 4 if k > 1 else m, cublas.CUBLAS_OP_N, "f32")
    else:
        dst = scratch("a", a3 * a2 * k * m * 4)
        specs.append(conversion(a, "f32", ptr(a), dst))
        a_op = Operand(dst, a2 * k * m * 4, k * m * 4, m, cublas.CUBLAS_OP_N, "f32")
    if (n == 1 or sb0 == 4) and (k == 1 or sb1 >= 4 * n):
        b_op = Operand(ptr(b), sb3, sb2, sb1 // 4 if k > 1 else n, cublas.CUBLAS_OP_T, "f32")
    elif k > 1 and sb1 == 4 and (n == 1 or sb0 >= 4 * k):
        b_op = Operand(ptr(b), sb3, sb2, sb0 // 4 if n > 1 else k, cublas.CUBLAS_OP_N, "f32")
    else:
        dst = scratch("b", b3 * b2 * k * n * 4)
        specs.append(conversion(b, "f32", ptr(b), dst))
        b_op = Operand(dst, b2 * k * n * 4, k * n * 4, n, cublas.CUBLAS_OP_T, "f32")
    c_op = Operand(ptr(node), b2 * n * m * 4, n * m * 4, m, 0, "f32")
    specs.append(batched(dict(m=m, n=n, k=k), a_op, b_op, c_op, (b3, b2), (b3 // a3, b2 // a2)))
    return specs


# -- binding: specs -> launches -------------------------------------------------------------------




def scratch_for(ctx: CudaContext, kept: list) -> Scratch:
    """scratch(role, nbytes) for one bind: the backend's scratch buffer of that role
    (`ScratchPool`); every buffer handed out is appended to `kept`."""

    def get(role: str, nbytes: int) -> int:
        buf = ctx.backend.scratch.take(Workspace(nbytes, f"cuda_matmul {role}"))
        kept.append(buf)
        return buf.ptr

    return get


def _gemm_launch(ctx: CudaContext, g: GemmSpec) -> Launch:
    from opdispatch.backends.cuda import cublas

    h = cublas.for_backend(ctx.backend)
    at, bt = cublas.DATA_TYPES[g.a_type], cublas.DATA_TYPES[g.b_type]
    ct = cublas.CUDA_R_32F
    if g.kind in ("gemm", "strided"):
        return h.matmul(g.transa, g.transb, g.m, g.n, g.k, g.a, at, g.lda, g.b, bt, g.ldb, g.c, ct, g.ldc, g.strides,
                        g.batch)
    pa, pb, pc = zip(*g.ptrs)
    return h.gemm_batched(g.transa, g.transb, g.m, g.n, g.k, pa, at, g.lda, pb, bt, g.ldb, pc, ct, g.ldc)


def _realize(ctx: CudaContext, specs: Sequence[Spec], kept: Sequence[Any] = ()) -> Launch:
    with ctx.backend.cuda_device:
        parts = [(s.launch(ctx.stream) if isinstance(s, KernelSpec) else _gemm_launch(ctx, s)) for s in specs]
    return chain(parts, kept)


def _empty(node: Tensor) -> bool:
    return node.size == 0


def _bind(ctx: CudaContext, node: Tensor, make: Callable[[Scratch], list]) -> Launch:
    """Specs from `make(scratch)` (with this bind's scratch buffers kept alive) as one launch."""
    from opdispatch.backends.cuda.kernels import EMPTY

    if _empty(node):
        return EMPTY
    kept: list = []
    return _realize(ctx, make(scratch_for(ctx, kept)), kept)


def bind_mmv(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind(ctx, node, lambda scratch: mmv_specs(node, node, ctx.ptr, scratch, device=ctx.device))


def bind_gemm(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind(ctx, node, lambda scratch: gemm_specs(node, ctx.ptr, scratch))


def bind_out_prod(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind(ctx, node, lambda scratch: out_prod_specs(node, ctx.ptr, scratch))


def bind_mmv_id(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind(ctx, node, lambda scratch: mmv_id_specs(node, node, ctx.ptr, scratch, device=ctx.device))


def bind_mmv_id_grouped(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind(ctx, node, lambda scratch: grouped_specs(node, node, ctx.ptr, scratch))


def fused_specs(nodes: Sequence[Tensor], ptr: Ptr, scratch: Scratch, device: Device | None = None
                ) -> list[KernelSpec]:
    """Any group of fusion.PATTERNS: the mat-vec launch (mmvq_stream, or quantize_q8_1 then mmvq,
    for block formats) that writes the last node."""
    prods, biases, glu = fusion.parts(nodes)
    out, first = nodes[-1], prods[0]
    if first.op == "mul_mat_id" and glu is None and first.shape[0] > 1:
        return grouped_specs(first, out, ptr, scratch, bias=biases[0])
    make = functools.partial(mmv_specs if first.op == "mul_mat" else mmv_id_specs, device=device)
    if glu is None:
        return make(first, out, ptr, scratch, bias0=biases[0])
    return make(first, out, ptr, scratch, a1=prods[1].srcs[0], bias0=biases[0], bias1=biases[1], glu=glu)


def bind_fused(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    return _bind(ctx, nodes[-1], lambda scratch: fused_specs(nodes, ctx.ptr, scratch, ctx.device))


# -- hooks ------------------------------------------------------------------------------------------

#: (op, path name, bind) of every Kernel record, in the order they are asked
PATHS: tuple[tuple[str, str, Callable], ...] = (
    ("mul_mat", "mmvf", bind_mmv),
    ("mul_mat", "mmvq_stream", bind_mmv),
    ("mul_mat", "mmvq", bind_mmv),
    ("mul_mat", "cublas", bind_gemm),
    ("mul_mat", "dequant_cublas", bind_gemm),
    ("mul_mat_id", "mmv_id", bind_mmv_id),
    ("mul_mat_id", "mmv_id_grouped", bind_mmv_id_grouped),
    ("out_prod", "cublas_out_prod", bind_out_prod),
)


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda_matmul", "0.1.0", PRIORITY_BUILTIN,
                      "mul_mat, mul_mat_id, out_prod; quantized mat-vec; bias/GLU fusions")


@hookimpl
def supports_op(device: Device, node: Tensor) -> bool | str | None:
    """Plugin-wide gate: 32-lane warps, then the matrix products' shared conditions (said once)."""
    if device.kind != "cuda" or node.op not in support.MATMUL_OPS:
        return None
    return warp32_gate(device) or support.gate(node)


@hookimpl
def kernels(device: Device) -> Iterator[Kernel]:
    if device.kind != "cuda":
        return
    for op, path, bind in PATHS:
        yield Kernel(op, bind, support.takes(path), name=path)


@hookimpl
def fusion_rules(device: Device) -> Iterator[FusionRule]:
    if device.kind != "cuda":
        return
    for name, pattern in fusion.PATTERNS:
        yield FusionRule(name, pattern, bind=bind_fused, check=fusion.check)
