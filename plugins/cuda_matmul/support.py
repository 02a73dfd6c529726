"""Which matrix-product path runs a node, as tables of (condition, reason) read top to bottom.

`choose(node)` gives a `Choice`: the path's name (a Kernel's `name`, shown by `Plan.explain()`) or
the reason the plugin declines the node. The plugin-wide `supports_op` gate returns that reason, so
it is said once; each Kernel's `supports` accepts exactly the nodes whose path is its own, so the
paths are mutually exclusive. Conditions only read shapes, strides, dtypes and view offsets (and the
device's facts, for mmvq_stream's shared memory): plans are made and tested on a device
description. The paths are listed in docs/cuda_matmul.md.
"""

from __future__ import annotations

import math
from typing import Callable

import attrs

from opdispatch.hookspecs import Device
from opdispatch.ops.base import pad4
from opdispatch.support import GRID_YZ_MAX, Rule, first_failure, fits_int, rows_apart, whole_elements
from opdispatch.tensor import Tensor

from .specs import (MMF_TYPES, QUANT_NAMES, RAGGED_NT, RAGGED_TYPES, STREAM_B16, mmf, mmq, mmq_id, mmq_small,
                     mmq_wgmma)
from .specs.stream import STREAMED, device_facts, stream_geo, stream_warps

