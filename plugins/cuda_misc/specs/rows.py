"""rows.cu's copies and conversions (cpy, dup, cont) and get_rows / set_rows; the layout-argument
record and index arithmetic that rows.cu, layout.cu, reduce.cu and sort.cu share.

A layout is 13 kernel parameters (`OD_LAYOUT_PARAMS(p)` of kernels/index.cuh): three sizes as divisors
for the kernels' multiply-shift division (`fastdiv`), then four byte strides, innermost first.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.args import (NAN_ROW, NOT_WRITTEN, ArgGroup, Guard, IndexCheck, KernelArgs, i32, i64,
                                           instance, u32)
from opdispatch.backends.cuda.args import ptr as pointer
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.dtypes import DTYPES, DType
from opdispatch.ops.base import FLOATS, QUANTS, pad4
from opdispatch.support import GRID_YZ_MAX
from opdispatch.tensor import Tensor

from . import KERNELS_DIR, Ptr

ROWS_CU = KERNELS_DIR / "rows.cu"

#: threads per block of the grid-stride kernels
BLOCK = 256
#: blocks per SM the grid-stride kernels launch at most: one wave of 256-thread blocks (then threads loop)
BLOCKS_PER_SM = 8
#: the same for the contiguous quantize (rows.cu's staged path): as many blocks as stay resident together
QUANT_BLOCKS_PER_SM = 4

# -- C++ names -----------------------------------------------------------------------------

#: the C++ type a kernel reads each plain dtype's values as
VALUE = {"f32": "float", "f16": "od::f16", "bf16": "od::bf16", "i32": "int"}
#: block formats rows.cu decodes but does not encode: quant_k.cuh's (K-quants, iq4_nl, iq4_xs, mxfp4) and
#: quant_iq.cuh's (the grid I-quants), those opdispatch.dtypes knows
GRID = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
SUBSCALED = ("q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs", "mxfp4", *GRID)
DECODE_ONLY = tuple(q for q in SUBSCALED if q in DTYPES)
#: block formats rows.cu encodes too (quant.cuh's encode8): the legacy 32-value ones the ops take
ENCODED = tuple(q for q in QUANTS if q not in SUBSCALED)
#: the format traits of each block format (quant.cuh, quant_k.cuh)
QUANT = {q: f"od::quant::{q}" for q in ENCODED + DECODE_ONLY}
#: conversions through f32 between these
PLAIN = ("f32", "f16", "bf16", "i32")
#: raw copy units by element size
RAW = {1: "unsigned char", 2: "unsigned short", 4: "unsigned", 8: "unsigned long long"}
#: copy_contig's units by the alignment both addresses share
CONTIG_UNITS = {16: "uint4", 4: "unsigned", 2: "unsigned short", 1: "unsigned char"}
#: dtypes whose raw units cover every same-dtype copy: one per element size, and every block format
#: of an even size (Block<N> moves 16-bit words; mxfp4's 17-byte blocks are copied contiguously only)
RAW_DTYPES = ("i8", "i16", "f32", "i64", *ENCODED, *(q for q in DECODE_ONLY if DTYPES[q].block_bytes % 2 == 0))
ROW_BLOCKS = (32, 64, 128, 256)  # get_rows_q threads per block: any, one module
ROW_THREADS = 256  # rows.cu's ROW_THREADS: threads per block of get_rows / set_rows
ROW_UNROLL = 4  # rows.cu's ROW_UNROLL: packs per thread


def raw(dt: DType) -> str:
    """The raw unit a same-dtype copy moves: one element, or one block of a block format."""
    return f"od::rows::Block<{dt.block_bytes}>" if dt.is_quant else RAW[dt.block_bytes]


def index_type(t: Tensor) -> str:
    """The C++ type of an i32 or i64 index tensor's values."""
    return "int" if t.dtype.name == "i32" else "long long"


