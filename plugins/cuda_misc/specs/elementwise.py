"""elementwise.cu's launches (binary ops, add_id, the fused multi-add) and the geometry the elementwise
families share: element strides, the rows split, axis folding, the grids.

Binary ops take one of three paths, picked from the layout and the addresses (docs/cuda_misc.md):
`binary_flat` (contiguous, 16-byte vectors), `binary_rows` (rows of packed elements at one stride,
whole aligned vectors) and the general `binary_bcast` (any element strides, b by modulo).
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.args import NAN_ROW, Guard, IndexCheck, KernelArgs, i32, i64, instance
from opdispatch.backends.cuda.args import ptr as pointer
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.ops.base import FLOATS, pad4
from opdispatch.support import GRID_YZ_MAX
from opdispatch.tensor import Tensor

from . import KERNELS_DIR, Ptr

ELEMENTWISE_CU = KERNELS_DIR / "elementwise.cu"

#: C++ element type of each dtype (common.cuh's raw 16-bit types)
CTYPES = {"f32": "float", "f16": "od::f16", "bf16": "od::bf16"}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
#: (a, b) dtype pairs of the binary kernels: alike, or one of them f32
BINARY_PAIRS: tuple[tuple[str, str], ...] = tuple(
    (a, b) for a in FLOATS for b in FLOATS if a == b or "f32" in (a, b))
#: op codes of elementwise.cu (OP_*)
BINARY_CODES = {"add": 0, "sub": 1, "mul": 2, "div": 3}
#: the ops the binary kernels run: add1 is an add of a one-element b
BINARY_OPS: tuple[str, ...] = ("add", "sub", "mul", "div", "add1")

THREADS = 256
#: resident 256-thread blocks per SM at full occupancy (2048 threads); grids cover WAVES of them
BLOCKS_PER_SM = 8
WAVES = 4  # measured on the H200: 1 wave 80-90% of copy bandwidth, 2 waves 89-96%, 4 waves 92-98%
#: the most operands multi_add adds (elementwise.cu's s0..s8): a chain of 8 adds
MULTI_ADD_OPERANDS = 9


def binary_kernel(kind: str, a: str, b: str) -> str:
    return instance(kind, CTYPES[a], CTYPES[b])


def typed_kernel(kind: str, t: str) -> str:
    """A kernel templated on one element type."""
    return instance(kind, CTYPES[t])


KERNEL_SOURCES = {
    ELEMENTWISE_CU: (
        *(binary_kernel(k, a, b) for k in ("binary_flat", "binary_rows", "binary_bcast", "add_id")
          for a, b in BINARY_PAIRS),
        *(typed_kernel("multi_add", t) for t in FLOATS),
    ),
}


# -- kernel arguments -------------------------------------------------------------------------


@attrs.frozen
class BinaryFlatArgs(KernelArgs):
    KERNELS = ("binary_flat",)
    a: np.uint64 = pointer()
    b: np.uint64 = pointer()
    y: np.uint64 = pointer()
    n: np.int64 = i64()
    nvec: np.int64 = i64()
    b_scalar: np.int32 = i32()
    op: np.int32 = i32()


@attrs.frozen
class BinaryRowsArgs(KernelArgs):
    KERNELS = ("binary_rows",)
    a: np.uint64 = pointer()
    a_rs: np.int64 = i64()
    b: np.uint64 = pointer()
    b_rs: np.int64 = i64()
    y: np.uint64 = pointer()
    rows: np.int64 = i64()
    cols: np.int64 = i64()
    op: np.int32 = i32()


@attrs.frozen
class BinaryBcastArgs(KernelArgs):
    """a's element strides, b's sizes (read by modulo) and strides, the result's sizes."""

    KERNELS = ("binary_bcast",)
    a: np.uint64 = pointer()
    as0: np.int64 = i64()
    as1: np.int64 = i64()
    as2: np.int64 = i64()
    as3: np.int64 = i64()
    b: np.uint64 = pointer()
    m0: np.int32 = i32()
    m1: np.int32 = i32()
    m2: np.int32 = i32()
    m3: np.int32 = i32()
    bs0: np.int64 = i64()
    bs1: np.int64 = i64()
    bs2: np.int64 = i64()
    bs3: np.int64 = i64()
    y: np.uint64 = pointer()
    n0: np.int32 = i32()
    n1: np.int32 = i32()
    n2: np.int32 = i32()
    n3: np.int32 = i32()
    op: np.int32 = i32()