#: most columns (batch N) the mat-vec kernels take; larger batches go to mmf (float weights) or cuBLAS
MMV_MAX_N = 8
#: mmf (tensor cores, f16/bf16 weights) takes MMF_MIN_N..MMF_MAX_N columns where mmf_ok allows. On the H200
#: (2026-12-03, bf16, 16 columns, cold weights, `benchmarks/test_bench_matmul.py -k mmf`) the weight stream ran
#: 1.15-1.54x cuBLAS with b converted first at the 1b preset's layer shapes and 0.82x at a 128256 x 2048 LM
#: head; the fused gate/up 1.34x (docs/benchmarks.md). Its tests lower MMF_MIN_N to run it below 9.
MMF_MIN_N = 9
#: most columns mmf takes (the kernel's two 8-column tiles); more go to cuBLAS
MMF_MAX_N = 16
#: most columns mmq takes (every format; MMQ_WGMMA_MIN_N bounds it lower for MMQ_WGMMA_TYPES); more go to
#: mmq_wgmma (compute capability 9.0) or dequant_cublas. On the H200 (q4_0 / q8_0, 4096 x 14336 weights) mmq was
#: 4.3x faster than dequant_cublas at 16 columns, 1.09x / 1.30x at 128 and 0.48x / 0.57x at 512
#: (docs/benchmarks.md)
MMQ_MAX_N = 128
#: mmq_small (the quantized GEMM whose warps stream their own weight rows) is compiled for up to
#: MMQ_SMALL_MAX_N columns (specs/mmq_small.SMALL_NTS) and takes MMQ_SMALL_MIN_N.. of them where mmq_small_ok
#: allows. On the H200 (2026-12-02, 16 columns, cold, scripts/mmq_sweep.py; docs/benchmarks.md) with 8 warps a
#: block (specs/mmq_small.SMALL) it beat mmq's table at the 1b preset's four layer shapes (q4_0 and q4_K: 119.2
#: us summed against 135.9) and at 4096 x 14336 (q4_0 38.0 us against 43.9, q4_K 45.7 / 48.6), lost at
#: 14336 x 4096 for q4_K (51.1 / 45.2) and for q8_0 (0.90x); the 1b batch-16 decode gained (Q4_K_M 7197 tokens/s
#: against 6836, q4_0 8893 / 8845), so it takes every column count from 9. q8_0 too since session 22's b copy and
#: split-K sum (H200, 2026-12-03, 16 columns, cold: 8192 x 2048 0.95x and 2048 x 8192 0.83x mmq's time, 4096 x 14336
#: 1.02x; the 1b batch-16 decode 9788 -> 10444 tokens/s), where it had kept mmq unless mmq_small's grid was one wave.
MMQ_SMALL_MIN_N = 9
MMQ_SMALL_MAX_N = 32
#: the formats whose products mmq declines take mmq_wgmma (the dequantizing wgmma GEMM, compute capability 9.0)
#: instead of dequant_cublas. On the H200 (2026-12-03, 512 columns; docs/benchmarks.md) it is correct for every
#: format; q4_0 (its weights straight into wgmma's register fragments) is faster than dequant_cublas: 4096 x 14336
#: 178.6 us against 224.1, the 1b preset's 512-token prefill 5.10 ms against 5.41. The others are not yet (through
#: the A stages: q8_0 4096 x 14336 270 us, q4_K 333 us, where dequant_cublas took 266 and 212; the Q4_K_M prefill
#: 8.65 ms against 5.15). The GPU tests select every format. Session 27 (the wide tile, register fragments for the
#: K-quants): test_mmq[q4_K-512] 177.4 us against dequant_cublas's 205.3, but the Q4_K_M prefill 5.06 ms against
#: 4.75, so the K-quants stayed off. Session 36 (the RS formats' warp-specialized loop; H200, one call): the K-quants
#: with register fragments (q4_K, q5_K, q6_K) on: test_mmq[q4_K-512] 151.7 us against 205.0, the Q4_K_M prefill
#: 4049 us against 4222 with every K-quant product on it; MMQ_WGMMA_MIN_VALUES keeps the smaller weights off it
#: (the prefill not yet timed so).
MMQ_WGMMA_TYPES: tuple[str, ...] = ("q4_0", "q8_0", "q4_K", "q5_K", "q6_K")
#: the fewest weight values (rows x K of one matrix) from which mmq_wgmma takes a format of MMQ_WGMMA_TYPES (one
#: not named here: any). On the H200 (session 36, `test_wgmma_or_dequant` at 512 columns, one call) q4_K took
#: 0.74x dequant_cublas's time at 8192 x 2048 weights and 0.87x at 2048 x 8192, but 1.20x at 3072 x 2048, 1.21x at
#: 2048 x 2048 and 1.73x at 512 x 2048; q6_K 0.76x, 0.91x, 1.26x, 1.27x, 1.59x. q5_K, not timed against
#: dequant_cublas, follows them (its fragments cost between q4_K's and q6_K's). Below, the product goes where it
#: went before (mmq up to MMQ_MAX_N columns, dequant_cublas above).
MMQ_WGMMA_MIN_VALUES: dict[str, int] = {"q4_K": 1 << 24, "q5_K": 1 << 24, "q6_K": 1 << 24}
#: from this many columns mmq_wgmma takes the products of MMQ_WGMMA_TYPES that mmq would: on the H200
#: (2026-12-04, one process, q4_0 / q8_0 / q4_K at 4096 x 14336, 14336 x 4096, 2048 x 8192, 8192 x 2048) it
#: took 0.33-0.55x mmq's time at 96 and 128 columns, 0.55-1.02x at 64 and 0.56-1.14x at 48
MMQ_WGMMA_MIN_N = 65
#: the formats whose mul_mat_id with many tokens takes mmq_wgmma_id (the dequantizing wgmma GEMM, compute capability
#: 9.0; compiled for every format of mmq_id) instead of mmq_id, where an expert has more than MMQ_WGMMA_ID_MIN_MEAN
#: pairs on average: mmq_id carries mmq's int8 products, each K step's sums converted and scaled (near twice cuBLAS
#: bf16's time at 512 columns), which left the MoE prefill at 3.4x (q4_0) and 6.4x (q4_K) the dense product of the
#: same active parameters on the H200 (session 13; target 1.5x). Session 35 (H200, `test_moe_prefill_8_of_64`, one
#: call): 226 us (q4_0) and 268 (q4_K) against mmq_id's 377 and 617. q8_0, q5_K, q6_K (the same register-fragment
#: loop) and mxfp4 (through the A stages; 400 us, with no mmq_id time beside it) are selected untimed against mmq_id.
MMQ_WGMMA_ID_TYPES: tuple[str, ...] = ("q4_0", "q8_0", "q4_K", "q5_K", "q6_K", "mxfp4")
#: mean (token, slot) pairs an expert from which mmq_wgmma_id's column tiles (128 pairs) are taken over mmq_id's
#: (32 up to specs/mmq_id.SMALL_MEAN pairs an expert, 64 above)
MMQ_WGMMA_ID_MIN_MEAN = 32
#: most experts the routing kernel of mmv_id_grouped and mmq_id takes (shared memory: 2 ints an expert)
ROUTE_MAX_EXPERTS = 4096
#: mul_mat_id with several tokens takes mmq_id (the quantized GEMM) where it has more than this many (token,
#: slot) pairs an expert on average (T * U > MMQ_ID_PAIRS_PER_EXPERT * E): fewer leave its column tiles mostly
#: empty, and mmv_id_grouped (a mat-vec per expert, 8 pairs at a time) reads each expert's weights as few times
MMQ_ID_PAIRS_PER_EXPERT = 8

