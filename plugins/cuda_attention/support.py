"""What the attention kernels accept, as tables of (condition, reason) read top to bottom.

Each predicate returns True or the reason of the first condition that fails,
after ggml's `supports_op`. Conditions only look at shapes, strides, dtypes and
the device description, so plans can be made and tested without a GPU.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from opdispatch.hookspecs import Device
from opdispatch.ops.base import pad4
from opdispatch.tensor import Tensor

Rule = tuple[Callable[[Tensor], bool], str]

INT_MAX = 2**31 - 1
UINT_MAX = 2**32 - 1
GRID_YZ = 65535

#: head sizes flash_attn_ext has kernels for (K and V the same)
HEAD_SIZES = (64, 80, 96, 128, 256)
#: K/V types (K and V of one type), dequantized to f16 (bf16 for bf16) in the kernels
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
#: query rows up to which flash_attn_ext runs the split-K decode kernel (else the tensor-core prefill)
DECODE_MAX_TQ = 8


def prefill_tile_m(d: int) -> int:
    """Query rows a prefill block takes: 32 a warp (two m16 tiles) where registers allow."""
    return 64 if d > 128 else 128


def prefill_tile_n(d: int) -> int:
    """Keys a prefill K/V tile holds."""
    return 32 if d > 128 else 64


def prefill_smem(d: int) -> int:
    """Dynamic shared memory of fattn_prefill<d, ...>: Q and two K/V stages, 16-bit values, rows padded by 8."""
    return 2 * (d + 8) * (prefill_tile_m(d) + 2 * 2 * prefill_tile_n(d))


#: decode: keys a K/V tile (16 a warp)
DECODE_BN = 64


#: decode: columns (query row, head) a block, the M rows of its mma
DECODE_COLS = 16
#: shared memory of one SM (H100/H200: 228 KiB, 227 KiB of it for one block)
SMEM_PER_SM = 228 * 1024
#: fattn_decode fused with the q/k/v rope and cache writes: blocks an SM its registers allow (nvcc sm_90,
#: 128 threads: 134 registers at D=64, 182 at D=128; unfused, shared memory bounds it first)
FUSED_DECODE_BLOCKS_PER_SM = {64: 3, 128: 2}


def decode_smem(d: int, fused: bool = False) -> int:
    """Dynamic shared memory of fattn_decode<d, ...>: its K/V stages (3, or 2 for d > 128), rows padded by 8;
    fused with the q/k/v rope and cache writes, also q of 16 columns (f32) and the new K and V rows."""
    stages = 2 if d > 128 else 3
    return stages * 2 * DECODE_BN * (d + 8) * 2 + (16 * d * 4 + 2 * d * 2 if fused else 0)


def decode_blocks_per_sm(d: int, fused: bool = False) -> int:
    """fattn_decode blocks one SM holds: shared memory bound (1 KiB reserved a block), 2 by launch bounds at least;
    fused, also bound by its registers."""
    smem_bound = max(1, min(4, SMEM_PER_SM // (decode_smem(d, fused) + 1024)))
    return min(smem_bound, FUSED_DECODE_BLOCKS_PER_SM[d]) if fused else smem_bound


def decode_splits(node: Tensor, sm_count: int, fused: bool = False) -> tuple[int, int]:
    """(splits of the KV, keys a split) of flash_attn_ext's decode kernel: one wave, as many splits as fill
    the SMs' resident blocks (memory bound: every SM streaming; at short KV down to a tile a block, the last
    block of each group merges), no ragged second wave."""
    q, k = node.srcs[:2]
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    base = b * hkv * -(-(hq // hkv * tq) // DECODE_COLS)
    tiles = max(1, -(-tk // DECODE_BN))
    nsplit = max(1, min(sm_count * decode_blocks_per_sm(d, fused) // base, tiles))
    chunk = -(-tiles // nsplit) * DECODE_BN
    return max(1, -(-tk // chunk)), chunk


def kv_variants() -> list[tuple[int, str]]:
    """(head size, K/V dtype) pairs with kernels: block formats need whole 32-value blocks."""
    return [(d, kv) for d in HEAD_SIZES for kv in KV_TYPES if d % 32 == 0 or kv in ("f32", "f16", "bf16")]


def first_failure(t: Tensor, rules: Sequence[Rule]) -> bool | str:
    """True if every condition holds for `t`, else the reason of the first that does not."""
    for holds, reason in rules:
        if not holds(t):
            return reason
    return True


def whole_elements(t: Tensor | None) -> bool:
    """Strides (and the view offset) the kernels can take in elements (bytes of one block for block formats)."""
    if t is None:
        return True
    unit = t.dtype.block_bytes if not t.dtype.is_quant else 2
    return all(s % unit == 0 for s in t.strides) and t.view_offset % unit == 0


def rows_packed(t: Tensor | None) -> bool:
    return t is None or t.rows_contiguous()


def contiguous_vector(t: Tensor | None) -> bool:
    return t is None or (t.ndim == 1 and (t.shape[0] <= 1 or t.strides[0] == t.dtype.block_bytes))


def _src(i: int) -> Callable[[Tensor], Tensor | None]:
    return lambda n: n.srcs[i]


# -- soft_max ---------------------------------------------------------------------------------

SOFT_MAX: tuple[Rule, ...] = (
    (lambda n: n.srcs[0].dtype.name == "f32", "a must be f32"),
    (lambda n: 1 <= n.srcs[0].ndim <= 4, "a must have 1 to 4 dimensions"),
    (lambda n: rows_packed(n.srcs[0]) and rows_packed(n.srcs[1]), "rows must be contiguous"),
    (lambda n: whole_elements(n.srcs[0]) and whole_elements(n.srcs[1]), "strides must be whole elements"),
    (lambda n: n.srcs[1] is None or n.srcs[1].dtype.name in ("f16", "f32"), "the mask must be f16 or f32"),
    (lambda n: contiguous_vector(n.srcs[2]), "sinks must be a contiguous vector"),
    (lambda n: n.dtype.name == "f32" and n.is_contiguous(), "the result must be contiguous f32"),
    (lambda n: n.shape[-1] <= INT_MAX and math.prod(n.shape[:-1]) <= INT_MAX, "at most 2**31 - 1 rows and columns"),
)


def soft_max(device: Device, node: Tensor) -> bool | str:
    return first_failure(node, SOFT_MAX)


# -- rope ---------------------------------------------------------------------------------------

ROPE: tuple[Rule, ...] = (
    (lambda n: n.srcs[0].dtype.name in ("f32", "f16"), "x must be f32 or f16"),
    (lambda n: n.dtype == n.srcs[0].dtype and n.is_contiguous(), "the result must be contiguous, x's dtype"),
    (lambda n: 1 <= n.srcs[0].ndim <= 4, "x must have 1 to 4 dimensions"),
    (lambda n: rows_packed(n.srcs[0]), "rows of x must be contiguous"),
    (lambda n: whole_elements(n.srcs[0]), "strides must be whole elements"),
    (lambda n: n.shape[-1] % 2 == 0, "the head size must be even"),
    (lambda n: n.srcs[1].dtype.name == "i32" and contiguous_vector(n.srcs[1]), "positions must be a contiguous i32 vector"),
    (lambda n: n.srcs[2] is None or (n.srcs[2].dtype.name == "f32" and contiguous_vector(n.srcs[2])),
     "freq_factors must be a contiguous f32 vector"),
    (lambda n: n.params["mode"] in ("normal", "neox"), "only modes normal and neox"),
    (lambda n: n.size // 2 <= UINT_MAX // 2 - 256, "fewer than 2**31 pairs"),
)


def rope(device: Device, node: Tensor) -> bool | str:
    return first_failure(node, ROPE)


# -- flash_attn_ext ---------------------------------------------------------------------------


def _kv_head_size(n: Tensor) -> bool:
    return n.srcs[1].shape[-1] in HEAD_SIZES


def _decode(n: Tensor) -> bool:
    return n.srcs[0].shape[2] <= DECODE_MAX_TQ


FLASH_ATTN_EXT: tuple[Rule, ...] = (
    (lambda n: n.srcs[1].shape[-1] == n.srcs[2].shape[-1],
     "K and V head sizes differ (kernels for equal sizes only)"),
    (_kv_head_size, f"head size not in {', '.join(map(str, HEAD_SIZES))}"),
    (lambda n: n.srcs[1].dtype == n.srcs[2].dtype, "K and V must have the same dtype"),
    (lambda n: n.srcs[1].dtype.name in KV_TYPES, f"K/V dtype must be one of {', '.join(KV_TYPES)}"),
    (lambda n: n.srcs[0].dtype.name in ("f32", "f16"), "q must be f32 or f16"),
    (lambda n: all(rows_packed(t) for t in n.srcs[:4]), "rows must be contiguous"),
    (lambda n: all(whole_elements(t) for t in n.srcs[:4]), "strides must be whole elements"),
    (lambda n: n.srcs[3] is None or n.srcs[3].dtype.name == "f16", "the mask must be f16"),
    (lambda n: contiguous_vector(n.srcs[4]), "sinks must be a contiguous vector"),
    (lambda n: n.dtype.name == "f32" and n.is_contiguous(), "the result must be contiguous f32"),
    (lambda n: n.srcs[0].shape[1] <= GRID_YZ and n.srcs[0].shape[0] <= GRID_YZ, "at most 65535 heads and batches"),
    (lambda n: math.prod(pad4(n.srcs[3].shape)[:2]) <= GRID_YZ if n.srcs[3] is not None else True,
     "at most 65535 mask slices"),
    (lambda n: n.srcs[1].shape[2] <= INT_MAX // 2 and n.srcs[0].shape[2] <= INT_MAX // 2, "too many tokens"),
)


def flash_attn_ext(device: Device, node: Tensor) -> bool | str:
    ok = first_failure(node, FLASH_ATTN_EXT)
    if ok is not True:
        return ok
    if tuple(device.props.get("cc", (0, 0))) < (8, 0):
        return "the flash_attn_ext kernels need compute capability 8.0 (mma.sync m16n8k16, cp.async)"
    d = node.srcs[1].shape[-1]
    need = decode_smem(d) if _decode(node) else prefill_smem(d)
    have = device.props.get("smem_per_block_optin", device.props.get("smem_per_block", 48 * 1024))
    if need > have:
        return f"the kernel for head size {d} needs {need} bytes of shared memory a block, {device.name} has {have}"
    return True