def _instances() -> tuple[str, ...]:
    names = [instance("copy_contig", u) for u in CONTIG_UNITS.values()]
    for s in PLAIN:
        for d in PLAIN:
            if s != d:
                names += [instance("convert_contig", VALUE[s], VALUE[d], v) for v in (False, True)]
                names += [instance(k, VALUE[s], VALUE[d]) for k in ("convert_strided", "convert_tiled")]
    names += [instance("convert_strided", raw(DTYPES[t]), raw(DTYPES[t])) for t in RAW_DTYPES]
    names += [instance("convert_tiled", u, u) for u in RAW.values()]
    for q in ENCODED:
        for f in FLOATS:
            names += [instance("quantize", QUANT[q], VALUE[f], c) for c in (False, True)]
            names += [instance("dequantize", QUANT[q], VALUE[f], c) for c in (False, True)]
    names += [instance("get_rows", VALUE[s], "int" if s == "i32" else "float", v) for s in PLAIN for v in (False, True)]
    names += [instance("dequantize", QUANT[q], VALUE[f], c) for q in DECODE_ONLY for f in FLOATS for c in (False, True)]
    names += [instance("get_rows_q", QUANT[q]) for q in QUANT]
    names += [instance("set_rows", VALUE[d], i, v) for d in FLOATS for i in ("int", "long long") for v in (False, True)]
    names += [instance("set_rows_q", QUANT[q], i, v)
              for q in ENCODED for i in ("int", "long long") for v in (False, True)]
    return tuple(names)


#: rows.cu's copies and row instances
KERNEL_SOURCES = {ROWS_CU: _instances()}

# -- index arithmetic and the layout record ----------------------------------------------------


def fastdiv(d: int) -> tuple[int, int, int]:
    """(d, m, l) for index.cuh's fdiv: n // d == (umulhi(n, m) + n) >> l for 0 <= n < 2**31.

    l = ceil(log2(d)), m = floor(2**32 * (2**l - d) / d) + 1 (Granlund and
    Montgomery's division by invariant integers). d = 0 (an empty axis) is
    taken as 1: nothing is launched then anyway.
    """
    d = max(int(d), 1)
    ell = (d - 1).bit_length()
    m = (1 << 32) * ((1 << ell) - d) // d + 1
    return d, m, ell


@attrs.frozen
class Layout(ArgGroup):
    """`OD_LAYOUT_PARAMS(p)`: sizes n0, n1, n2 innermost first as (d, m, l) divisors, byte strides s0..s3."""

    d0: np.uint32 = u32()
    m0: np.uint32 = u32()
    l0: np.uint32 = u32()
    d1: np.uint32 = u32()
    m1: np.uint32 = u32()
    l1: np.uint32 = u32()
    d2: np.uint32 = u32()
    m2: np.uint32 = u32()
    l2: np.uint32 = u32()
    s0: np.int64 = i64()
    s1: np.int64 = i64()
    s2: np.int64 = i64()
    s3: np.int64 = i64()


