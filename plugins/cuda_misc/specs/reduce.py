"""reduce.cu's launches: sum, sum_rows, mean, cumsum, argmax (one block a row, or a row split over
blocks: `argmax_split`, which the fused greedy pick runs too), count_equal.

argmax_split splits few long rows (a decode step's logits) over about one wave of blocks; the
last block of a row to finish merges the partials (docs/cuda_misc.md).
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.args import NOT_WRITTEN, UNCHECKED, Guard, IndexCheck, KernelArgs, i32, i64, instance, u32
from opdispatch.backends.cuda.args import ptr as pointer
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.backends.cuda.scratch import Workspace
from opdispatch.ops.base import FLOATS
from opdispatch.tensor import Tensor

from . import KERNELS_DIR, Ptr
from .rows import BLOCK, VALUE, Layout, index_type, layout, padded

REDUCE_CU = KERNELS_DIR / "reduce.cu"

ROW_REDUCE_BLOCKS = (32, 128, 256, 1024)
#: partials of the whole-tensor reductions (reduce.cu's MAX_PARTIALS)
MAX_PARTIALS = 1024
#: threads per block of reduce.cu's argmax_split (its SPLIT_BLOCK)
SPLIT_BLOCK = 128
#: the fewest columns a block of argmax_split takes: a float4 a thread, or its merge costs more than it saves
SPLIT_MIN_COLS = 4 * SPLIT_BLOCK


def _instances() -> tuple[str, ...]:
    names = [instance("sum_rows", blk, mean, vec) for blk in ROW_REDUCE_BLOCKS for mean in (False, True)
             for vec in (False, True)]
    names += [instance("cumsum", blk) for blk in ROW_REDUCE_BLOCKS]
    names += [instance("argmax", blk) for blk in ROW_REDUCE_BLOCKS]
    names += [instance("argmax_split", vec, i) for vec in (False, True) for i in ("int", "long long")]
    names += [instance("sum_all", VALUE[f], c) for f in FLOATS for c in (False, True)]
    names.append("count_equal")
    return tuple(names)


KERNEL_SOURCES = {REDUCE_CU: _instances()}


# -- kernel arguments -------------------------------------------------------------------------


@attrs.frozen
class RowReduceArgs(KernelArgs):
    """x's rows of ncols values (rows n1 x n2 x the rest), byte strides s0..s3 innermost first."""

    KERNELS = ("sum_rows", "cumsum")
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    ncols: np.int32 = i32()
    n1: np.uint32 = u32()
    n2: np.uint32 = u32()
    s0: np.int64 = i64()
    s1: np.int64 = i64()
    s2: np.int64 = i64()
    s3: np.int64 = i64()


