"""Which matrix-product path runs a node, as tables of (condition, reason) read top to bottom.

`choose(node)` gives a `Choice`: the path's name (a Kernel's `name`, shown by
`Plan.explain()`) or the reason the plugin declines the node. The plugin-wide
`supports_op` gate returns that reason, so it is said once; each Kernel's
`supports` accepts exactly the nodes whose path is its own, so the paths are
mutually exclusive. Conditions only read shapes, strides, dtypes and view
offsets: plans are made and tested on a device description.

Paths:
  mul_mat      mmvf            float weights (f32/f16/bf16), N <= 8: mat-vec kernel
               mmvq_stream     block-quantized weights, N <= 8, rows of whole 16-byte chunks
                               (stream_reason): one launch, b quantized to q8_1 in shared
                               memory, weights streamed through shared memory by cp.async
               mmvq            the other block-quantized mat-vecs (N <= 8): quantize_q8_1, then
                               the mat-vec reading blocks straight from global memory
               cublas          float weights, N > 8: cuBLAS GEMM (batched when needed)
               dequant_cublas  block-quantized weights, N > 8: dequantize to f16, then cuBLAS
  mul_mat_id   mmv_id          one token (T == 1): a mat-vec block per (token, slot), expert read on the device
               mmv_id_grouped  T > 1: a routing kernel groups the pairs by expert, then a mat-vec per expert
  out_prod     cublas_out_prod cuBLAS GEMM (non-f32 weights converted to f32 first)
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs

from opdispatch.hookspecs import Device
from opdispatch.ops.base import pad4
from opdispatch.tensor import Tensor

Rule = tuple[Callable[[Tensor], bool], str]

INT_MAX = 2**31 - 1
GRID_YZ_MAX = 65535
#: most columns (batch N) the mat-vec kernels take; larger batches go to cuBLAS
MMV_MAX_N = 8
#: most experts the routing kernel of mmv_id_grouped takes (shared memory: 2 ints an expert)
ROUTE_MAX_EXPERTS = 4096

MATMUL_OPS = ("mul_mat", "mul_mat_id", "out_prod")


@attrs.frozen
class Choice:
    path: str = ""
    reason: str = ""


def first_failure(node: Tensor, rules: Sequence[Rule]) -> str:
    """'' if every condition holds for `node`, else the reason of the first that does not."""
    for holds, reason in rules:
        if not holds(node):
            return reason
    return ""


def elem_strides(t: Tensor) -> bool:
    """Strides and offset the kernels can use: whole elements for float types, even
    byte counts for block formats (their fields are read with 16-bit loads)."""
    unit = 2 if t.dtype.is_quant else t.dtype.block_bytes
    return all(s % unit == 0 for s in t.strides) and t.view_offset % unit == 0


def rows_apart(t: Tensor) -> bool:
    """Rows (the second-last axis) do not overlap: the row stride covers a whole row."""
    if t.ndim < 2 or t.shape[-2] <= 1:
        return True
    return t.strides[-2] >= t.dtype.row_bytes(t.shape[-1])


def fits(*sizes: int) -> bool:
    return all(0 <= n <= INT_MAX for n in sizes)


def _a(n: Tensor) -> Tensor:
    return n.srcs[0]


def _b(n: Tensor) -> Tensor:
    return n.srcs[1]


def out_rules() -> tuple[Rule, ...]:
    return (
        (lambda n: n.dtype.name == "f32" and n.is_contiguous(), "the result must be contiguous f32"),
    )


#: mul_mat: a (A3, A2, M, K) any type, b (B3, B2, N, K) float, out (B3, B2, N, M) f32.
MUL_MAT: tuple[Rule, ...] = (
    *out_rules(),
    (lambda n: _a(n).rows_contiguous(), "a's rows (the K axis) must be contiguous"),
    (lambda n: elem_strides(_a(n)), "a's strides and offset must be whole elements"),
    (lambda n: elem_strides(_b(n)), "b's strides and offset must be whole elements"),
    (lambda n: rows_apart(_a(n)), "a's rows overlap"),
    (lambda n: _a(n).shape[-1] > 0, "an empty product (K = 0)"),
    (lambda n: fits(n.size, _a(n).shape[-1], _a(n).shape[-2], _b(n).shape[-2]), "sizes must be below 2**31"),
    (lambda n: max(pad4(n.shape)[:2]) <= GRID_YZ_MAX, "batch dims must be at most 65535"),
)

#: mul_mat_id: as (E, M, K), b (T, Ub, K) f32, ids (T, U) i32, out (T, U, M).
MUL_MAT_ID: tuple[Rule, ...] = (
    *out_rules(),
    (lambda n: _a(n).rows_contiguous(), "the experts' rows (the K axis) must be contiguous"),
    (lambda n: elem_strides(_a(n)), "the experts' strides and offset must be whole elements"),
    (lambda n: elem_strides(_b(n)) and elem_strides(n.srcs[2]), "b's and ids' strides must be whole elements"),
    (lambda n: _a(n).shape[-1] > 0, "an empty product (K = 0)"),
    (lambda n: fits(n.size, _a(n).shape[-1]), "sizes must be below 2**31"),
    (lambda n: n.shape[0] == 1 or _a(n).shape[0] <= ROUTE_MAX_EXPERTS,
     f"more than {ROUTE_MAX_EXPERTS} experts with several tokens"),
    (lambda n: n.shape[0] > 1 or n.shape[1] <= GRID_YZ_MAX, "more than 65535 experts used per token"),
)

#: out_prod: a (A3, A2, K, M) any type, b (B3, B2, K, N) f32, out (B3, B2, N, M).
OUT_PROD: tuple[Rule, ...] = (
    *out_rules(),
    (lambda n: _a(n).rows_contiguous(), "a's rows (the M axis) must be contiguous"),
    (lambda n: elem_strides(_a(n)) and elem_strides(_b(n)), "strides and offsets must be whole elements"),
    (lambda n: rows_apart(_a(n)), "a's rows overlap"),
    (lambda n: _a(n).shape[-2] > 0, "an empty product (K = 0)"),
    (lambda n: fits(n.size, _a(n).size, _b(n).size), "sizes must be below 2**31"),
)

RULES = {"mul_mat": MUL_MAT, "mul_mat_id": MUL_MAT_ID, "out_prod": OUT_PROD}


def batch_n(node: Tensor) -> int:
    """Columns a mul_mat multiplies each weight matrix by (ggml's ne[1])."""
    return node.shape[-2]


# -- mmvq_stream: kernels/mmvq_stream.cu's geometry, mirrored -----------------------------------------

#: (block bytes, blocks a chunk) of each format mmvq_stream takes: a chunk is the fewest
#: consecutive blocks whose bytes are a multiple of 16 (mmvq_stream.cu's Geo)
STREAM_FORMATS = {"q4_0": (18, 8), "q4_1": (20, 4), "q5_0": (22, 8), "q5_1": (24, 2), "q8_0": (34, 8)}
#: shared memory of an SM (sm_80: 164 KiB, sm_90: 228 KiB) when the device description lacks it,
#: and what the driver reserves per block
SMEM_PER_SM_DEFAULT = 228 * 1024
SMEM_PER_BLOCK_RESERVED = 1024


@attrs.frozen
class StreamConfig:
    """mmvq_stream's tunables: cp.async stages a warp (the kernel's NS, 2..4), warps a block
    (1..8; halved at bind time until the shared memory fits), blocks an SM the grid aims at.

    The default, 2 stages of 8 warps, was the fastest or within 4% of it (q8_0 14336x4096: 90%
    of the copy bandwidth against 94%) in an H200 sweep of every q8_0/q4_0 shape of the 1b preset
    and the benchmark's (scratch/mmvq_stream_sweep.py --preload, cold weights in a CUDA graph):
    for example q4_0 14336x4096 76% against 62% for 3 stages of 4 warps, the fused gate/up 83%
    against 54%. More warps an SM hide more of each warp's dot-product latency."""

    stages: int = 2
    warps: int = 8
    blocks_per_sm: int = 2


#: the configuration binds use (scratch/mmvq_stream_sweep.py passes others explicitly)
STREAM = StreamConfig()


@attrs.frozen
class StreamLayout:
    """How mmvq_stream splits a row of K values (mmvq_stream.cu's Layout): C chunks a row, G lanes
    a row, R rows (slots) a warp stage, S segments a row, RO output rows and UG stages a group."""

    C: int
    G: int
    R: int
    S: int
    RO: int
    UG: int


def stream_chunk(dt: str) -> tuple[int, int, int]:
    """(blocks a chunk, weight bytes a chunk, b bytes a chunk in shared memory) of format `dt`:
    the b chunk holds CB * 32 int8 codes and CB (d, d * sum) float2, padded to an odd number of
    16-byte granules."""
    nbytes, cb = STREAM_FORMATS[dt]
    braw = cb * 40
    return cb, cb * nbytes, braw if (braw // 16) % 2 == 1 else braw + 16


def stream_layout(dt: str, k: int, glu: bool) -> StreamLayout:
    cb, _, _ = stream_chunk(dt)
    c = k // (32 * cb)
    g = 1
    while g < c and g < 32:
        g *= 2
    r, s = 32 // g, -(-c // g)
    if not glu:
        return StreamLayout(c, g, r, s, r, s)
    if r >= 2:
        return StreamLayout(c, g, r, s, r // 2, 1)
    return StreamLayout(c, g, r, s, 1, 2 * s)


def stream_smem(dt: str, k: int, n: int, warps: int, stages: int) -> int:
    """Dynamic shared memory of an mmvq_stream block: b's n columns, then each warp's ring."""
    cb, chunk, bchunk = stream_chunk(dt)
    return n * (k // (32 * cb)) * bchunk + warps * stages * 32 * chunk


def _props(device: Device | None) -> dict:
    return device.props if device is not None else {}


def stream_warps(dt: str, k: int, n: int, device: Device | None, cfg: StreamConfig | None = None) -> int:
    """The warps a block of mmvq_stream gets: cfg.warps, halved until the block's shared memory
    fits the device's opt-in limit; 0 when not even one warp fits."""
    cfg = cfg or STREAM
    limit = _props(device).get("smem_per_block_optin", 227 * 1024)
    w = cfg.warps
    while w >= 1 and stream_smem(dt, k, n, w, cfg.stages) > limit:
        w //= 2
    return max(w, 0)


def _aligned16(t: Tensor) -> bool:
    """View offset and every stride of an axis longer than 1 (but the contiguous last) multiples of 16."""
    return t.view_offset % 16 == 0 and all(s % 16 == 0 for s, n in zip(t.strides[:-1], t.shape[:-1]) if n > 1)


def stream_reason(node: Tensor, device: Device | None = None) -> str:
    """'' if mmvq_stream runs mul_mat `node` (block-format a, N <= 8, checked by the caller) or
    mul_mat_id `node` (one b column a (token, slot)), else why the two-launch mmvq / mmvq_id runs it."""
    a = _a(node)
    n = 1 if node.op == "mul_mat_id" else batch_n(node)
    dt, k = a.dtype.name, a.shape[-1]
    if dt not in STREAM_FORMATS:
        return f"{dt} has no streamed mat-vec"
    cb, chunk, _ = stream_chunk(dt)
    if k % (32 * cb):
        return f"K={k} is not a multiple of {32 * cb} (rows of whole {chunk}-byte chunks)"
    if not _aligned16(a):
        return "a's offset or row/batch strides are not multiples of 16 bytes"
    if device is not None and device.kind == "cuda" and tuple(device.props.get("cc", (9, 0))) < (8, 0):
        return "cp.async needs sm_80"
    if not stream_warps(dt, k, n, device):
        return f"b's q8_1 copy of {n}x{k} values does not fit in shared memory"
    return ""


def stream_grid(layout: StreamLayout, m: int, batches: int, warps: int, blocks_per_sm: int, sm_count: int) -> int:
    """Blocks of mmvq_stream along x (one batch): about blocks_per_sm a SM over all batches, then as
    few as give each warp the same most groups (the kernel splits a batch's groups evenly over its
    gridDim.x * warps warps, so no warp takes more than the others' count plus one, and the
    largest count is what the grid aimed at)."""
    groups = -(-m // layout.RO)
    target = max(1, blocks_per_sm * sm_count // max(batches, 1))
    per_warp = -(-groups // (target * warps))
    busy_warps = -(-groups // per_warp)
    return -(-busy_warps // warps)


def stream_blocks_per_sm(smem: int, device: Device | None, cfg: StreamConfig) -> int:
    """cfg.blocks_per_sm, fewer when an SM's shared memory holds fewer blocks (at least 1)."""
    per_sm = _props(device).get("smem_per_sm", SMEM_PER_SM_DEFAULT)
    return max(1, min(cfg.blocks_per_sm, per_sm // (smem + SMEM_PER_BLOCK_RESERVED)))


def choose(node: Tensor, device: Device | None = None) -> Choice:
    """The path that runs `node` on `device` (None: an sm_90 GPU such as the H200), or why none does."""
    rules = RULES.get(node.op)
    if rules is None:
        return Choice(reason=f"not a matrix product ({node.op})")
    reason = first_failure(node, rules)
    if reason:
        return Choice(reason=reason)
    quant = node.srcs[0].dtype.is_quant
    if node.op == "mul_mat":
        small = batch_n(node) <= MMV_MAX_N
        if quant and small:
            return Choice("mmvq" if stream_reason(node, device) else "mmvq_stream")
        return Choice(("mmvq" if small else "dequant_cublas") if quant else ("mmvf" if small else "cublas"))
    if node.op == "mul_mat_id":
        return Choice("mmv_id" if node.shape[0] == 1 else "mmv_id_grouped")
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
        return True if c.path == path else f"{c.path} takes it"

    supports.__name__ = f"takes_{path}"
    return supports
