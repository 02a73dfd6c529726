"""soft_max's launch (kernels/softmax.cu): the variant by row length and alignment, and its arguments."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np

from opdispatch.backends.cuda.args import KernelArgs, f32, i32, i64, instance, ptr
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.tensor import Tensor

from .common import CTYPE, KERNELS_DIR, Ptr, alibi_fields, aligned, elem_strides

SOFTMAX_CU = KERNELS_DIR / "softmax.cu"

#: threads a block, one block a row: the smallest that holds the row in registers
SOFTMAX_BLOCKS = (32, 64, 128, 256, 512, 1024)
#: loads a thread keeps in registers (0: the row is read twice)
SOFTMAX_CACHE = 8


def softmax_kernel(block: int, cache: int, vec: bool, mask: str) -> str:
    return instance("soft_max_f32", block, cache, vec, CTYPE[mask])


KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {
    SOFTMAX_CU: tuple(
        [softmax_kernel(b, SOFTMAX_CACHE, v, m) for b in SOFTMAX_BLOCKS for v in (False, True) for m in ("f32", "f16")]
        + [softmax_kernel(1024, 0, v, m) for v in (False, True) for m in ("f32", "f16")]),
}


@attrs.frozen
class SoftMaxArgs(KernelArgs):
    """Strides in elements: as1 rows, as2 a's axis 1 (heads), as3 axis 0; the mask's likewise."""

    KERNELS = ("soft_max_f32",)
    a: np.uint64 = ptr()
    mask: np.uint64 = ptr()
    sinks: np.uint64 = ptr()
    out: np.uint64 = ptr()
    ncols: np.int32 = i32()
    nrows: np.int32 = i32()
    nheads: np.int32 = i32()
    as1: np.int64 = i64()
    as2: np.int64 = i64()
    as3: np.int64 = i64()
    m2: np.int32 = i32()
    m3: np.int32 = i32()
    ms1: np.int64 = i64()
    ms2: np.int64 = i64()
    ms3: np.int64 = i64()
    scale: np.float32 = f32()
    use_alibi: np.int32 = i32()
    m0: np.float32 = f32()
    m1: np.float32 = f32()
    n_head_log2: np.int32 = i32()


def softmax_block(units: int) -> tuple[int, int]:
    """(threads, loads kept per thread) for a row of `units` loads; (1024, 0): two passes."""
    for block in SOFTMAX_BLOCKS:
        if units <= block * SOFTMAX_CACHE:
            return block, SOFTMAX_CACHE
    return 1024, 0


def softmax_specs(node: Tensor, ptr: Ptr) -> list[KernelSpec]:
    """One block a row, float4 loads where a's rows, the output and the mask's rows allow them."""
    a, mask, sinks = node.srcs
    (a3, a2, rows, cols), st = elem_strides(a)
    vec = cols % 4 == 0 and aligned(a, ptr, 16) and ptr(node) % 16 == 0
    if mask is not None:
        (m3, m2, _, _), ms = elem_strides(mask)
        vec = vec and aligned(mask, ptr, 16 if mask.dtype.name == "f32" else 8)
        mt, mptr = mask.dtype.name, ptr(mask)
    else:
        m3 = m2 = 1
        ms = (0, 0, 0, 0)
        mt, mptr = "f32", 0
    block, cache = softmax_block(cols // 4 if vec else cols)
    p = node.params
    args = SoftMaxArgs(a=ptr(a), mask=mptr, sinks=ptr(sinks) if sinks is not None else 0, out=ptr(node),
                       ncols=cols, nrows=rows, nheads=a2, as1=st[2], as2=st[1], as3=st[0],
                       m2=m2, m3=m3, ms1=ms[2], ms2=ms[1], ms3=ms[0], scale=p["scale"],
                       **alibi_fields(a2, p["max_bias"]))
    n = a3 * a2 * rows if cols else 0
    return [KernelSpec(SOFTMAX_CU, softmax_kernel(block, cache, vec, mt), (n,), block, args)]