MATMUL_OPS = ("mul_mat", "mul_mat_id", "out_prod")


@attrs.frozen
class Choice:
    path: str = ""
    reason: str = ""
    note: str = ""  # why a faster path declined the node (mmq_wgmma: mmq's reason; dequant_cublas: both)


def _a(n: Tensor) -> Tensor:
    return n.srcs[0]


def _b(n: Tensor) -> Tensor:
    return n.srcs[1]


def common_rules() -> tuple[Rule, ...]:
    """What every matrix product asks: an f32 contiguous result, weights of a format some kernel reads."""
    return (
        (lambda n: n.dtype.name == "f32" and n.is_contiguous(), "the result must be contiguous f32"),
        (lambda n: not _a(n).dtype.is_quant or _a(n).dtype.name in QUANT_NAMES,
         "no kernel reads the weights' block format (q8_K is ggml's activation format, not a weight's)"),
    )


#: mul_mat: a (A3, A2, M, K) any type, b (B3, B2, N, K) float, out (B3, B2, N, M) f32.
MUL_MAT: tuple[Rule, ...] = (
    *common_rules(),
    (lambda n: _a(n).rows_contiguous(), "a's rows (the K axis) must be contiguous"),
    (lambda n: whole_elements(_a(n)), "a's strides and offset must be whole elements"),
    (lambda n: whole_elements(_b(n)), "b's strides and offset must be whole elements"),
    (lambda n: rows_apart(_a(n)), "a's rows overlap"),
    (lambda n: _a(n).shape[-1] > 0, "an empty product (K = 0)"),
    (lambda n: fits_int(n.size, _a(n).shape[-1], _a(n).shape[-2], _b(n).shape[-2]), "sizes must be below 2**31"),
    (lambda n: max(pad4(n.shape)[:2]) <= GRID_YZ_MAX, "batch dims must be at most 65535"),
)

#: mul_mat_id: as (E, M, K), b (T, Ub, K) f32, ids (T, U) i32, out (T, U, M).
MUL_MAT_ID: tuple[Rule, ...] = (
    *common_rules(),
    (lambda n: _a(n).rows_contiguous(), "the experts' rows (the K axis) must be contiguous"),
    (lambda n: whole_elements(_a(n)), "the experts' strides and offset must be whole elements"),
    (lambda n: whole_elements(_b(n)) and whole_elements(n.srcs[2]), "b's and ids' strides must be whole elements"),
    (lambda n: _a(n).shape[-1] > 0, "an empty product (K = 0)"),
    (lambda n: fits_int(n.size, _a(n).shape[-1]), "sizes must be below 2**31"),
    (lambda n: n.shape[0] == 1 or _a(n).shape[0] <= ROUTE_MAX_EXPERTS,
     f"more than {ROUTE_MAX_EXPERTS} experts with several tokens"),
    (lambda n: n.shape[0] > 1 or n.shape[1] <= GRID_YZ_MAX, "more than 65535 experts used per token"),
)

