"""cuda_norm's kernel instances and pure launch specs (kernels/norm.cu): one block per row or
channel group; `row_spec`/`group_spec` pick the instance, grid, block and named arguments from
shapes, strides and addresses, so tests check them without a GPU."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import attrs
import numpy as np

from opdispatch.backends.cuda.args import KernelArgs, f32, i32, i64, instance, ptr
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.ops.base import pad4
from opdispatch.tensor import Tensor

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
NORM_CU = KERNELS_DIR / "norm.cu"

#: norm.cu's MODE per op and its FUSE values
MODES = {"norm": 0, "rms_norm": 1, "l2_norm": 2}
FUSE_NONE, FUSE_MUL, FUSE_MUL_ADD = 0, 1, 2
#: threads per block the kernels are instantiated for
BLOCKS = (32, 128, 512, 1024)

#: the latency-bound configuration for few rows: float4s a thread keeps (norm.cu's PER), its block sizes,
#: and the most rows it is picked for (up to about two blocks per SM of an H200)
SMALL_PER = 2
SMALL_BLOCKS = (64, 128, 256, 512, 1024)
SMALL_ROWS = 256


def row_kernel(mode: int, block: int, vec: bool, fuse: int, per: int | None = None) -> str:
    return instance("norm_rows_f32", mode, block, vec, fuse, *(() if per is None else (per,)))


def group_kernel(block: int, vec: bool) -> str:
    return instance("group_norm_f32", block, vec)


def _fuses(mode: int) -> tuple[int, ...]:
    return (FUSE_NONE,) if mode == MODES["l2_norm"] else (FUSE_NONE, FUSE_MUL, FUSE_MUL_ADD)


#: every instance the specs below can name, compiled as one module
NAME_EXPRESSIONS: tuple[str, ...] = (
    *(row_kernel(mode, block, vec, fuse)
      for mode in MODES.values() for block in BLOCKS for vec in (False, True) for fuse in _fuses(mode)),
    *(row_kernel(mode, block, True, fuse, SMALL_PER)
      for mode in MODES.values() for block in SMALL_BLOCKS for fuse in _fuses(mode)),
    *(group_kernel(block, vec) for block in BLOCKS for vec in (False, True)),
)

#: each .cu of this plugin and the instances launched from it (tests/test_kernels_compile.py compiles them)
KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {NORM_CU: NAME_EXPRESSIONS}

Ptr = Callable[[Tensor], int]


@attrs.frozen
class NormRowsArgs(KernelArgs):
    """norm_rows_f32: x's rows (outer geometry in elements), then the fused weight `w` and residual `r`,
    each a pointer, 4 dims (broadcast by modulo) and 3 outer strides (null and 1s when absent)."""

    KERNELS = ("norm_rows_f32",)
    x: np.uint64 = ptr()
    dst: np.uint64 = ptr()
    ncols: np.int32 = i32()
    eps: np.float32 = f32()
    n1: np.int32 = i32()
    n2: np.int32 = i32()
    xs0: np.int64 = i64()
    xs1: np.int64 = i64()
    xs2: np.int64 = i64()
    w: np.uint64 = ptr()
    w0: np.int32 = i32()
    w1: np.int32 = i32()
    w2: np.int32 = i32()
    wcols: np.int32 = i32()
    ws0: np.int64 = i64()
    ws1: np.int64 = i64()
    ws2: np.int64 = i64()
    r: np.uint64 = ptr()
    r0: np.int32 = i32()
    r1: np.int32 = i32()
    r2: np.int32 = i32()
    rcols: np.int32 = i32()
    rs0: np.int64 = i64()
    rs1: np.int64 = i64()
    rs2: np.int64 = i64()


@attrs.frozen
class GroupNormArgs(KernelArgs):
    KERNELS = ("group_norm_f32",)
    x: np.uint64 = ptr()
    dst: np.uint64 = ptr()
    channels: np.int32 = i32()
    hw: np.int32 = i32()
    per_group: np.int32 = i32()
    groups: np.int32 = i32()
    xs_n: np.int64 = i64()
    eps: np.float32 = f32()


def pick_block(units: int) -> int:
    """Threads per block for a row of `units` loads (floats or float4s): up to 8 loads a thread, so a
    float4 row of up to 8192 loads (32768 floats) fits norm.cu's register cache (CACHE = 8)."""
    for block, most in ((32, 128), (128, 1024), (512, 4096)):
        if units <= most:
            return block
    return 1024


