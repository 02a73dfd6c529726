"""What the attention kernels accept, as tables of (condition, reason) read top to bottom
(`opdispatch.support`), and the device checks flash_attn_ext adds: compute capability and shared memory."""

from __future__ import annotations

import math

from opdispatch.backends.cuda.devices import facts
from opdispatch.hookspecs import Device
from opdispatch.ops.base import pad4
from opdispatch.support import (GRID_YZ_MAX, INT_MAX, UINT_MAX, Rule, contiguous_vector, first_failure, fits_int,
                                outer_rows, rows_packed, whole_elements)
from opdispatch.tensor import Tensor

from .specs.flash import DECODE_MAX_TQ, HEAD_SIZES, KV_TYPES, decode_smem, prefill_smem, prefill_wgmma

SOFT_MAX: tuple[Rule, ...] = (
    (lambda n: n.srcs[0].dtype.name == "f32", "a must be f32"),
    (lambda n: 1 <= n.srcs[0].ndim <= 4, "a must have 1 to 4 dimensions"),
    (lambda n: rows_packed(n.srcs[0]) and rows_packed(n.srcs[1]), "rows must be contiguous"),
    (lambda n: whole_elements(n.srcs[0]) and whole_elements(n.srcs[1]), "strides must be whole elements"),
    (lambda n: n.srcs[1] is None or n.srcs[1].dtype.name in ("f16", "f32"), "the mask must be f16 or f32"),
    (lambda n: contiguous_vector(n.srcs[2]), "sinks must be a contiguous vector"),
    (lambda n: n.dtype.name == "f32" and n.is_contiguous(), "the result must be contiguous f32"),
    (lambda n: fits_int(n.shape[-1], outer_rows(n)), "at most 2**31 - 1 rows and columns"),
)


def soft_max(device: Device, node: Tensor) -> bool | str:
    return first_failure(node, SOFT_MAX)


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


FLASH_ATTN_EXT: tuple[Rule, ...] = (
    (lambda n: n.srcs[1].shape[-1] == n.srcs[2].shape[-1],
     "K and V head sizes differ (kernels for equal sizes only)"),
    (lambda n: n.srcs[1].shape[-1] in HEAD_SIZES, f"head size not in {', '.join(map(str, HEAD_SIZES))}"),
    (lambda n: n.srcs[1].dtype == n.srcs[2].dtype, "K and V must have the same dtype"),
    (lambda n: n.srcs[1].dtype.name in KV_TYPES, f"K/V dtype must be one of {', '.join(KV_TYPES)}"),
    (lambda n: n.srcs[0].dtype.name in ("f32", "f16"), "q must be f32 or f16"),
    (lambda n: all(rows_packed(t) for t in n.srcs[:4]), "rows must be contiguous"),
    (lambda n: all(whole_elements(t) for t in n.srcs[:4]), "strides must be whole elements"),
    (lambda n: n.srcs[3] is None or n.srcs[3].dtype.name == "f16", "the mask must be f16"),
    (lambda n: contiguous_vector(n.srcs[4]), "sinks must be a contiguous vector"),
    (lambda n: n.dtype.name == "f32" and n.is_contiguous(), "the result must be contiguous f32"),
    (lambda n: n.srcs[0].shape[1] <= GRID_YZ_MAX and n.srcs[0].shape[0] <= GRID_YZ_MAX,
     "at most 65535 heads and batches"),
    (lambda n: math.prod(pad4(n.srcs[3].shape)[:2]) <= GRID_YZ_MAX if n.srcs[3] is not None else True,
     "at most 65535 mask slices"),
    (lambda n: n.srcs[1].shape[2] <= INT_MAX // 2 and n.srcs[0].shape[2] <= INT_MAX // 2, "too many tokens"),
)


def flash_attn_ext(device: Device, node: Tensor) -> bool | str:
    ok = first_failure(node, FLASH_ATTN_EXT)
    if ok is not True:
        return ok
    dev = facts(device)
    if dev.cc < (8, 0):
        return "the flash_attn_ext kernels need compute capability 8.0 (mma.sync m16n8k16, cp.async)"
    d = node.srcs[1].shape[-1]
    kv = node.srcs[1].dtype.name
    need = decode_smem(d) if node.srcs[0].shape[2] <= DECODE_MAX_TQ else prefill_smem(d, prefill_wgmma(d, kv, dev))
    if need > dev.smem_per_block_optin:
        return (f"the kernel for head size {d} needs {need} bytes of shared memory a block, {device.name} has "
                f"{dev.smem_per_block_optin}")
    return True