#: out_prod: a (A3, A2, K, M) any type, b (B3, B2, K, N) f32, out (B3, B2, N, M).
OUT_PROD: tuple[Rule, ...] = (
    *common_rules(),
    (lambda n: _a(n).rows_contiguous(), "a's rows (the M axis) must be contiguous"),
    (lambda n: whole_elements(_a(n)) and whole_elements(_b(n)), "strides and offsets must be whole elements"),
    (lambda n: rows_apart(_a(n)), "a's rows overlap"),
    (lambda n: _a(n).shape[-2] > 0, "an empty product (K = 0)"),
    (lambda n: fits_int(n.size, _a(n).size, _b(n).size), "sizes must be below 2**31"),
)

RULES = {"mul_mat": MUL_MAT, "mul_mat_id": MUL_MAT_ID, "out_prod": OUT_PROD}


def batch_n(node: Tensor) -> int:
    """Columns a mul_mat multiplies each weight matrix by (ggml's ne[1])."""
    return node.shape[-2]


def _aligned16(t: Tensor) -> bool:
    """View offset and every stride of an axis longer than 1 (but the contiguous last) multiples of 16."""
    return t.view_offset % 16 == 0 and all(s % 16 == 0 for s, n in zip(t.strides[:-1], t.shape[:-1]) if n > 1)


def _whole_chunks(a: Tensor, row_values: int, chunk: int, device: Device | None, needs: str) -> bool | str:
    """What mmvq_stream and mmq ask of the weights: rows of whole `chunk`-byte chunks (K a multiple of
    `row_values`) copied 16 bytes at a time (a 16-byte aligned), and an sm_80 GPU for `needs`."""
    k = a.shape[-1]
    if k % row_values:
        return f"K={k} is not a multiple of {row_values} (rows of whole {chunk}-byte chunks)"
    if not _aligned16(a):
        return "a's offset or row/batch strides are not multiples of 16 bytes"
    if device is not None and device.kind == "cuda" and device_facts(device).cc < (8, 0):
        return f"{needs} needs sm_80"
    return True


def stream_ok(node: Tensor, device: Device | None = None) -> bool | str:
    """True if mmvq_stream runs mul_mat `node` (block-format a, N <= 8, checked by the caller) or
    mul_mat_id `node` (one b column a (token, slot)), else why the two-launch mmvq / mmvq_id runs it."""
    a = _a(node)
    n = 1 if node.op == "mul_mat_id" else batch_n(node)
    dt, k = a.dtype.name, a.shape[-1]
    if dt not in STREAMED:
        return f"{dt} has no streamed mat-vec"
    if node.op == "mul_mat_id" and 1 < _b(node).shape[1] < node.srcs[2].shape[1]:
        return (f"b has {_b(node).shape[1]} rows a token for {node.srcs[2].shape[1]} slots: the streamed kernel "
                "reads row u for slot u, mmvq_id row u % rows")
    if dt not in STREAM_B16 and _b(node).dtype.name != "f32":
        return f"{dt} streams an f32 b only (fewer instances to compile); mmvq quantizes a {_b(node).dtype.name} b"
    g = stream_geo(dt)
    if k % g.row_values:  # the RAGGED instances (RAGGED_TYPES): any row stride, the weights' base 16-byte aligned
        if dt not in RAGGED_TYPES:  # the legacy formats (q4_K's and q5_K's rows are always whole chunks)
            return (f"K={k} is not a multiple of {g.row_values} (rows of whole {g.chunk}-byte chunks), and "
                    f"mmvq_stream's RAGGED instances take no legacy format ({dt}): mmvq runs those rows")
        if n > RAGGED_NT or _b(node).dtype.name != "f32":
            return (f"K={k} is not a multiple of {g.row_values} (rows of whole {g.chunk}-byte chunks), which "
                    f"mmvq_stream takes at {RAGGED_NT} f32 column only")
        if a.view_offset % 16:
            return "a's offset is not a multiple of 16 bytes"
        if device is not None and device.kind == "cuda" and device_facts(device).cc < (8, 0):
            return "cp.async needs sm_80"
    else:
        chunked = _whole_chunks(a, g.row_values, g.chunk, device, "cp.async")
        if chunked is not True:
            return chunked
    if not stream_warps(dt, k, n, device):
        return f"b's q8_1 copy of {n}x{k} values does not fit in shared memory"
    return True