def pick_small_block(units: int, rows: int) -> int | None:
    """The block of the latency-bound configuration for `rows` float4 rows of `units` loads, or None
    where the throughput configuration (pick_block, up to 8 loads a thread) fits better: few rows
    (a decode step's single token) leave most SMs idle, so each row gets enough threads that every
    one does at most SMALL_PER loads, and the weight/residual loads are issued before the reduction."""
    if not 0 < rows <= SMALL_ROWS:
        return None
    for block in SMALL_BLOCKS:
        if units <= SMALL_PER * block:
            return block
    return None


def _elements(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides in elements, padded to 4 dims."""
    pad = 4 - t.ndim
    return pad4(t.shape), (0,) * pad + tuple(s // t.dtype.block_bytes for s in t.strides)


def _vec_rows(t: Tensor, ptr: Ptr) -> bool:
    """Every row of `t` starts 16-byte aligned (row lengths are checked by the caller)."""
    shape, strides = _elements(t)
    return ptr(t) % 16 == 0 and all(s % 4 == 0 for n, s in zip(shape[:3], strides[:3]) if n > 1)


def _operand(t: Tensor | None, name: str, ptr: Ptr) -> dict[str, int]:
    """A weight (`name` "w") or residual ("r") as norm_rows_f32 takes it: pointer, 4 dims, 3 outer strides."""
    shape, strides = _elements(t) if t is not None else ((1, 1, 1, 1), (0, 0, 0, 0))
    return {name: ptr(t) if t is not None else 0, f"{name}0": shape[0], f"{name}1": shape[1],
            f"{name}2": shape[2], f"{name}cols": shape[3],
            **{f"{name}s{i}": strides[i] for i in range(3)}}


def row_spec(op: str, x: Tensor, out: Tensor, eps: float, ptr: Ptr,
             weight: Tensor | None = None, residual: Tensor | None = None) -> KernelSpec:
    """norm_rows_f32 for `op` of x into the contiguous `out`, times `weight` plus `residual` if given."""
    shape, strides = _elements(x)
    ncols = shape[3]
    extra = [t for t in (weight, residual) if t is not None]
    vec = (ncols % 4 == 0 and _vec_rows(x, ptr) and ptr(out) % 16 == 0
           and all(t.shape[-1] == ncols and _vec_rows(t, ptr) for t in extra))
    rows = math.prod(shape[:3]) if ncols else 0
    small = pick_small_block(ncols // 4, rows) if vec else None
    block = small or pick_block(ncols // 4 if vec else ncols)
    fuse = FUSE_MUL_ADD if residual is not None else FUSE_MUL if weight is not None else FUSE_NONE
    args = NormRowsArgs(x=ptr(x), dst=ptr(out), ncols=ncols, eps=eps, n1=shape[1], n2=shape[2],
                        xs0=strides[0], xs1=strides[1], xs2=strides[2],
                        **_operand(weight, "w", ptr), **_operand(residual, "r", ptr))
    kernel = row_kernel(MODES[op], block, vec, fuse, SMALL_PER if small else None)
    return KernelSpec(NORM_CU, kernel, rows, block, args)


def group_spec(x: Tensor, out: Tensor, groups: int, eps: float, ptr: Ptr) -> KernelSpec:
    """group_norm_f32 of x (N, C, H, W) into the contiguous `out`."""
    (n, c, h, w), strides = _elements(x)
    hw = h * w
    per_group = -(-c // groups)
    vec = hw % 4 == 0 and (n == 1 or strides[0] % 4 == 0) and ptr(x) % 16 == 0 and ptr(out) % 16 == 0
    block = pick_block(per_group * hw // 4 if vec else per_group * hw)
    args = GroupNormArgs(x=ptr(x), dst=ptr(out), channels=c, hw=hw, per_group=per_group, groups=groups,
                         xs_n=strides[0], eps=eps)
    return KernelSpec(NORM_CU, group_kernel(block, vec), n * groups if x.size else 0, block, args)