@attrs.frozen
class AddIdArgs(KernelArgs):
    KERNELS = ("add_id",)
    a: np.uint64 = pointer()
    as0: np.int64 = i64()
    as1: np.int64 = i64()
    as2: np.int64 = i64()
    b: np.uint64 = pointer()
    bs0: np.int64 = i64()
    bs1: np.int64 = i64()
    ids: np.uint64 = pointer()
    is0: np.int64 = i64()
    is1: np.int64 = i64()
    y: np.uint64 = pointer()
    n_t: np.int32 = i32()
    n_u: np.int32 = i32()
    n_c: np.int32 = i32()
    n_e: np.int32 = i32()
    err_: IndexCheck


@attrs.frozen
class MultiAddArgs(KernelArgs):
    """Up to nine operands s0..s8, each rows `rs` elements apart (0: one row broadcast); `n` are used."""

    KERNELS = ("multi_add",)
    s0: np.uint64 = pointer()
    s1: np.uint64 = pointer()
    s2: np.uint64 = pointer()
    s3: np.uint64 = pointer()
    s4: np.uint64 = pointer()
    s5: np.uint64 = pointer()
    s6: np.uint64 = pointer()
    s7: np.uint64 = pointer()
    s8: np.uint64 = pointer()
    rs0: np.int64 = i64()
    rs1: np.int64 = i64()
    rs2: np.int64 = i64()
    rs3: np.int64 = i64()
    rs4: np.int64 = i64()
    rs5: np.int64 = i64()
    rs6: np.int64 = i64()
    rs7: np.int64 = i64()
    rs8: np.int64 = i64()
    n: np.int32 = i32()
    y: np.uint64 = pointer()
    rows: np.int64 = i64()
    cols: np.int64 = i64()
    vec: np.int32 = i32()


# -- geometry --------------------------------------------------------------------------------