def mmq_ok(node: Tensor, device: Device | None = None) -> bool | str:
    """True if mmq runs mul_mat `node` (block-format a, N > 8, checked by the caller), else why mmq_wgmma or
    dequant_cublas runs it: rows of whole 16-byte granules (stream_geo's chunks), a 16-byte aligned."""
    a = _a(node)
    dt = a.dtype.name
    if dt not in mmq.MMQ_FORMATS:
        return f"{dt} has no quantized GEMM"
    if batch_n(node) > MMQ_MAX_N:
        return f"N={batch_n(node)} > {MMQ_MAX_N}: mmq_wgmma or dequant_cublas is faster there"
    g = stream_geo(dt)
    chunked = _whole_chunks(a, g.row_values, g.chunk, device, "int8 mma.sync m16n8k32")
    if chunked is not True:
        return chunked
    if not mmq.mmq_fits(dt, batch_n(node), device):
        return "the tile's stages do not fit in shared memory"
    return True


def _wgmma_ok(k: int, device: Device | None) -> bool | str:
    """True if the wgmma GEMMs can run K=k products on `device`: compute capability 9.0 exactly (sm_90a code), K
    whole K tiles."""
    facts = device_facts(device)
    if device is not None and device.kind == "cuda" and facts.cc != (9, 0):
        return f"wgmma needs compute capability 9.0 (sm_90a code), not {facts.cc[0]}.{facts.cc[1]}"
    if k % mmq_wgmma.BK:
        return f"K={k} is not a multiple of {mmq_wgmma.BK} (mmq_wgmma's K tile)"
    return True


def wgmma_takes(dt: str, m: int, k: int) -> bool | str:
    """True if mmq_wgmma is selected for m x k weights of format dt (MMQ_WGMMA_TYPES, MMQ_WGMMA_MIN_VALUES), else
    why not."""
    if dt not in MMQ_WGMMA_TYPES:
        return f"not selected for {dt} (support.MMQ_WGMMA_TYPES: not faster than dequant_cublas)"
    least = MMQ_WGMMA_MIN_VALUES.get(dt, 0)
    if m * k < least:
        return (f"not selected for {dt} weights of {m} x {k} values (support.MMQ_WGMMA_MIN_VALUES: from {least}; "
                "dequant_cublas is faster below)")
    return True