def padded(t: Tensor, blocks: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape (the last axis in blocks if `blocks`) and byte strides, padded to 4 axes."""
    shape = list(pad4(t.shape))
    if blocks:
        shape[-1] //= t.dtype.block_size
    return tuple(shape), (0,) * (4 - t.ndim) + tuple(t.strides)


def layout_of(shape: Sequence[int], strides: Sequence[int]) -> Layout:
    """The Layout of a 4-d (shape, byte strides), numpy order."""
    return Layout(*fastdiv(shape[3]), *fastdiv(shape[2]), *fastdiv(shape[1]), *reversed(strides))


def layout(t: Tensor, blocks: bool = False) -> Layout:
    return layout_of(*padded(t, blocks))


def shape_layout(shape: Sequence[int]) -> Layout:
    """A layout used only to unravel flat indices over `shape` (strides 0)."""
    return layout_of(pad4(tuple(shape)), (0, 0, 0, 0))


def units(t: Tensor) -> int:
    """Elements, or blocks of a block format."""
    return t.size // t.dtype.block_size


def stride_grid(work: int, sm_count: int, block: int = BLOCK) -> int:
    """Blocks for a grid-stride loop over `work` items: enough to fill the GPU, at most one item per thread."""
    return min(-(-work // block), sm_count * BLOCKS_PER_SM)


def alignment(*addresses: int) -> int:
    """The largest of 16, 4, 2, 1 that divides every address."""
    for a in (16, 4, 2):
        if all(x % a == 0 for x in addresses):
            return a
    return 1


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


# -- kernel arguments -------------------------------------------------------------------------


@attrs.frozen
class CopyContigArgs(KernelArgs):
    KERNELS = ("copy_contig",)
    src: np.uint64 = pointer()
    dst: np.uint64 = pointer()
    nbytes: np.int64 = i64()


@attrs.frozen
class ConvertContigArgs(KernelArgs):
    KERNELS = ("convert_contig",)
    src: np.uint64 = pointer()
    dst: np.uint64 = pointer()
    n: np.int64 = i64()


@attrs.frozen
class StridedCopyArgs(KernelArgs):
    """n values (elements or blocks) read through layout a, written through layout b."""

    KERNELS = ("convert_strided", "dequantize")
    src: np.uint64 = pointer()
    dst: np.uint64 = pointer()
    n: np.uint32 = u32()
    a: Layout
    b: Layout


@attrs.frozen
class QuantizeArgs(KernelArgs):
    KERNELS = ("quantize",)
    src: np.uint64 = pointer()
    dst: np.uint64 = pointer()
    nblocks: np.uint32 = u32()
    a: Layout
    b: Layout


@attrs.frozen
class ConvertTiledArgs(KernelArgs):
    """Sizes and byte strides in the order (last axis, A, B, C) of `transposed`."""

    KERNELS = ("convert_tiled",)
    src: np.uint64 = pointer()
    dst: np.uint64 = pointer()
    n0: np.uint32 = u32()
    na: np.uint32 = u32()
    nb: np.uint32 = u32()
    s0: np.int64 = i64()
    sa: np.int64 = i64()
    sb: np.int64 = i64()
    sc: np.int64 = i64()
    d0: np.int64 = i64()
    da: np.int64 = i64()
    db: np.int64 = i64()
    dc: np.int64 = i64()


@attrs.frozen
class GetRowsArgs(KernelArgs):
    KERNELS = ("get_rows",)
    a: np.uint64 = pointer()
    idx: np.uint64 = pointer()
    out: np.uint64 = pointer()
    ncols: np.int32 = i32()
    n: np.uint32 = u32()
    a2: np.uint32 = u32()
    arows: np.int64 = i64()
    nrows: np.uint32 = u32()
    tpr_log2: np.int32 = i32()
    as0: np.int64 = i64()
    as1: np.int64 = i64()
    as2: np.int64 = i64()
    as3: np.int64 = i64()
    is0: np.int64 = i64()
    is1: np.int64 = i64()
    is2: np.int64 = i64()
    err_: IndexCheck


@attrs.frozen
class GetRowsQArgs(KernelArgs):
    KERNELS = ("get_rows_q",)
    a: np.uint64 = pointer()
    idx: np.uint64 = pointer()
    out: np.uint64 = pointer()
    ncols: np.int32 = i32()
    n: np.uint32 = u32()
    a2: np.uint32 = u32()
    arows: np.int64 = i64()
    as1: np.int64 = i64()
    as2: np.int64 = i64()
    as3: np.int64 = i64()
    is0: np.int64 = i64()
    is1: np.int64 = i64()
    is2: np.int64 = i64()
    err_: IndexCheck


@attrs.frozen
class SetRowsArgs(KernelArgs):
    KERNELS = ("set_rows",)
    src: np.uint64 = pointer()
    idx: np.uint64 = pointer()
    dst: np.uint64 = pointer()
    ncols: np.int32 = i32()
    n: np.uint32 = u32()
    d2: np.uint32 = u32()
    ni1: np.uint32 = u32()
    ni2: np.uint32 = u32()
    drows: np.int64 = i64()
    nrows: np.uint32 = u32()
    tpr_log2: np.int32 = i32()
    ss0: np.int64 = i64()
    ss1: np.int64 = i64()
    ss2: np.int64 = i64()
    ss3: np.int64 = i64()
    is0: np.int64 = i64()
    is1: np.int64 = i64()
    is2: np.int64 = i64()
    ds0: np.int64 = i64()
    ds1: np.int64 = i64()
    ds2: np.int64 = i64()
    ds3: np.int64 = i64()
    err_: IndexCheck


@attrs.frozen
class SetRowsQArgs(KernelArgs):
    KERNELS = ("set_rows_q",)
    src: np.uint64 = pointer()
    idx: np.uint64 = pointer()
    dst: np.uint64 = pointer()
    nblocks: np.int32 = i32()
    n: np.uint32 = u32()
    d2: np.uint32 = u32()
    ni1: np.uint32 = u32()
    ni2: np.uint32 = u32()
    drows: np.int64 = i64()
    ss0: np.int64 = i64()
    ss1: np.int64 = i64()
    ss2: np.int64 = i64()
    ss3: np.int64 = i64()
    is0: np.int64 = i64()
    is1: np.int64 = i64()
    is2: np.int64 = i64()
    ds1: np.int64 = i64()
    ds2: np.int64 = i64()
    ds3: np.int64 = i64()
    err_: IndexCheck


# -- copies: cpy, dup, cont ----------------------------------------------------------------------


def copy_kind(src: DType, dst: DType) -> str | None:
    """'same', 'convert', 'quantize', 'dequantize', or None when the kernels do not convert the pair."""
    if src == dst:
        return "same"
    if src.name in PLAIN and dst.name in PLAIN:
        return "convert"
    if src.name in FLOATS and dst.is_quant:
        return "quantize"
    if src.is_quant and dst.name in FLOATS:
        return "dequantize"
    return None


def transposed(src: Tensor, dst: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """For convert_tiled: (sizes, src strides, dst strides) innermost first, in the order
    (last axis, A, B, C) where A is the source's fastest axis, when A is not the last one,
    both have one shape and dst's rows are packed; else None."""
    if src.shape != dst.shape or src.dtype.is_quant or dst.dtype.is_quant:
        return None
    (shape, ss), (_, ds) = padded(src), padded(dst)
    n, ss, ds = shape[::-1], ss[::-1], ds[::-1]
    outer = [k for k in (1, 2, 3) if n[k] > 1]
    if not outer or ds[0] != dst.dtype.block_bytes or n[0] == 1:
        return None
    a = min(outer, key=lambda k: ss[k])
    if ss[a] >= ss[0]:
        return None
    rest = [k for k in (1, 2, 3) if k != a]
    order = (0, a, *rest)
    if -(-n[a] // 32) > GRID_YZ_MAX or n[rest[0]] * n[rest[1]] > GRID_YZ_MAX:
        return None
    return tuple(n[k] for k in order), tuple(ss[k] for k in order), tuple(ds[k] for k in order)


def _tiled(kernel: str, src: Tensor, dst: Tensor, ptr: Ptr, t: tuple) -> KernelSpec:
    (n0, na, nb, nc), ss, ds = t
    return KernelSpec(ROWS_CU, kernel, (-(-n0 // 32), -(-na // 32), nb * nc), (32, 8),
                      ConvertTiledArgs(ptr(src), ptr(dst), n0, na, nb, *ss, *ds))


def copy_specs(src: Tensor, dst: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    """The launch copying src into dst (dst's own shape and strides), converting the dtype."""
    kind = copy_kind(src.dtype, dst.dtype)
    ps, pd = ptr(src), ptr(dst)
    both = src.is_contiguous() and dst.is_contiguous()
    if kind == "same":
        if both:
            align = alignment(ps, pd)
            nbytes = dst.nbytes if dst.size else 0
            # at least one block when there are bytes: it copies the tail past the last whole unit
            work = max(nbytes // align, 1) if nbytes else 0
            return [KernelSpec(ROWS_CU, instance("copy_contig", CONTIG_UNITS[align]), stride_grid(work, sms), BLOCK,
                               CopyContigArgs(src=ps, dst=pd, nbytes=nbytes))]
        unit = raw(src.dtype)
        t = transposed(src, dst)
        if t is not None:
            return [_tiled(instance("convert_tiled", unit, unit), src, dst, ptr, t)]
        n = units(src)
        return [KernelSpec(ROWS_CU, instance("convert_strided", unit, unit), stride_grid(n, sms), BLOCK,
                           StridedCopyArgs(src=ps, dst=pd, n=n, a=layout(src, True), b=layout(dst, True)))]
    if kind == "quantize":
        contig = both and ps % 16 == 0
        nblocks = units(dst)
        name = instance("quantize", QUANT[dst.dtype.name], VALUE[src.dtype.name], contig)
        # contig: rows.cu stages 16 blocks a warp (43-48 registers: 5 blocks of 256 threads fit an SM), so
        # the grid-stride grid is one wave of QUANT_BLOCKS_PER_SM blocks, not 8 (which would leave a
        # second, partial wave doing as much work per block as the first)
        per_sm = QUANT_BLOCKS_PER_SM if contig else BLOCKS_PER_SM
        grid = min(-(-nblocks * 8 // BLOCK), sms * per_sm)
        return [KernelSpec(ROWS_CU, name, grid, BLOCK,
                           QuantizeArgs(src=ps, dst=pd, nblocks=nblocks, a=layout(src), b=layout(dst, True)))]
    if kind == "dequantize":
        contig = both and pd % 16 == 0
        n = dst.size
        name = instance("dequantize", QUANT[src.dtype.name], VALUE[dst.dtype.name], contig)
        return [KernelSpec(ROWS_CU, name, stride_grid(n // 4 if contig else n, sms), BLOCK,
                           StridedCopyArgs(src=ps, dst=pd, n=n, a=layout(src, True), b=layout(dst)))]
    s, d = VALUE[src.dtype.name], VALUE[dst.dtype.name]
    if both:
        vec = alignment(ps, pd) == 16
        work = max(dst.size // 8, 1 if dst.size else 0) if vec else dst.size  # the tail: at least one block
        return [KernelSpec(ROWS_CU, instance("convert_contig", s, d, vec), stride_grid(work, sms), BLOCK,
                           ConvertContigArgs(src=ps, dst=pd, n=dst.size))]
    t = transposed(src, dst)
    if t is not None:
        return [_tiled(instance("convert_tiled", s, d), src, dst, ptr, t)]
    return [KernelSpec(ROWS_CU, instance("convert_strided", s, d), stride_grid(dst.size, sms), BLOCK,
                       StridedCopyArgs(src=ps, dst=pd, n=dst.size, a=layout(src), b=layout(dst)))]


# -- get_rows, set_rows -----------------------------------------------------------------------------


def row_block(cols: int) -> int:
    """Threads per block of get_rows_q for rows of `cols` values, 4 per thread: no more than the row needs."""
    for blk in ROW_BLOCKS:
        if 4 * blk >= cols:
            return blk
    return ROW_BLOCKS[-1]


def row_tiling(rows: int, cols: int, pack: int) -> tuple[tuple[int, int], int]:
    """get_rows / set_rows: (grid, log2 of the threads per row) for `rows` rows of `cols`
    values moved in packs of `pack`. A row gets the fewest threads (a power of two, at
    most a block) that cover it with ROW_UNROLL packs each; short rows share a block."""
    packs = -(-cols // pack)
    tpr = min(pow2(-(-packs // ROW_UNROLL)), ROW_THREADS)
    return (-(-rows // (ROW_THREADS // tpr)), -(-packs // (tpr * ROW_UNROLL))), tpr.bit_length() - 1


def row_pack(src: DType, dst: DType) -> int:
    """rows.cu's row_pack: values per 16-byte access of the wider of the two element types."""
    return 16 // max(src.block_bytes, dst.block_bytes)


def packed_rows_aligned(t: Tensor, addr: int, nbytes: int) -> bool:
    """Rows packed, their start and every outer stride used (axis longer than 1) multiples of nbytes."""
    shape, strides = padded(t)
    return (strides[3] == t.dtype.block_bytes and addr % nbytes == 0
            and all(st % nbytes == 0 for n, st in zip(shape[:3], strides[:3]) if n > 1))


def _pad3(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (1,) * (3 - t.ndim) + t.shape, (0,) * (3 - t.ndim) + t.strides


#: the longest rows the row kernels' grid.y covers (1 value per access, the worst case)
MAX_ROW = ROW_UNROLL * ROW_THREADS * GRID_YZ_MAX


def get_rows_specs(node: Tensor, ptr: Ptr, guard: Guard) -> list[KernelSpec]:
    a, idx = node.srcs
    (a3, a2, arows, cols), (as3, as2, as1, as0) = padded(a)
    (_, _, n), (is2, is1, is0) = _pad3(idx)
    rows = a3 * a2 * n
    head = dict(a=ptr(a), idx=ptr(idx), out=ptr(node), ncols=cols, n=n, a2=a2, arows=arows)
    instead = "its output row is filled with 0" if node.dtype.name == "i32" else NAN_ROW
    tail = dict(is0=is0, is1=is1, is2=is2, err_=guard(node, idx, arows, f"a row of {a.describe()}", instead))
    if a.dtype.is_quant:
        blk = row_block(cols)
        return [KernelSpec(ROWS_CU, instance("get_rows_q", QUANT[a.dtype.name]), (rows, -(-cols // (4 * blk))), blk,
                           GetRowsQArgs(**head, as1=as1, as2=as2, as3=as3, **tail))]
    pack = row_pack(a.dtype, node.dtype)
    vec = (cols % pack == 0 and ptr(node) % 16 == 0
           and packed_rows_aligned(a, ptr(a), pack * a.dtype.block_bytes))
    grid, tpr_log2 = row_tiling(rows, cols, pack if vec else 1)
    s = VALUE[a.dtype.name]
    return [KernelSpec(ROWS_CU, instance("get_rows", s, "int" if s == "int" else "float", vec), grid, ROW_THREADS,
                       GetRowsArgs(**head, nrows=rows, tpr_log2=tpr_log2, as0=as0, as1=as1, as2=as2, as3=as3,
                                   **tail))]


def set_rows_specs(node: Tensor, ptr: Ptr, guard: Guard) -> list[KernelSpec]:
    dst, src, idx = node.srcs
    (d3, d2, drows, cols), (ds3, ds2, ds1, ds0) = padded(node)
    (_, _, n, _), ss = padded(src)
    (i2, i1, _), (is2, is1, is0) = _pad3(idx)
    itype = index_type(idx)
    psrc = ptr(src)
    common = dict(src=psrc, idx=ptr(idx), dst=ptr(node), n=n, d2=d2, ni1=i1, ni2=i2, drows=drows,
                  ss0=ss[3], ss1=ss[2], ss2=ss[1], ss3=ss[0], is0=is0, is1=is1, is2=is2, ds1=ds1, ds2=ds2, ds3=ds3,
                  err_=guard(node, idx, drows, f"a row of {dst.describe()}", NOT_WRITTEN))
    rows = d3 * d2 * n
    if node.dtype.is_quant:
        nblocks = cols // node.dtype.block_size
        warps = min(8, -(-nblocks // 4))
        vec = (ss[3] == 4 and psrc % 16 == 0
               and all(s % 16 == 0 for k, s in enumerate(ss[:3]) if pad4(src.shape)[k] > 1))
        name = instance("set_rows_q", QUANT[node.dtype.name], itype, vec)
        return [KernelSpec(ROWS_CU, name, (rows, -(-nblocks // (4 * warps))), 32 * warps,
                           SetRowsQArgs(nblocks=nblocks, **common))]
    pack = row_pack(src.dtype, node.dtype)
    vec = (cols % pack == 0 and packed_rows_aligned(src, psrc, pack * 4)
           and packed_rows_aligned(node, ptr(node), pack * node.dtype.block_bytes))
    grid, tpr_log2 = row_tiling(rows, cols, pack if vec else 1)
    return [KernelSpec(ROWS_CU, instance("set_rows", VALUE[node.dtype.name], itype, vec), grid, ROW_THREADS,
                       SetRowsArgs(ncols=cols, nrows=rows, tpr_log2=tpr_log2, ds0=ds0, **common))]