@attrs.frozen
class ArgmaxArgs(KernelArgs):
    KERNELS = ("argmax",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    ncols: np.int32 = i32()
    s0: np.int64 = i64()
    s1: np.int64 = i64()


@attrs.frozen
class ArgmaxSplitArgs(KernelArgs):
    """Unfused, out_f32, token_log and idx are 0 (and is0, ls1, log_rows, err_ unused)."""

    KERNELS = ("argmax_split",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    out_f32: np.uint64 = pointer()
    token_log: np.uint64 = pointer()
    idx: np.uint64 = pointer()
    partials: np.uint64 = pointer()
    counters: np.uint64 = pointer()
    ncols: np.int32 = i32()
    chunk: np.int32 = i32()
    nblk: np.int32 = i32()
    s0: np.int64 = i64()
    s1: np.int64 = i64()
    is0: np.int64 = i64()
    ls1: np.int64 = i64()
    log_rows: np.int64 = i64()
    err_: IndexCheck


@attrs.frozen
class SumAllArgs(KernelArgs):
    KERNELS = ("sum_all",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.uint32 = u32()
    a: Layout


@attrs.frozen
class CountEqualArgs(KernelArgs):
    KERNELS = ("count_equal",)
    a_: np.uint64 = pointer()  # the C parameters `a` and `b`; the fields `a`, `b` are their layouts
    b_: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.uint32 = u32()
    a: Layout
    b: Layout


# -- row reductions ------------------------------------------------------------------------------


def rows_of(x: Tensor) -> tuple[int, int, int, tuple[int, ...]]:
    """(row length, n1, n2, byte strides innermost first) of x read row by row."""
    (n3, n2, n1, n0), strides = padded(x)
    return n0, n1, n2, tuple(reversed(strides))


def reduce_block(cols: int) -> int:
    for blk, most in ((32, 128), (128, 1024), (256, 8192)):
        if cols <= most:
            return blk
    return 1024


def _vec_rows(x: Tensor, ptr: Ptr) -> bool:
    """Rows packed and each starting 16-byte aligned."""
    shape, strides = padded(x)
    return (x.rows_contiguous() and ptr(x) % 16 == 0
            and all(s % 16 == 0 for n, s in zip(shape[:3], strides[:3]) if n > 1))


def _row_reduce_args(x: Tensor, out: Tensor, ptr: Ptr) -> RowReduceArgs:
    n0, n1, n2, st = rows_of(x)
    return RowReduceArgs(ptr(x), ptr(out), n0, max(n1, 1), max(n2, 1), *st)


def sum_rows_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    cols = x.shape[-1]
    vec = _vec_rows(x, ptr)
    blk = reduce_block(cols // 4 if vec else cols)
    name = instance("sum_rows", blk, node.op == "mean", vec)
    rows = math.prod(x.shape[:-1]) if cols else 0
    return [KernelSpec(REDUCE_CU, name, rows, blk, _row_reduce_args(x, node, ptr))]


def cumsum_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    cols = x.shape[-1]
    blk = reduce_block(-(-cols // 4))
    rows = math.prod(x.shape[:-1]) if cols else 0
    return [KernelSpec(REDUCE_CU, instance("cumsum", blk), rows, blk, _row_reduce_args(x, node, ptr))]


# -- argmax ------------------------------------------------------------------------------------------


def argmax_rows(x: Tensor) -> tuple[int, int, int]:
    """(rows, columns, row stride in bytes) of argmax's f32 (R, C) or (C,) input."""
    return (x.shape[0], x.shape[1], x.strides[0]) if x.ndim == 2 else (1, x.shape[0], 0)


def argmax_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    """argmax with one block a row (reduce.cu's argmax): many rows, or short ones."""
    x = node.srcs[0]
    rows, cols, s1 = argmax_rows(x)
    blk = reduce_block(cols)
    return [KernelSpec(REDUCE_CU, instance("argmax", blk), rows if cols else 0, blk,
                       ArgmaxArgs(x=ptr(x), out=ptr(node), ncols=cols, s0=x.strides[-1], s1=s1))]


def split_shape(rows: int, cols: int, sms: int) -> tuple[int, int]:
    """(blocks a row, columns a block: a multiple of 4) of argmax_split: the rows' blocks together about
    fill the SMs once (one block cannot keep enough of a long row's loads in flight), each taking at
    least SPLIT_MIN_COLS columns. (1, cols rounded up to 4) where one block a row is the best it can do."""
    want = max(1, min(-(-sms // max(rows, 1)), cols // SPLIT_MIN_COLS))
    chunk = max(4, -(-cols // (4 * want)) * 4)  # cols / want rounded up to 4: float4s never straddle blocks
    return max(1, -(-cols // chunk)), chunk


def argmax_splits(node: Tensor, sms: int) -> bool:
    """Does argmax_split (several blocks a row) run this argmax, rather than one block a row?"""
    rows, cols, _ = argmax_rows(node.srcs[0])
    return split_shape(rows, cols, sms)[0] > 1


def argmax_workspaces(rows: int, nblk: int) -> tuple[Workspace, ...]:
    """argmax_split's partials (a (value, index) pair per block) and per-row counters (zeroed at bind); none
    with one block a row."""
    if nblk == 1:
        return ()
    return (Workspace(rows * nblk * 8, "argmax partials"), Workspace(rows * 4, "argmax row counters", zeroed=True))


def split_workspaces(x: Tensor, sms: int) -> tuple[Workspace, ...]:
    """The workspaces argmax_split needs for x's rows on a GPU of `sms` SMs."""
    rows, cols, _ = argmax_rows(x)
    return argmax_workspaces(rows, split_shape(rows, cols, sms)[0])


def argmax_split_specs(x: Tensor, out: Tensor, ptr: Ptr, ws: Sequence[int], sms: int,
                       out_f32: Tensor | None = None, log: Tensor | None = None,
                       log_check: IndexCheck = UNCHECKED) -> list[KernelSpec]:
    """reduce.cu's argmax_split of x's rows into the contiguous i32 `out`; `ws`: the addresses of
    argmax_workspaces. The fused greedy pick also gives `out_f32` (contiguous f32, the index as a float)
    and `log`, the set_rows node writing it into rows of one value at log.srcs[2]'s row ids, checked
    by `log_check`."""
    rows, cols, s1 = argmax_rows(x)
    nblk, chunk = split_shape(rows, cols, sms)
    partials, counters = ws if nblk > 1 else (0, 0)
    s0 = x.strides[-1]
    vec = s0 == 4 and ptr(x) % 16 == 0 and (rows == 1 or s1 % 16 == 0)
    args = ArgmaxSplitArgs(x=ptr(x), out=ptr(out), out_f32=0, token_log=0, idx=0, partials=partials,
                           counters=counters, ncols=cols, chunk=chunk, nblk=nblk, s0=s0, s1=s1, is0=0, ls1=0,
                           log_rows=0, err_=UNCHECKED)
    itype = "int"
    if log is not None:
        idx = log.srcs[2]
        itype = index_type(idx)
        args = attrs.evolve(args, out_f32=ptr(out_f32), token_log=ptr(log), idx=ptr(idx), is0=idx.strides[0],
                            ls1=log.strides[0], log_rows=log.shape[0], err_=log_check)
    return [KernelSpec(REDUCE_CU, instance("argmax_split", vec, itype), nblk * rows if cols else 0, SPLIT_BLOCK,
                       args)]


def greedy_specs(nodes: Sequence[Tensor], ptr: Ptr, guard: Guard, ws: Sequence[int], sms: int) -> list[KernelSpec]:
    """The fused greedy pick (fusion.GREEDY_PATTERN: argmax, cpy, view, cpy, set_rows) as argmax_split."""
    picked, tokens, _, as_f32, log = nodes
    dst, _, idx = log.srcs
    check = guard(log, idx, log.shape[0], f"a row of {dst.describe()}", NOT_WRITTEN)
    return argmax_split_specs(picked.srcs[0], tokens, ptr, ws, sms, as_f32, log, check)


# -- whole-tensor reductions ---------------------------------------------------------------------------


def _partials_grid(n: int, sms: int) -> int:
    return min(-(-n // BLOCK), MAX_PARTIALS, sms * 4)


def sum_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    name = instance("sum_all", VALUE[x.dtype.name], x.is_contiguous())
    # an empty x still writes its sum, 0: one block
    return [KernelSpec(REDUCE_CU, name, max(_partials_grid(x.size, sms), 1), BLOCK,
                       SumAllArgs(x=ptr(x), out=ptr(node), n=x.size, a=layout(x)))]


def count_equal_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    a, bt = node.srcs
    return [KernelSpec(REDUCE_CU, "count_equal", max(_partials_grid(a.size, sms), 1), BLOCK,
                       CountEqualArgs(a_=ptr(a), b_=ptr(bt), out=ptr(node), n=a.size, a=layout(a), b=layout(bt)))]