def mmq_wgmma_ok(node: Tensor, device: Device | None = None) -> bool | str:
    """True if mmq_wgmma runs mul_mat `node` (block-format a, N > 8, declined by mmq: checked by the caller), else
    why dequant_cublas runs it: wgmma (compute capability 9.0 exactly: sm_90a code), K whole K tiles, mmq's row
    conditions (its raw weight stages), the batch within the grid, the shared memory within the device's."""
    a, b = node.srcs
    k = a.shape[-1]
    if a.dtype.name not in mmq_wgmma.WGMMA_FORMATS:
        return f"{a.dtype.name} has no dequantizing wgmma GEMM"
    selected = wgmma_takes(a.dtype.name, a.shape[-2], k)
    if selected is not True:
        return selected
    facts = device_facts(device)
    wgmma = _wgmma_ok(k, device)
    if wgmma is not True:
        return wgmma
    g = stream_geo(a.dtype.name)
    chunked = _whole_chunks(a, g.row_values, g.chunk, device, "wgmma")
    if chunked is not True:
        return chunked
    b3, b2 = pad4(b.shape)[:2]
    if max(b2, b3) > GRID_YZ_MAX:
        return f"batch dims {b3} x {b2} exceed the grid's {GRID_YZ_MAX}"
    smem = mmq_wgmma.wgmma_smem(a.dtype.name, mmq_wgmma.node_tile(node, device))
    if smem > facts.smem_per_block_optin:
        return f"its {smem} bytes of shared memory exceed the device's {facts.smem_per_block_optin}"
    return True


def mmq_id_ok(node: Tensor, device: Device | None = None) -> bool | str:
    """True if mmq_id runs mul_mat_id `node` (several tokens, checked by the caller), else why mmv_id_grouped
    runs it: a format of mmq's, more than MMQ_ID_PAIRS_PER_EXPERT pairs an expert, mmq's row conditions."""
    a = _a(node)
    dt = a.dtype.name
    if dt not in mmq.MMQ_FORMATS:
        return f"{dt} has no quantized GEMM"
    pairs, experts = node.shape[0] * node.shape[1], a.shape[0]
    if pairs <= MMQ_ID_PAIRS_PER_EXPERT * experts:
        return (f"{pairs} (token, slot) pairs for {experts} experts: at most {MMQ_ID_PAIRS_PER_EXPERT} an expert "
                "do not fill the GEMM's column tiles")
    g = stream_geo(dt)
    chunked = _whole_chunks(a, g.row_values, g.chunk, device, "int8 mma.sync m16n8k32")
    if chunked is not True:
        return chunked
    if not mmq_id.mmq_id_fits(dt, pairs, experts, device):
        return "the tile's stages do not fit in shared memory"
    return True


def mmq_wgmma_id_ok(node: Tensor, device: Device | None = None) -> bool | str:
    """True if mmq_wgmma_id runs mul_mat_id `node` (taken by mmq_id: checked by the caller), else why mmq_id runs it:
    a format of MMQ_WGMMA_ID_TYPES, the wgmma conditions, more than MMQ_WGMMA_ID_MIN_MEAN pairs an expert on
    average, the shared memory within the device's."""
    a = _a(node)
    dt = a.dtype.name
    if dt not in MMQ_WGMMA_ID_TYPES:
        return f"not selected for {dt} (support.MMQ_WGMMA_ID_TYPES)"
    wgmma = _wgmma_ok(a.shape[-1], device)
    if wgmma is not True:
        return wgmma
    mean = math.ceil(node.shape[0] * node.shape[1] / a.shape[0])
    if mean <= MMQ_WGMMA_ID_MIN_MEAN:
        return (f"{mean} pairs an expert on average (at most {MMQ_WGMMA_ID_MIN_MEAN}): mmq_id's narrower column tiles "
                "waste less")
    smem = mmq_wgmma.wgmma_id_smem(dt)
    if smem > device_facts(device).smem_per_block_optin:
        return f"its {smem} bytes of shared memory exceed the device's {device_facts(device).smem_per_block_optin}"
    return True


def mmq_small_ok(node: Tensor, device: Device | None = None) -> bool | str:
    """True if mmq_small runs mul_mat `node` (block-format a, 8 < N, checked by the caller), else why mmq
    runs it: MMQ_SMALL_MIN_N to MMQ_SMALL_MAX_N columns, mmq's row conditions, b's slice and the rings in shared
    memory."""
    n = batch_n(node)
    if n > MMQ_SMALL_MAX_N:
        return f"N={n} > {MMQ_SMALL_MAX_N}"
    if n < MMQ_SMALL_MIN_N:
        return f"N={n} < {MMQ_SMALL_MIN_N}: mmq is faster there"
    ok = mmq_ok(node, device)
    if ok is not True:
        return ok
    if not mmq_small.small_fits(node, device):
        return "b's slice and the warps' rings do not fit in shared memory"
    return True