def elements(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides in elements, padded to 4 dims (size-1 axes get stride 0)."""
    pad = 4 - t.ndim
    shape = pad4(t.shape)
    strides = (0,) * pad + tuple(s // t.dtype.block_bytes for s in t.strides)
    return shape, tuple(0 if n == 1 else s for n, s in zip(shape, strides))


def _dense_from(shape: Sequence[int], strides: Sequence[int], k: int) -> bool:
    """Axes k.. of the 4 are packed (size-1 axes ignored)."""
    step = 1
    for d in range(3, k - 1, -1):
        if shape[d] != 1 and strides[d] != step:
            return False
        step *= shape[d]
    return True


def _row_stride(shape: Sequence[int], strides: Sequence[int], k: int) -> int | None:
    """The one stride between consecutive rows when axes ..k-1 are rows of the packed axes k..; None if none."""
    rs = None
    span = 1  # rows spanned by one step of axis d
    for d in range(k - 1, -1, -1):
        if shape[d] != 1:
            if rs is None:
                rs = strides[d]
            elif strides[d] != rs * span:
                return None
        span *= shape[d]
    return 0 if rs is None else rs


@attrs.frozen
class Rows:
    """A result of rows x cols over sources each rows of `cols` packed elements `strides` apart (0: broadcast)."""

    rows: int
    cols: int
    strides: tuple[int, ...]


def rows_layout(out_shape: Sequence[int], srcs: Sequence[Tensor]) -> Rows | str:
    """The largest rows x cols split of `out_shape` that every source can be read in (see Rows), or why none.

    A source of the result's shape needs its inner axes packed and its outer
    axes at one row stride; a broadcast source must be one packed block of the
    inner axes (leading axes 1), repeated for every row.
    """
    s4 = pad4(tuple(out_shape))
    geo = [elements(t) for t in srcs]
    # a broadcast source fixes the split: it holds axes k.. exactly, and 1s before
    forced = set()
    for shape, _ in geo:
        if shape != s4:
            k = next((k for k in range(1, 4) if shape[k:] == s4[k:] and all(n == 1 for n in shape[:k])), None)
            if k is None:
                return f"a source of shape {shape} is not one block broadcast over rows"
            forced.add(k)
    if len(forced) > 1:
        return "sources broadcast over different axes"
    for k in sorted(forced) or range(4):
        strides = []
        for shape, st in geo:
            if not _dense_from(shape, st, k):
                break
            rs = 0 if shape != s4 else _row_stride(shape, st, k)
            if rs is None:
                break
            strides.append(rs)
        else:
            return Rows(math.prod(s4[:k]), math.prod(s4[k:]), tuple(strides))
    return "a source's rows are not packed at one stride"


def fold(shape: Sequence[int], srcs: Sequence[tuple[Sequence[int], Sequence[int]]]
         ) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Merge adjacent axes wherever every source allows, as 4 dims again.

    `shape` is the result's (contiguous); each source is (dims, element strides)
    with its dims dividing the result's (read by modulo). Axes d, d+1 merge for
    a source when it is 1 along d (the merged index modulo its d+1 size is the
    same), or full along d+1 with stride[d] == stride[d+1] * dims[d+1].
    """
    s4 = list(pad4(tuple(shape)))
    ops = [(list(pad4(tuple(m))), [0] * (4 - len(st)) + list(st)) for m, st in srcs]
    keep = [d for d in range(4) if s4[d] != 1]
    n = [s4[d] for d in keep]
    ops = [([m[d] for d in keep], [st[d] if m[d] != 1 else 0 for d in keep]) for m, st in ops]
    d = len(n) - 2
    while d >= 0:
        merged = []
        for m, st in ops:
            if m[d] == 1:
                merged.append((m[d + 1], st[d + 1]))
            elif m[d + 1] == n[d + 1] and st[d] == st[d + 1] * m[d + 1]:
                merged.append((m[d] * m[d + 1], st[d + 1]))
            else:
                break
        else:
            n[d:d + 2] = [n[d] * n[d + 1]]
            for (m, st), (mm, ms) in zip(ops, merged):
                m[d:d + 2] = [mm]
                st[d:d + 2] = [ms if mm != 1 else 0]
        d -= 1
    pad = 4 - len(n)
    return (1,) * pad + tuple(n), [((1,) * pad + tuple(m), (0,) * pad + tuple(st)) for m, st in ops]


def flat_layout(a: Tensor, b: Tensor) -> bool:
    """a and b contiguous, b of a's shape or one element: the flat path."""
    return a.is_contiguous() and b.is_contiguous() and (pad4(b.shape) == pad4(a.shape) or b.size == 1)


def grid_flat(units: int, sm_count: int) -> int:
    """Blocks of THREADS for a grid-stride loop over `units`: enough to fill WAVES of the GPU, no more."""
    return min(-(-units // THREADS), sm_count * BLOCKS_PER_SM * WAVES) if units else 0


def grid_2d(cols: int, rows: int, sm_count: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) for columns along x and rows along y, THREADS a block, grid-stride both ways."""
    if not cols or not rows:
        return (0, 0), (1, 1)
    bx = min(THREADS, 1 << (cols - 1).bit_length())
    by = THREADS // bx
    gx = min(-(-cols // bx), sm_count * BLOCKS_PER_SM * WAVES)
    gy = max(1, min(-(-rows // by), GRID_YZ_MAX, sm_count * BLOCKS_PER_SM * WAVES // gx))
    return (gx, gy), (bx, by)


def vec_elems(t: Tensor) -> int:
    """Elements of `t`'s dtype in one 16-byte vector."""
    return 16 // ITEMSIZE[t.dtype.name]


def aligned_to(ptr: Ptr, t: Tensor, nbytes: int) -> bool:
    """`t`'s first byte sits at a multiple of `nbytes`."""
    return ptr(t) % nbytes == 0


# -- launch specs -----------------------------------------------------------------------------


def binary_spec(op: str, a: Tensor, b: Tensor, out: Tensor, ptr: Ptr, sm_count: int) -> KernelSpec:
    """The path for the layout: binary_flat, binary_rows (whole vectors, aligned) or binary_bcast."""
    if flat_layout(a, b):
        return binary_flat_spec(op, a, b, out, ptr, sm_count)
    return binary_rows_spec(op, a, b, out, ptr, sm_count)


def binary_flat_spec(op: str, a: Tensor, b: Tensor, out: Tensor, ptr: Ptr, sm_count: int) -> KernelSpec:
    """a, b, out contiguous; b a's shape or one element."""
    n = out.size
    vec = vec_elems(out)
    scalar = b.size == 1 and n != 1
    ok = (aligned_to(ptr, a, 16) and aligned_to(ptr, out, 16)
          and (scalar or aligned_to(ptr, b, vec * ITEMSIZE[b.dtype.name])))
    nvec = n // vec if ok else 0
    args = BinaryFlatArgs(a=ptr(a), b=ptr(b), y=ptr(out), n=n, nvec=nvec, b_scalar=int(scalar),
                          op=BINARY_CODES[op])
    grid = grid_flat(max(nvec, n - nvec * vec), sm_count)
    return KernelSpec(ELEMENTWISE_CU, binary_kernel("binary_flat", a.dtype.name, b.dtype.name), (grid,), (THREADS,),
                      args)


def binary_rows_spec(op: str, a: Tensor, b: Tensor, out: Tensor, ptr: Ptr, sm_count: int) -> KernelSpec:
    """Rows of packed elements (see rows_layout) in whole aligned vectors, else binary_bcast."""
    lay = rows_layout(out.shape, (a, b))
    vec = vec_elems(out)
    if (isinstance(lay, str) or lay.cols % vec or any(s % vec for s in lay.strides)
            or not (aligned_to(ptr, a, 16) and aligned_to(ptr, out, 16)
                    and aligned_to(ptr, b, vec * ITEMSIZE[b.dtype.name]))):
        return binary_bcast_spec(op, a, b, out, ptr, sm_count)
    grid, block = grid_2d(lay.cols // vec, lay.rows, sm_count)
    args = BinaryRowsArgs(a=ptr(a), a_rs=lay.strides[0], b=ptr(b), b_rs=lay.strides[1], y=ptr(out), rows=lay.rows,
                          cols=lay.cols, op=BINARY_CODES[op])
    return KernelSpec(ELEMENTWISE_CU, binary_kernel("binary_rows", a.dtype.name, b.dtype.name), grid, block, args)


def binary_bcast_spec(op: str, a: Tensor, b: Tensor, out: Tensor, ptr: Ptr, sm_count: int) -> KernelSpec:
    """Any strides, b by modulo in every axis."""
    n, ((_, sa), (m, sb)) = fold(out.shape, [elements(a), elements(b)])
    grid, block = grid_2d(n[3], n[0] * n[1] * n[2], sm_count)
    args = BinaryBcastArgs(ptr(a), *sa, ptr(b), *m, *sb, ptr(out), *n, BINARY_CODES[op])
    return KernelSpec(ELEMENTWISE_CU, binary_kernel("binary_bcast", a.dtype.name, b.dtype.name), grid, block, args)


def add_id_spec(node: Tensor, ptr: Ptr, guard: Guard, sm_count: int) -> KernelSpec:
    a, b, ids = node.srcs
    (_, n_t, n_u, n_c), (_, as0, as1, as2) = elements(a)
    (_, _, n_e, _), (_, _, bs0, bs1) = elements(b)
    (_, _, _, _), (_, _, is0, is1) = elements(ids)
    grid, block = grid_2d(n_c, n_t * n_u, sm_count)
    args = AddIdArgs(a=ptr(a), as0=as0, as1=as1, as2=as2, b=ptr(b), bs0=bs0, bs1=bs1, ids=ptr(ids), is0=is0,
                     is1=is1, y=ptr(node), n_t=n_t, n_u=n_u, n_c=n_c, n_e=n_e,
                     err_=guard(node, ids, n_e, f"a bias row of {b.describe()}", NAN_ROW))
    return KernelSpec(ELEMENTWISE_CU, binary_kernel("add_id", a.dtype.name, b.dtype.name), grid, block, args)


def multi_add_operands(nodes: Sequence[Tensor]) -> list[Tensor]:
    """Every tensor a chain of adds sums: the first add's a, then each add's b."""
    return [nodes[0].srcs[0], *(n.srcs[1] for n in nodes)]


def multi_add_spec(nodes: Sequence[Tensor], ptr: Ptr, sm_count: int) -> KernelSpec:
    """One kernel adding every operand of a chain of adds (checked by fusion.multi_add_check)."""
    srcs = multi_add_operands(nodes)
    out = nodes[-1]
    lay = rows_layout(out.shape, srcs)
    assert isinstance(lay, Rows), lay
    vec = vec_elems(out)
    ok = (lay.cols % vec == 0 and all(s % vec == 0 for s in lay.strides)
          and all(aligned_to(ptr, t, 16) for t in (*srcs, out)))
    grid, block = grid_2d(lay.cols // vec if ok else lay.cols, lay.rows, sm_count)
    unused = (0,) * (MULTI_ADD_OPERANDS - len(srcs))
    args = MultiAddArgs(*(ptr(t) for t in srcs), *unused, *lay.strides, *unused, n=len(srcs), y=ptr(out),
                        rows=lay.rows, cols=lay.cols, vec=int(ok))
    return KernelSpec(ELEMENTWISE_CU, typed_kernel("multi_add", out.dtype.name), grid, block, args)