def mmf_ok(node: Tensor, device: Device | None = None) -> bool | str:
    """True if mmf runs mul_mat `node` (MMF_MIN_N..MMF_MAX_N columns, checked by the caller) on `device`
    (None: an sm_90 GPU such as the H200), else why not."""
    a, b = node.srcs
    if a.dtype.name not in MMF_TYPES:
        return f"mmf takes f16/bf16 weights, not {a.dtype.name}"
    if b.dtype.name != "f32":
        return f"mmf takes an f32 b, not {b.dtype.name}"
    if a.shape[-1] % 8:
        return f"K={a.shape[-1]} is not a multiple of 8 (mmf reads rows in 16-byte pieces)"
    if not _aligned16(a):
        return "a's offset or row/batch strides are not multiples of 16 bytes"
    return mmf.smem_fits(node, device)


def choose(node: Tensor, device: Device | None = None) -> Choice:
    """The path that runs `node` on `device` (None: an sm_90 GPU such as the H200), or why none does."""
    rules = RULES.get(node.op)
    if rules is None:
        return Choice(reason=f"not a matrix product ({node.op})")
    verdict = first_failure(node, rules)
    if verdict is not True:
        return Choice(reason=verdict)
    quant = node.srcs[0].dtype.is_quant
    if node.op == "mul_mat":
        small = batch_n(node) <= MMV_MAX_N
        if quant and small:
            return Choice("mmvq_stream" if stream_ok(node, device) is True else "mmvq")
        if quant and not small:
            if mmq_small_ok(node, device) is True:
                return Choice("mmq_small")
            ok, wg = mmq_ok(node, device), mmq_wgmma_ok(node, device)
            if ok is True and (wg is not True or batch_n(node) < MMQ_WGMMA_MIN_N):
                return Choice("mmq")
            if wg is True:
                why = ok if ok is not True else f"mmq_wgmma is faster from N={MMQ_WGMMA_MIN_N}"
                return Choice("mmq_wgmma", note=f"mmq: {why}")
            return Choice("dequant_cublas", note=f"mmq: {ok}; mmq_wgmma: {wg}")
        if not quant and MMF_MIN_N <= batch_n(node) <= MMF_MAX_N and mmf_ok(node, device) is True:
            return Choice("mmf")
        return Choice("mmvf" if small else "cublas")
    if node.op == "mul_mat_id":
        if node.shape[0] == 1:
            return Choice("mmv_id")
        ok = mmq_id_ok(node, device) if quant else "float experts take the mat-vecs"
        if ok is not True:
            return Choice("mmv_id_grouped", note=f"mmq_id: {ok}")
        wg = mmq_wgmma_id_ok(node, device)
        return Choice("mmq_wgmma_id") if wg is True else Choice("mmq_id", note=f"mmq_wgmma_id: {wg}")
    return Choice("cublas_out_prod")


def gate(node: Tensor) -> bool | str | None:
    """The plugin-wide answer: None (go on to the kernels) or the reason to decline."""
    if node.op not in MATMUL_OPS:
        return None
    c = choose(node)
    return c.reason or None


def takes(path: str) -> Callable[[object, Tensor], bool | str]:
    """A Kernel's supports: True for the nodes whose path is `path`."""

    def supports(device: Device, node: Tensor) -> bool | str:
        c = choose(node, device)
        if c.reason:
            return c.reason
        if c.path == path:
            return True
        return f"{c.path} takes it ({c.note})" if c.note else f"{c.path} takes it"

    supports.__name__ = f"takes_{path}"
    return supports
