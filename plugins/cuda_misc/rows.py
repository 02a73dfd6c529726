"""cuda_misc's rows, copies, layout ops, reductions and sorts; the top-k MoE and greedy-pick fusions.

Ops: cpy/dup/cont (every pair of f32, f16, bf16, i32; f32/f16/bf16 to and
from the block formats, quantized on the device with ggml's rounding; any
dtype copied as it is), get_rows, set_rows, concat, repeat, pad,
pad_reflect_1d, roll, arange, fill, diag, tri, set, acc, timestep_embedding
(kernels/rows.cu); sum, sum_rows, mean, cumsum, argmax (one block a row, or
split over blocks for few long rows), count_equal and the fused greedy pick
(kernels/reduce.cu); argsort, top_k and the fused MoE router (kernels/sort.cu).
The device-side block formats, bit-exact with opdispatch.dtypes, are the
shared quant.cuh (opdispatch.backends.cuda); kernels/index.cuh holds the index arithmetic.

Each op has a support predicate: a table of (condition, reason) read top to
bottom, after ggml's supports_op, looking only at shapes, strides and dtypes
(so plans can be made and tested on a device description). Each bind is
split in two: a pure `*_specs` function picks the kernel instances, grids,
blocks and arguments from shapes, strides and addresses (tested without a
GPU), and `_launch` makes the pre-bound launches. The plugin's
`__init__.py` yields `KERNELS` and `FUSIONS` and merges `KERNEL_SOURCES`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from opdispatch.backends.cuda.kernels import KernelSpec, Workspace, alloc_workspaces, chain
from opdispatch.backends.base import Device, Launch
from opdispatch.dtypes import DTYPES, DType
from opdispatch.fusion import FusionRule
from opdispatch.graph import Graph
from opdispatch.hookspecs import Kernel
from opdispatch.ops.base import FLOATS, QUANTS, pad4
from opdispatch.tensor import Tensor

if TYPE_CHECKING:
    from opdispatch.backends.cuda.backend import CudaContext

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
ROWS_CU = KERNEL_DIR / "rows.cu"
REDUCE_CU = KERNEL_DIR / "reduce.cu"
SORT_CU = KERNEL_DIR / "sort.cu"

INT_MAX = 2**31 - 1
#: threads per block of the grid-stride kernels
BLOCK = 256
#: blocks per SM the grid-stride kernels launch at most: one wave of 256-thread blocks (then threads loop)
BLOCKS_PER_SM = 8
#: the same for the contiguous quantize (rows.cu's staged path): as many blocks as stay resident together
QUANT_BLOCKS_PER_SM = 4
#: partials of the whole-tensor reductions (reduce.cu's MAX_PARTIALS)
MAX_PARTIALS = 1024

Ptr = Callable[[Tensor], int]
Rule = tuple[Callable[[Tensor], bool], str]

# -- C++ names -----------------------------------------------------------------------------

#: the C++ type a kernel reads each plain dtype's values as
VALUE = {"f32": "float", "f16": "od::f16", "bf16": "od::bf16", "i32": "int"}
#: the format traits of each block format (quant.cuh)
QUANT = {q: f"od::quant::{q}" for q in QUANTS}
#: conversions through f32 between these
PLAIN = ("f32", "f16", "bf16", "i32")
#: raw copy units by element size
RAW = {1: "unsigned char", 2: "unsigned short", 4: "unsigned", 8: "unsigned long long"}
#: copy_contig's units by the alignment both addresses share
CONTIG_UNITS = {16: "uint4", 4: "unsigned", 2: "unsigned short", 1: "unsigned char"}


def raw(dt: DType) -> str:
    """The raw unit a same-dtype copy moves: one element, or one block of a block format."""
    return f"od::rows::Block<{dt.block_bytes}>" if dt.is_quant else RAW[dt.block_bytes]


def b(flag: bool) -> str:
    return "true" if flag else "false"


def tmpl(name: str, *params: object) -> str:
    return f"{name}<{', '.join(str(p) for p in params)}>"


# -- instances: every template instance a spec can name, per source file -------------------

RAW_DTYPES = ("i8", "i16", "f32", "i64", *QUANTS)  # one per raw unit
ROW_BLOCKS = (32, 64, 128, 256)  # get_rows_q threads per block: any, one module
ROW_THREADS = 256  # rows.cu's ROW_THREADS: threads per block of get_rows / set_rows
ROW_UNROLL = 4  # rows.cu's ROW_UNROLL: packs per thread


def _rows_instances() -> tuple[str, ...]:
    names = [tmpl("copy_contig", u) for u in CONTIG_UNITS.values()]
    for s in PLAIN:
        for d in PLAIN:
            if s != d:
                names += [tmpl("convert_contig", VALUE[s], VALUE[d], b(v)) for v in (False, True)]
                names += [tmpl("convert_strided", VALUE[s], VALUE[d]), tmpl("convert_tiled", VALUE[s], VALUE[d])]
    names += [tmpl("convert_strided", raw(DTYPES[t]), raw(DTYPES[t])) for t in RAW_DTYPES]
    names += [tmpl("convert_tiled", u, u) for u in RAW.values()]
    for q in QUANTS:
        for f in FLOATS:
            names += [tmpl("quantize", QUANT[q], VALUE[f], b(c)) for c in (False, True)]
            names += [tmpl("dequantize", QUANT[q], VALUE[f], b(c)) for c in (False, True)]
    names += [tmpl("get_rows", VALUE[s], "int" if s == "i32" else "float", b(v)) for s in PLAIN for v in (False, True)]
    names += [tmpl("get_rows_q", QUANT[q]) for q in QUANTS]
    names += [tmpl("set_rows", VALUE[d], i, b(v)) for d in FLOATS for i in ("int", "long long") for v in (False, True)]
    names += [tmpl("set_rows_q", QUANT[q], i, b(v))
              for q in QUANTS for i in ("int", "long long") for v in (False, True)]
    names += [tmpl("concat", raw(DTYPES[t])) for t in RAW_DTYPES]
    names += [tmpl("repeat", RAW[n]) for n in (2, 4)]
    names += ["pad", "pad_reflect_1d", "roll", "arange", "diag", "tri", "timestep_embedding"]
    names += [tmpl("fill", VALUE[d]) for d in ("f32", "f16")]
    names += [tmpl("set_window", "float", "true"), tmpl("set_window", "float", "false"),
              tmpl("set_window", "int", "false")]
    return tuple(names)


ROW_REDUCE_BLOCKS = (32, 128, 256, 1024)
SORT_BLOCKS = (32, 128, 512, 1024)
#: sort_rows_warp's (values per lane K, warps per row): one warp up to 512 values, then 16 per lane
WARP_SORTS = ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (16, 2), (16, 4), (16, 8))
WARP_SORT_MAX = 32 * 16 * 8
MOE_NPL = (1, 2, 4, 8, 16, 32)


def _reduce_instances() -> tuple[str, ...]:
    names = [tmpl("sum_rows", blk, b(mean), b(vec)) for blk in ROW_REDUCE_BLOCKS for mean in (False, True)
             for vec in (False, True)]
    names += [tmpl("cumsum", blk) for blk in ROW_REDUCE_BLOCKS]
    names += [tmpl("argmax", blk) for blk in ROW_REDUCE_BLOCKS]
    names += [tmpl("argmax_split", b(vec), i) for vec in (False, True) for i in ("int", "long long")]
    names += [tmpl("sum_all", VALUE[f], b(c)) for f in FLOATS for c in (False, True)]
    names.append("count_equal")
    return tuple(names)


def _sort_instances() -> tuple[str, ...]:
    names = [tmpl("sort_rows_warp", *kw) for kw in WARP_SORTS]
    names += [tmpl("sort_chunks", blk) for blk in SORT_BLOCKS]
    names += ["merge_step", tmpl("merge_chunks", 1024), tmpl("topk_select", 1024)]
    names += [tmpl("topk_moe", n) for n in MOE_NPL]
    return tuple(names)


#: each .cu file and the instances launched from it (tests/test_kernels_compile.py compiles them all)
KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {
    ROWS_CU: _rows_instances(),
    REDUCE_CU: _reduce_instances(),
    SORT_CU: _sort_instances(),
}

# -- index arithmetic -----------------------------------------------------------------------


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


def _padded(t: Tensor, blocks: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape (the last axis in blocks if `blocks`) and byte strides, padded to 4 axes."""
    shape = list(pad4(t.shape))
    if blocks:
        shape[-1] //= t.dtype.block_size
    return tuple(shape), (0,) * (4 - t.ndim) + tuple(t.strides)


def layout_of(shape: Sequence[int], strides: Sequence[int]) -> tuple[np.generic, ...]:
    """OD_LAYOUT's 13 arguments for a 4-d (shape, byte strides): sizes n0, n1, n2
    innermost first as divisors, then strides s0..s3."""
    out: list[np.generic] = []
    for n in (shape[3], shape[2], shape[1]):
        out += [np.uint32(v) for v in fastdiv(n)]
    return (*out, *(np.int64(s) for s in reversed(strides)))


def layout(t: Tensor, blocks: bool = False) -> tuple[np.generic, ...]:
    return layout_of(*_padded(t, blocks))


def shape_layout(shape: Sequence[int]) -> tuple[np.generic, ...]:
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


def u64(x: int) -> np.uint64:
    return np.uint64(x)


# -- launches --------------------------------------------------------------------------------






def _launch(ctx: CudaContext, specs: Sequence[KernelSpec]) -> Launch:
    return chain(s.launch(ctx.stream) for s in specs)


def sm_count(device: Device) -> int:
    return int(device.props.get("sm_count", 132))


def smem_limit(device: Device) -> int:
    """Dynamic shared memory a block may use (opted in above 48 KiB by the launcher)."""
    return int(device.props.get("smem_per_block_optin", device.props.get("smem_per_block", 48 * 1024)))


# -- support tables ---------------------------------------------------------------------------


def first_failure(node: Tensor, rules: Iterable[Rule]) -> bool | str:
    """True if every condition holds for `node`, else the reason of the first that does not."""
    for holds, reason in rules:
        if not holds(node):
            return reason
    return True


def aligned(t: Tensor) -> bool:
    """Strides and offset in whole accesses: elements of plain types, 16-bit words of block formats."""
    unit = 2 if t.dtype.is_quant else t.dtype.block_bytes
    return t.view_offset % unit == 0 and all(s % unit == 0 for s in t.strides)


def small(t: Tensor) -> bool:
    """Flat indices fit the kernels' 32-bit unravel."""
    return t.size <= INT_MAX


def _src(i: int) -> Callable[[Tensor], Tensor]:
    return lambda n: n.srcs[i]


def dtype_in(names: Sequence[str], what: Callable[[Tensor], Tensor] = lambda n: n) -> Callable[[Tensor], bool]:
    return lambda n: what(n).dtype.name in names


def _rules(*rules: Rule) -> Callable[[Device, Tensor], bool | str]:
    def supports(device: Device, node: Tensor) -> bool | str:
        return first_failure(node, rules)

    return supports


# ==================================================================================================
# Copies: cpy, dup, cont


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


def _contiguous_pair(n: Tensor) -> bool:
    return n.srcs[0].is_contiguous() and n.is_contiguous()


supports_copy = _rules(
    (lambda n: copy_kind(n.srcs[0].dtype, n.dtype) is not None, "no kernel converts this pair of dtypes"),
    (lambda n: aligned(n.srcs[0]) and aligned(n), "strides or offsets that split an element"),
    (lambda n: small(n) or (_contiguous_pair(n) and not (n.dtype.is_quant or n.srcs[0].dtype.is_quant)),
     "strided or quantizing copies of 2**31 elements or more"),
)


def transposed(src: Tensor, dst: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """For convert_tiled: (sizes, src strides, dst strides) innermost first, in the order
    (last axis, A, B, C) where A is the source's fastest axis, when A is not the last one,
    both have one shape and dst's rows are packed; else None."""
    if src.shape != dst.shape or src.dtype.is_quant or dst.dtype.is_quant:
        return None
    (shape, ss), (_, ds) = _padded(src), _padded(dst)
    n, ss, ds = shape[::-1], ss[::-1], ds[::-1]
    outer = [k for k in (1, 2, 3) if n[k] > 1]
    if not outer or ds[0] != dst.dtype.block_bytes or n[0] == 1:
        return None
    a = min(outer, key=lambda k: ss[k])
    if ss[a] >= ss[0]:
        return None
    rest = [k for k in (1, 2, 3) if k != a]
    order = (0, a, *rest)
    if -(-n[a] // 32) > 65535 or n[rest[0]] * n[rest[1]] > 65535:
        return None
    return tuple(n[k] for k in order), tuple(ss[k] for k in order), tuple(ds[k] for k in order)


def _tiled(kernel: str, src: Tensor, dst: Tensor, ptr: Ptr, t: tuple) -> KernelSpec:
    (n0, na, nb, nc), ss, ds = t
    return KernelSpec(ROWS_CU, kernel, (-(-n0 // 32), -(-na // 32), nb * nc), (32, 8),
                (u64(ptr(src)), u64(ptr(dst)), np.uint32(n0), np.uint32(na), np.uint32(nb),
                 *(np.int64(v) for v in ss), *(np.int64(v) for v in ds)))


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
            return [KernelSpec(ROWS_CU, tmpl("copy_contig", CONTIG_UNITS[align]), stride_grid(work, sms), BLOCK,
                         (u64(ps), u64(pd), np.int64(nbytes)))]
        unit = raw(src.dtype)
        t = transposed(src, dst)
        if t is not None:
            return [_tiled(tmpl("convert_tiled", unit, unit), src, dst, ptr, t)]
        n = units(src)
        return [KernelSpec(ROWS_CU, tmpl("convert_strided", unit, unit), stride_grid(n, sms), BLOCK,
                     (u64(ps), u64(pd), np.uint32(n), *layout(src, True), *layout(dst, True)))]
    if kind == "quantize":
        contig = both and ps % 16 == 0
        nblocks = units(dst)
        name = tmpl("quantize", QUANT[dst.dtype.name], VALUE[src.dtype.name], b(contig))
        # contig: rows.cu stages 16 blocks a warp (43-48 registers: 5 blocks of 256 threads fit an SM), so
        # the grid-stride grid is one wave of QUANT_BLOCKS_PER_SM blocks, not 8 (which would leave a
        # second, partial wave doing as much work per block as the first)
        per_sm = QUANT_BLOCKS_PER_SM if contig else BLOCKS_PER_SM
        grid = min(-(-nblocks * 8 // BLOCK), sms * per_sm)
        return [KernelSpec(ROWS_CU, name, grid, BLOCK,
                     (u64(ps), u64(pd), np.uint32(nblocks), *layout(src), *layout(dst, True)))]
    if kind == "dequantize":
        contig = both and pd % 16 == 0
        n = dst.size
        name = tmpl("dequantize", QUANT[src.dtype.name], VALUE[dst.dtype.name], b(contig))
        return [KernelSpec(ROWS_CU, name, stride_grid(n // 4 if contig else n, sms), BLOCK,
                     (u64(ps), u64(pd), np.uint32(n), *layout(src, True), *layout(dst)))]
    s, d = VALUE[src.dtype.name], VALUE[dst.dtype.name]
    if both:
        vec = alignment(ps, pd) == 16
        work = max(dst.size // 8, 1 if dst.size else 0) if vec else dst.size  # the tail: at least one block
        return [KernelSpec(ROWS_CU, tmpl("convert_contig", s, d, b(vec)), stride_grid(work, sms), BLOCK,
                     (u64(ps), u64(pd), np.int64(dst.size)))]
    t = transposed(src, dst)
    if t is not None:
        return [_tiled(tmpl("convert_tiled", s, d), src, dst, ptr, t)]
    return [KernelSpec(ROWS_CU, tmpl("convert_strided", s, d), stride_grid(dst.size, sms), BLOCK,
                 (u64(ps), u64(pd), np.uint32(dst.size), *layout(src), *layout(dst)))]


def bind_copy(ctx: CudaContext, node: Tensor) -> Launch:
    # cpy's result aliases its second source: writing `node` writes b.
    return _launch(ctx, copy_specs(node.srcs[0], node, ctx.ptr, sm_count(ctx.device)))


# ==================================================================================================
# get_rows, set_rows


def row_block(cols: int) -> int:
    """Threads per block of get_rows_q for rows of `cols` values, 4 per thread: no more than the row needs."""
    for blk in ROW_BLOCKS:
        if 4 * blk >= cols:
            return blk
    return ROW_BLOCKS[-1]


def row_tiling(rows: int, cols: int, pack: int) -> tuple[tuple[int, int], np.int32]:
    """get_rows / set_rows: (grid, log2 of the threads per row) for `rows` rows of `cols`
    values moved in packs of `pack`. A row gets the fewest threads (a power of two, at
    most a block) that cover it with ROW_UNROLL packs each; short rows share a block."""
    packs = -(-cols // pack)
    tpr = min(pow2(-(-packs // ROW_UNROLL)), ROW_THREADS)
    return (-(-rows // (ROW_THREADS // tpr)), -(-packs // (tpr * ROW_UNROLL))), np.int32(tpr.bit_length() - 1)


def row_pack(src: DType, dst: DType) -> int:
    """rows.cu's row_pack: values per 16-byte access of the wider of the two element types."""
    return 16 // max(src.block_bytes, dst.block_bytes)


def packed_rows_aligned(t: Tensor, addr: int, nbytes: int) -> bool:
    """Rows packed, their start and every outer stride used (axis longer than 1) multiples of nbytes."""
    shape, strides = _padded(t)
    return (strides[3] == t.dtype.block_bytes and addr % nbytes == 0
            and all(st % nbytes == 0 for n, st in zip(shape[:3], strides[:3]) if n > 1))


def _pad3(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (1,) * (3 - t.ndim) + t.shape, (0,) * (3 - t.ndim) + t.strides


def _packed_rows(t: Tensor) -> bool:
    """A block format's rows hold their blocks back to back."""
    return not t.dtype.is_quant or t.rows_contiguous()


#: the longest rows the row kernels' grid.y covers (1 value per access, the worst case)
MAX_ROW = ROW_UNROLL * ROW_THREADS * 65535

supports_get_rows = _rules(
    (dtype_in(PLAIN + QUANTS, _src(0)), "a must be f32, f16, bf16, i32 or a block format"),
    (dtype_in(("i32",), _src(1)), "indices must be i32"),
    (lambda n: _packed_rows(n.srcs[0]), "quantized rows must be packed"),
    (lambda n: aligned(n.srcs[0]) and aligned(n.srcs[1]), "strides or offsets that split an element"),
    (lambda n: math.prod(n.shape[:-1]) <= INT_MAX, "at most 2**31 - 1 rows"),
    (lambda n: n.shape[-1] <= MAX_ROW, "rows longer than the grid covers"),
)


def get_rows_specs(node: Tensor, ptr: Ptr) -> list[KernelSpec]:
    a, idx = node.srcs
    (a3, a2, arows, cols), (as3, as2, as1, as0) = _padded(a)
    (_, _, n), (is2, is1, is0) = _pad3(idx)
    rows = a3 * a2 * n
    head = (u64(ptr(a)), u64(ptr(idx)), u64(ptr(node)), np.int32(cols), np.uint32(n), np.uint32(a2),
            np.int64(arows))
    tail = (np.int64(is0), np.int64(is1), np.int64(is2))
    if a.dtype.is_quant:
        blk = row_block(cols)
        return [KernelSpec(ROWS_CU, tmpl("get_rows_q", QUANT[a.dtype.name]), (rows, -(-cols // (4 * blk))), blk,
                     (*head, np.int64(as1), np.int64(as2), np.int64(as3), *tail))]
    pack = row_pack(a.dtype, node.dtype)
    vec = (cols % pack == 0 and ptr(node) % 16 == 0
           and packed_rows_aligned(a, ptr(a), pack * a.dtype.block_bytes))
    grid, tpr_log2 = row_tiling(rows, cols, pack if vec else 1)
    s = VALUE[a.dtype.name]
    return [KernelSpec(ROWS_CU, tmpl("get_rows", s, "int" if s == "int" else "float", b(vec)), grid, ROW_THREADS,
                 (*head, np.uint32(rows), tpr_log2, np.int64(as0), np.int64(as1), np.int64(as2), np.int64(as3),
                  *tail))]


def bind_get_rows(ctx: CudaContext, node: Tensor) -> Launch:
    return _launch(ctx, get_rows_specs(node, ctx.ptr))


supports_set_rows = _rules(
    (dtype_in(FLOATS + QUANTS), "dst must be f32, f16, bf16 or a block format"),
    (dtype_in(("f32",), _src(1)), "src must be f32"),
    (dtype_in(("i32", "i64"), _src(2)), "indices must be i32 or i64"),
    (lambda n: _packed_rows(n), "quantized rows must be packed"),
    (lambda n: all(aligned(t) for t in n.srcs), "strides or offsets that split an element"),
    (lambda n: math.prod(n.srcs[1].shape[:-1]) <= INT_MAX, "at most 2**31 - 1 rows"),
    (lambda n: n.shape[-1] <= MAX_ROW, "rows longer than the grid covers"),
)


def set_rows_specs(node: Tensor, ptr: Ptr) -> list[KernelSpec]:
    dst, src, idx = node.srcs
    (d3, d2, drows, cols), (ds3, ds2, ds1, ds0) = _padded(node)
    (_, _, n, _), ss = _padded(src)
    (i2, i1, _), (is2, is1, is0) = _pad3(idx)
    itype = "int" if idx.dtype.name == "i32" else "long long"
    psrc = ptr(src)
    head = (u64(psrc), u64(ptr(idx)), u64(ptr(node)))
    batch = (np.uint32(n), np.uint32(d2), np.uint32(i1), np.uint32(i2), np.int64(drows))
    strides = (*(np.int64(s) for s in reversed(ss)), np.int64(is0), np.int64(is1), np.int64(is2))
    rows = d3 * d2 * n
    if node.dtype.is_quant:
        nblocks = cols // node.dtype.block_size
        warps = min(8, -(-nblocks // 4))
        vec = (ss[3] == 4 and psrc % 16 == 0
               and all(s % 16 == 0 for k, s in enumerate(ss[:3]) if pad4(src.shape)[k] > 1))
        name = tmpl("set_rows_q", QUANT[node.dtype.name], itype, b(vec))
        return [KernelSpec(ROWS_CU, name, (rows, -(-nblocks // (4 * warps))), 32 * warps,
                     (*head, np.int32(nblocks), *batch, *strides, np.int64(ds1), np.int64(ds2), np.int64(ds3)))]
    pack = row_pack(src.dtype, node.dtype)
    vec = (cols % pack == 0 and packed_rows_aligned(src, psrc, pack * 4)
           and packed_rows_aligned(node, ptr(node), pack * node.dtype.block_bytes))
    grid, tpr_log2 = row_tiling(rows, cols, pack if vec else 1)
    return [KernelSpec(ROWS_CU, tmpl("set_rows", VALUE[node.dtype.name], itype, b(vec)), grid, ROW_THREADS,
                 (*head, np.int32(cols), *batch, np.uint32(rows), tpr_log2, *strides,
                  np.int64(ds0), np.int64(ds1), np.int64(ds2), np.int64(ds3)))]


def bind_set_rows(ctx: CudaContext, node: Tensor) -> Launch:
    return _launch(ctx, set_rows_specs(node, ctx.ptr))


# ==================================================================================================
# Layout ops: concat, repeat, pad, pad_reflect_1d, roll, arange, fill, diag, tri, set, acc,
# timestep_embedding. Results are contiguous; flat indices are unravelled over the result's shape.


def _flat(node: Tensor, ptr: Ptr, sms: int, kernel: str, srcs: Sequence[Tensor], *extra: np.generic,
          blocks: bool = False) -> list[KernelSpec]:
    """A grid-stride kernel over the result's units: sources' addresses, out, n, out's shape, extra args."""
    n = units(node)
    shape = list(pad4(node.shape))
    if blocks:
        shape[-1] //= node.dtype.block_size
    args = (*(u64(ptr(s)) for s in srcs), u64(ptr(node)), np.uint32(n), *shape_layout(shape), *extra)
    return [KernelSpec(ROWS_CU, kernel, stride_grid(n, sms), BLOCK, args)]


def _strides(t: Tensor) -> tuple[np.int64, ...]:
    """Byte strides innermost first, padded to 4."""
    return tuple(np.int64(s) for s in reversed(_padded(t)[1]))


def _dims(t: Tensor, blocks: bool = False) -> tuple[np.uint32, ...]:
    """Sizes innermost first, padded to 4."""
    return tuple(np.uint32(n) for n in reversed(_padded(t, blocks)[0]))


def _inner_axis(t: Tensor, axis: int) -> int:
    """A numpy axis of t as an index innermost first."""
    return t.ndim - 1 - axis


_F32_IN_OUT = ((dtype_in(("f32",), _src(0)), "x must be f32"), (lambda n: aligned(n.srcs[0]), "misaligned strides"),
               (small, "2**31 elements or more"))


supports_concat = _rules(
    (lambda n: all(aligned(s) for s in n.srcs), "strides or offsets that split an element"),
    (small, "2**31 elements or more"),
)


def concat_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    a, bb = node.srcs
    axis = node.params["axis"]
    quant = node.dtype.is_quant
    alen = a.shape[axis] // (a.dtype.block_size if axis == a.ndim - 1 else 1)
    return _flat(node, ptr, sms, tmpl("concat", raw(node.dtype)), (a, bb), np.int32(_inner_axis(a, axis)),
                 np.uint32(alen), *_strides(a), *_strides(bb), blocks=quant)


supports_repeat = _rules(
    (dtype_in(("f32", "f16", "bf16", "i16", "i32"), _src(0)), "a must be f32, f16, bf16, i16 or i32"),
    (lambda n: aligned(n.srcs[0]), "strides or offsets that split an element"),
    (small, "2**31 elements or more"),
)


def repeat_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    a = node.srcs[0]
    pa = (1,) * (node.ndim - a.ndim) + a.shape
    dims = tuple(np.uint32(x) for x in reversed(pad4(pa)))
    return _flat(node, ptr, sms, tmpl("repeat", RAW[a.dtype.block_bytes]), (a,), *dims, *_strides(a))


supports_f32_layout = _rules(*_F32_IN_OUT)


def pad_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    lo = (0,) * (4 - x.ndim) + tuple(p[0] for p in node.params["pads"])
    return _flat(node, ptr, sms, "pad", (x,), *_dims(x), *(np.uint32(v) for v in reversed(lo)), *_strides(x))


def pad_reflect_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    return _flat(node, ptr, sms, "pad_reflect_1d", (x,), np.int32(x.shape[-1]), np.int32(node.params["p0"]),
                 *_strides(x))


def roll_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    shifts = (0,) * (4 - x.ndim) + tuple(s % max(n, 1) for s, n in zip(node.params["shifts"], x.shape))
    return _flat(node, ptr, sms, "roll", (x,), *(np.uint32(s) for s in reversed(shifts)), *_strides(x))


def diag_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    # x (.., 1, N) or (N,): its axis -2 is never stepped, out's axes -3, -4 read x's -3, -4
    xs = (0,) * (4 - x.ndim) + x.strides if x.ndim >= 2 else (0, 0, 0, x.strides[0])
    return _flat(node, ptr, sms, "diag", (x,), np.int64(xs[3]), np.int64(xs[1]), np.int64(xs[0]))


TRI_CODES = {"lower": 0, "lower_diag": 1, "upper": 2, "upper_diag": 3}


def tri_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    return _flat(node, ptr, sms, "tri", (x,), np.int32(TRI_CODES[node.params["kind"]]), *_strides(x))


def arange_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    p = node.params
    n = node.shape[0]
    return [KernelSpec(ROWS_CU, "arange", stride_grid(n, sms), BLOCK,
                 (u64(ptr(node)), np.uint32(n), np.float32(p["start"]), np.float32(p["step"])))]


supports_arange = _rules((small, "2**31 elements or more"))
supports_fill = _rules((dtype_in(("f32", "f16")), "the result must be f32 or f16"))


def fill_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    return [KernelSpec(ROWS_CU, tmpl("fill", VALUE[node.dtype.name]), stride_grid(node.size, sms), BLOCK,
                 (u64(ptr(node)), np.int64(node.size), np.float32(node.params["value"])))]


def window(node: Tensor) -> tuple[list[int], list[int], list[int]] | None:
    """set/acc's window as rows.cu's set_window takes it: (sizes, element strides,
    b's byte strides), axes of size > 1 sorted by window stride, largest first, padded
    to 4 with (1, 2**40, 0). None if two window positions share an element."""
    a, bt = node.srcs
    isz = a.dtype.block_bytes
    axes = sorted(((st // isz, nb, bs) for nb, st, bs in zip(bt.shape, node.params["strides"], bt.strides) if nb > 1),
                  reverse=True)
    span = 0  # elements covered by the axes after this one, minus one
    for st, nb, _ in reversed(axes):
        if st <= span:
            return None
        span += (nb - 1) * st
    axes = [(1 << 40, 1, 0)] * (4 - len(axes)) + axes
    return [nb for _, nb, _ in axes], [st for st, _, _ in axes], [bs for _, _, bs in axes]


supports_set_acc = _rules(
    (lambda n: all(aligned(s) for s in n.srcs), "strides or offsets that split an element"),
    (small, "2**31 elements or more"),
    (lambda n: window(n) is not None, "the window overlaps itself"),
)


def set_acc_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    a, bt = node.srcs
    sizes, wstrides, bstrides = window(node)  # type: ignore[misc]
    # set copies f32 or i32 values as they are; acc adds f32
    name = tmpl("set_window", "int" if a.dtype.name == "i32" else "float", b(node.op == "acc"))
    n = node.size
    args = (u64(ptr(a)), u64(ptr(bt)), u64(ptr(node)), np.uint32(n), *layout(a),
            np.int64(node.params["offset"] // a.dtype.block_bytes), *(np.int64(s) for s in wstrides),
            *(np.uint32(s) for s in sizes), *(np.int64(s) for s in bstrides))
    return [KernelSpec(ROWS_CU, name, stride_grid(n, sms), BLOCK, args)]


supports_timestep = _rules(*_F32_IN_OUT)


def timestep_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    t = node.srcs[0]
    rows, dim = node.shape
    return [KernelSpec(ROWS_CU, "timestep_embedding", stride_grid(node.size, sms), BLOCK,
                 (u64(ptr(t)), u64(ptr(node)), np.int32(rows), np.int32(dim), np.int64(t.strides[0]),
                  np.float64(math.log(node.params["max_period"]))))]


def _binder(specs: Callable[[Tensor, Ptr, int], list[KernelSpec]]) -> Callable[[CudaContext, Tensor], Launch]:
    def bind(ctx: CudaContext, node: Tensor) -> Launch:
        return _launch(ctx, specs(node, ctx.ptr, sm_count(ctx.device)))

    bind.__name__ = f"bind_{specs.__name__.removesuffix('_specs')}"
    return bind


# ==================================================================================================
# Reductions: sum, sum_rows, mean, cumsum, argmax, count_equal


def _rows_of(x: Tensor) -> tuple[int, int, int, tuple[int, ...]]:
    """(row length, n1, n2, byte strides innermost first) of x read row by row."""
    (n3, n2, n1, n0), strides = _padded(x)
    return n0, n1, n2, tuple(reversed(strides))


def _row_args(x: Tensor) -> tuple[np.generic, ...]:
    n0, n1, n2, st = _rows_of(x)
    return (np.int32(n0), np.uint32(max(n1, 1)), np.uint32(max(n2, 1)), *(np.int64(s) for s in st))


def reduce_block(cols: int) -> int:
    for blk, most in ((32, 128), (128, 1024), (256, 8192)):
        if cols <= most:
            return blk
    return 1024


_F32_ROWS = (
    (dtype_in(("f32",), _src(0)), "x must be f32"),
    (lambda n: aligned(n.srcs[0]), "strides or offsets that split an element"),
    (lambda n: math.prod(n.srcs[0].shape[:-1]) <= INT_MAX, "at most 2**31 - 1 rows"),
    (lambda n: n.srcs[0].shape[-1] <= INT_MAX, "rows of 2**31 elements or more"),
)

supports_row_reduce = _rules(*_F32_ROWS)


def _vec_rows(x: Tensor, ptr: Ptr) -> bool:
    """Rows packed and each starting 16-byte aligned."""
    shape, strides = _padded(x)
    return (x.rows_contiguous() and ptr(x) % 16 == 0
            and all(s % 16 == 0 for n, s in zip(shape[:3], strides[:3]) if n > 1))


def sum_rows_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    cols = x.shape[-1]
    vec = _vec_rows(x, ptr)
    blk = reduce_block(cols // 4 if vec else cols)
    name = tmpl("sum_rows", blk, b(node.op == "mean"), b(vec))
    rows = math.prod(x.shape[:-1]) if cols else 0
    return [KernelSpec(REDUCE_CU, name, rows, blk, (u64(ptr(x)), u64(ptr(node)), *_row_args(x)))]


def cumsum_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    cols = x.shape[-1]
    blk = reduce_block(-(-cols // 4))
    rows = math.prod(x.shape[:-1]) if cols else 0
    return [KernelSpec(REDUCE_CU, tmpl("cumsum", blk), rows, blk, (u64(ptr(x)), u64(ptr(node)), *_row_args(x)))]


def _argmax_rows(x: Tensor) -> tuple[int, int, int]:
    """(rows, columns, row stride in bytes) of argmax's f32 (R, C) or (C,) input."""
    return (x.shape[0], x.shape[1], x.strides[0]) if x.ndim == 2 else (1, x.shape[0], 0)


def argmax_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    """argmax with one block a row (reduce.cu's argmax): many rows, or short ones."""
    x = node.srcs[0]
    rows, cols, s1 = _argmax_rows(x)
    blk = reduce_block(cols)
    return [KernelSpec(REDUCE_CU, tmpl("argmax", blk), rows if cols else 0, blk,
                 (u64(ptr(x)), u64(ptr(node)), np.int32(cols), np.int64(x.strides[-1]), np.int64(s1)))]


#: threads per block of reduce.cu's argmax_split (its SPLIT_BLOCK)
SPLIT_BLOCK = 128
#: the fewest columns a block of argmax_split takes: a float4 a thread, or its merge costs more than it saves
SPLIT_MIN_COLS = 4 * SPLIT_BLOCK


def split_shape(rows: int, cols: int, sms: int) -> tuple[int, int]:
    """(blocks a row, columns a block: a multiple of 4) of argmax_split: the rows' blocks together about
    fill the SMs once (one block cannot keep enough of a long row's loads in flight), each taking at
    least SPLIT_MIN_COLS columns. (1, cols rounded up to 4) where one block a row is the best it can do."""
    want = max(1, min(-(-sms // max(rows, 1)), cols // SPLIT_MIN_COLS))
    chunk = max(4, -(-cols // (4 * want)) * 4)  # cols / want rounded up to 4: float4s never straddle blocks
    return max(1, -(-cols // chunk)), chunk


def argmax_splits(node: Tensor, sms: int) -> bool:
    """Does argmax_split (several blocks a row) run this argmax, rather than one block a row?"""
    rows, cols, _ = _argmax_rows(node.srcs[0])
    return split_shape(rows, cols, sms)[0] > 1


def argmax_workspaces(rows: int, nblk: int) -> tuple[Workspace, ...]:
    """argmax_split's partials (a (value, index) pair per block) and per-row counters (zeroed at bind); none
    with one block a row."""
    if nblk == 1:
        return ()
    return (Workspace(rows * nblk * 8, "argmax partials"), Workspace(rows * 4, "argmax row counters", zeroed=True))


def argmax_split_specs(x: Tensor, out: Tensor, ptr: Ptr, ws: Sequence[int], sms: int,
                       out_f32: Tensor | None = None, log: Tensor | None = None) -> list[KernelSpec]:
    """reduce.cu's argmax_split of x's rows into the contiguous i32 `out`; `ws`: the addresses of
    argmax_workspaces. The fused greedy pick also gives `out_f32` (contiguous f32, the index as a float)
    and `log`, the set_rows node writing it into rows of one value at log.srcs[2]'s row ids."""
    rows, cols, s1 = _argmax_rows(x)
    nblk, chunk = split_shape(rows, cols, sms)
    partials, counters = ws if nblk > 1 else (0, 0)
    s0 = x.strides[-1]
    vec = s0 == 4 and ptr(x) % 16 == 0 and (rows == 1 or s1 % 16 == 0)
    if log is None:
        itype, fused = "int", (u64(0), u64(0), u64(0), np.int64(0), np.int64(0), np.int64(0))
    else:
        idx = log.srcs[2]
        itype = "int" if idx.dtype.name == "i32" else "long long"
        fused = (u64(ptr(out_f32)), u64(ptr(log)), u64(ptr(idx)), np.int64(idx.strides[0]),
                 np.int64(log.strides[0]), np.int64(log.shape[0]))
    pf32, plog, pidx, is0, ls1, log_rows = fused
    args = (u64(ptr(x)), u64(ptr(out)), pf32, plog, pidx, u64(partials), u64(counters), np.int32(cols),
            np.int32(chunk), np.int32(nblk), np.int64(s0), np.int64(s1), is0, ls1, log_rows)
    return [KernelSpec(REDUCE_CU, tmpl("argmax_split", b(vec), itype), nblk * rows if cols else 0, SPLIT_BLOCK,
                       args)]


def launch_split(ctx: CudaContext, x: Tensor, make: Callable[[Sequence[int], int], list[KernelSpec]],
                 owner: str) -> Launch:
    """argmax_split over x's rows: its workspaces made at bind, then the specs `make(their addresses, SMs)`."""
    sms = sm_count(ctx.device)
    rows, cols, _ = _argmax_rows(x)
    ws = argmax_workspaces(rows, split_shape(rows, cols, sms)[0])
    bufs = alloc_workspaces(ctx.backend, ws, owner)
    return chain((s.launch(ctx.stream) for s in make([buf.ptr for buf in bufs], sms)), bufs)


def bind_argmax_split(ctx: CudaContext, node: Tensor) -> Launch:
    x = node.srcs[0]
    return launch_split(ctx, x, lambda w, sms: argmax_split_specs(x, node, ctx.ptr, w, sms), node.describe())


def supports_argmax_split(device: Device, node: Tensor) -> bool | str:
    ok = supports_row_reduce(device, node)
    if ok is not True:
        return ok
    return argmax_splits(node, sm_count(device)) or "one block a row: many rows or short ones"


supports_sum = _rules(
    (dtype_in(FLOATS, _src(0)), "x must be f32, f16 or bf16"),
    (lambda n: aligned(n.srcs[0]), "strides or offsets that split an element"),
    (lambda n: small(n.srcs[0]), "2**31 elements or more"),
)


def _partials_grid(n: int, sms: int) -> int:
    return min(-(-n // BLOCK), MAX_PARTIALS, sms * 4)


def sum_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    name = tmpl("sum_all", VALUE[x.dtype.name], b(x.is_contiguous()))
    # an empty x still writes its sum, 0: one block
    return [KernelSpec(REDUCE_CU, name, max(_partials_grid(x.size, sms), 1), BLOCK,
                 (u64(ptr(x)), u64(ptr(node)), np.uint32(x.size), *layout(x)))]


supports_count_equal = _rules(
    (lambda n: all(aligned(s) for s in n.srcs), "strides or offsets that split an element"),
    (lambda n: small(n.srcs[0]), "2**31 elements or more"),
)


def count_equal_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    a, bt = node.srcs
    return [KernelSpec(REDUCE_CU, "count_equal", max(_partials_grid(a.size, sms), 1), BLOCK,
                 (u64(ptr(a)), u64(ptr(bt)), u64(ptr(node)), np.uint32(a.size), *layout(a), *layout(bt)))]


# ==================================================================================================
# Sorting: argsort, top_k


#: longest rows sorted: the merge path's chunks (4096 at least) stay within grid.y's 65535
MAX_SORT = 2**24
#: chunks never longer than this (more only costs shared memory)
MAX_CHUNK = 16384


def chunk_limit(device: Device) -> int:
    """The longest run of keys one block sorts in shared memory (8 bytes a key): a power of two."""
    most = min(MAX_CHUNK, smem_limit(device) // 8)
    return 1 << (most.bit_length() - 1)


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def sort_block(chunk: int) -> int:
    """Threads per block sorting `chunk` keys: one per comparator, 32 to 1024."""
    for blk in SORT_BLOCKS:
        if 2 * blk >= chunk:
            return blk
    return SORT_BLOCKS[-1]


def warp_sort_spec(x: Tensor, out: Tensor, ptr: Ptr, kout: int, desc: bool) -> KernelSpec | None:
    """sort_rows_warp for x's rows when they fit its registers; else None."""
    n = x.shape[-1]
    if n > WARP_SORT_MAX:
        return None
    rows = math.prod(x.shape[:-1]) if n else 0
    npad = max(pow2(n), 32)
    k, warps = (npad // 32, 1) if npad <= 512 else (16, npad // 512)
    grid, block = (-(-rows // 4), 128) if warps == 1 else (rows, 32 * warps)  # 4 rows per block of one-warp rows
    _, n1, n2, st = _rows_of(x)
    return KernelSpec(SORT_CU, tmpl("sort_rows_warp", k, warps), grid, block,
                      (u64(ptr(x)), u64(ptr(out)), np.uint32(rows), np.int32(n), np.int32(kout), np.int64(kout),
                       np.int32(desc), np.uint32(max(n1, 1)), np.uint32(max(n2, 1)), *(np.int64(s) for s in st)))


def _sort_rows(n: Tensor) -> int:
    return math.prod(n.srcs[0].shape[:-1])


supports_argsort = _rules(
    *_F32_ROWS,
    (lambda n: n.shape[-1] <= MAX_SORT, f"rows longer than {MAX_SORT}"),
)


def _argsort_long_ok(device: Device, node: Tensor) -> bool | str:
    """Rows longer than a chunk merge through global memory: grid.y holds the rows."""
    if node.shape[-1] > chunk_limit(device) and _sort_rows(node) > 65535:
        return f"more than 65535 rows longer than {chunk_limit(device)}"
    return True


def supports_argsort_on(device: Device, node: Tensor) -> bool | str:
    ok = supports_argsort(device, node)
    return _argsort_long_ok(device, node) if ok is True else ok


def argsort_specs(node: Tensor, ptr: Ptr, chunk_max: int) -> list[KernelSpec]:
    x = node.srcs[0]
    n = x.shape[-1]
    warp = warp_sort_spec(x, node, ptr, n, node.params["order"] == "desc")
    if warp is not None and n <= chunk_max:
        return [warp]
    rows = _sort_rows(node) if n else 0
    desc = np.int32(node.params["order"] == "desc")
    px, po = u64(ptr(x)), u64(ptr(node))
    _, n1, n2, st = _rows_of(x)
    tail = (np.uint32(max(n1, 1)), np.uint32(max(n2, 1)), *(np.int64(s) for s in st))
    if n <= chunk_max:
        chunk = pow2(n)
        return [KernelSpec(SORT_CU, tmpl("sort_chunks", sort_block(chunk)), (rows, 1), sort_block(chunk),
                     (px, po, np.int32(n), np.int32(chunk), np.int32(n), np.int64(n), desc, *tail), chunk * 8)]
    chunk = chunk_max
    nchunks = -(-n // chunk)
    npad = pow2(n)
    big = SORT_BLOCKS[-1]
    specs = [KernelSpec(SORT_CU, tmpl("sort_chunks", big), (rows, nchunks), big,
                  (px, po, np.int32(n), np.int32(chunk), np.int32(chunk), np.int64(n), desc, *tail), chunk * 8)]

    def step(mask: int, half: int) -> KernelSpec:
        return KernelSpec(SORT_CU, "merge_step", (-(-(npad // 2) // 256), rows), 256,
                    (px, po, np.int32(n), np.int32(npad), np.int32(mask), np.int32(half), desc, *tail))

    k = 2 * chunk
    while k <= npad:
        specs.append(step(k - 1, k // 2))  # the flip step of level k
        j = k // 4
        while j >= chunk:
            specs.append(step(j, j))
            j //= 2
        specs.append(KernelSpec(SORT_CU, tmpl("merge_chunks", big), (rows, nchunks), big,
                          (px, po, np.int32(n), np.int32(chunk), desc, *tail), chunk * 8))
        k *= 2
    return specs


def bind_argsort(ctx: CudaContext, node: Tensor) -> Launch:
    return _launch(ctx, argsort_specs(node, ctx.ptr, chunk_limit(ctx.device)))


def supports_top_k_on(device: Device, node: Tensor) -> bool | str:
    ok = first_failure(node, _F32_ROWS)
    if ok is not True:
        return ok
    if node.shape[-1] > chunk_limit(device) and pow2(node.params["k"]) > chunk_limit(device):
        return f"k above {chunk_limit(device)} on rows longer than that"
    return True


def top_k_specs(node: Tensor, ptr: Ptr, chunk_max: int) -> list[KernelSpec]:
    x = node.srcs[0]
    n, k = x.shape[-1], node.params["k"]
    warp = warp_sort_spec(x, node, ptr, k, True)
    if warp is not None and n <= chunk_max:
        return [warp]
    rows = _sort_rows(node)
    px, po = u64(ptr(x)), u64(ptr(node))
    _, n1, n2, st = _rows_of(x)
    tail = (np.uint32(max(n1, 1)), np.uint32(max(n2, 1)), *(np.int64(s) for s in st))
    if n <= chunk_max:
        chunk = pow2(n)
        return [KernelSpec(SORT_CU, tmpl("sort_chunks", sort_block(chunk)), (rows, 1), sort_block(chunk),
                     (px, po, np.int32(n), np.int32(chunk), np.int32(k), np.int64(k), np.int32(1), *tail), chunk * 8)]
    kpad = pow2(k)
    return [KernelSpec(SORT_CU, tmpl("topk_select", 1024), rows, 1024,
                 (px, po, np.int32(n), np.int32(k), np.int32(kpad), *tail), kpad * 8)]


def bind_top_k(ctx: CudaContext, node: Tensor) -> Launch:
    return _launch(ctx, top_k_specs(node, ctx.ptr, chunk_limit(ctx.device)))


# ==================================================================================================
# Top-k MoE routing, fused (ggml's topk-moe)
#
# In our ops, the router is soft_max(logits) -> top_k(probs, k) -> get_rows(probs as
# rows of one value, ids), optionally normalized: -> sum_rows -> div. Graph.build
# puts the view of probs before top_k (get_rows reads it first):
#   soft_max, reshape|view, top_k, get_rows [, reshape|view, sum_rows, div]

VIEWS = ("reshape", "view")
MOE_PATTERNS = tuple(
    (f"topk_moe_norm_{v1}_{v2}", ("soft_max", v1, "top_k", "get_rows", v2, "sum_rows", "div"))
    for v1 in VIEWS for v2 in VIEWS
) + tuple((f"topk_moe_{v}", ("soft_max", v, "top_k", "get_rows")) for v in VIEWS)
MAX_EXPERTS = 32 * MOE_NPL[-1]


def _is_plain_view(v: Tensor, of: Tensor, shape: tuple[int, ...]) -> bool:
    """v shows `of`'s contiguous storage, from its start, as `shape`."""
    return (v.srcs[0] is of and v.shape == shape and v.view_offset == of.view_offset
            and v.is_contiguous() and of.is_contiguous())


def moe_check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """True if the fused router computes `nodes` (one of MOE_PATTERNS); else why not."""
    probs, rows_view, topk, weights = nodes[:4]
    logits, mask, sinks = probs.srcs
    lead, experts = probs.shape[:-1], probs.shape[-1]
    k = topk.params["k"]
    checks = (
        (mask is None and sinks is None, "soft_max has a mask or sinks"),
        (logits.dtype.name == "f32" and logits.is_contiguous(), "logits must be contiguous f32"),
        (experts <= MAX_EXPERTS, f"more than {MAX_EXPERTS} experts"),
        (math.prod(lead) <= INT_MAX, "at most 2**31 - 1 rows"),
        (topk.srcs[0] is probs, "top_k does not read the soft_max"),
        (_is_plain_view(rows_view, probs, (*lead, experts, 1)), "get_rows' table is not the probabilities as rows"),
        (weights.srcs[0] is rows_view and weights.srcs[1] is topk, "get_rows does not gather the top_k experts"),
        (weights.shape == (*lead, k, 1) and weights.is_contiguous(), "unexpected weights shape"),
    )
    for ok, reason in checks:
        if not ok:
            return reason
    if len(nodes) == 4:
        return True
    w2, total, out = nodes[4:]
    norm = (
        (_is_plain_view(w2, weights, (*lead, k)), "the weights view is not (rows, k)"),
        (total.srcs[0] is w2, "sum_rows does not sum the weights"),
        (out.srcs[0] is w2 and out.srcs[1] is total, "div does not divide the weights by their sum"),
        (out.shape == w2.shape and out.dtype.name == "f32" and out.is_contiguous(), "unexpected div result"),
    )
    for ok, reason in norm:
        if not ok:
            return reason
    return True


def moe_specs(nodes: Sequence[Tensor], ptr: Ptr) -> list[KernelSpec]:
    probs, _, topk, _ = nodes[:4]
    logits = probs.srcs[0]
    out = nodes[-1]
    experts, k = probs.shape[-1], topk.params["k"]
    rows = math.prod(probs.shape[:-1])
    npl = next(n for n in MOE_NPL if 32 * n >= experts)
    # The kernel also writes the expert ids (top_k's result, the rule's extra
    # output): mul_mat_id reads them outside the group.
    args = (u64(ptr(logits)), u64(ptr(out)), u64(ptr(topk)), np.uint32(rows), np.int32(experts), np.int32(k),
            np.int64(experts), np.float32(probs.params["scale"]), np.int32(len(nodes) > 4))
    return [KernelSpec(SORT_CU, tmpl("topk_moe", npl), -(-rows // 4), 128, args)]


def bind_moe(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    return _launch(ctx, moe_specs(nodes, ctx.ptr))


# ==================================================================================================
# The greedy pick, fused
#
# LlamaModel.build(greedy=True) ends a decode step with picked = argmax(logits) (B, C) -> (B,),
# cpy(picked, next_tokens view) (i32), cpy(picked, next_f32 view (B, 1)) (f32) and
# set_rows(token_log, that f32, kv_idx): four launches of about a microsecond of work each, most of
# it launch and memory latency. Graph.build puts the f32 view between the two copies (the second cpy
# reads it first). argmax_split's last block of each row writes all three destinations instead.

GREEDY_PATTERN = ("argmax", "cpy", "view", "cpy", "set_rows")
#: the pattern positions the fused kernel writes besides set_rows: the i32 copy is read outside the
#: group (a graph output: the next step embeds it); the f32 copy is read only by the set_rows, but it
#: is a state the kernel writes in place, declared so that the plan records the write
GREEDY_WRITES = (1, 3)


def _distinct_bases(*ts: Tensor) -> bool:
    return len({t.base for t in ts}) == len(ts)


def greedy_check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """True if argmax_split's greedy pick computes `nodes` (GREEDY_PATTERN) exactly; else why not."""
    picked, tokens, f32_view, as_f32, log = nodes
    x = picked.srcs[0]
    ok = supports_row_reduce(device, picked)
    if ok is not True:
        return f"argmax: {ok}"
    dst, src, idx = log.srcs
    checks = (
        (x.shape[-1] > 0, "argmax of empty rows"),
        (tokens.srcs[0] is picked and tokens.dtype.name == "i32", "the first cpy does not copy the argmax into i32"),
        (tokens.is_contiguous(), "the i32 copy's destination is not contiguous"),
        (as_f32.srcs[0] is picked and as_f32.srcs[1] is f32_view and as_f32.dtype.name == "f32",
         "the second cpy does not copy the argmax into the f32 view"),
        (as_f32.is_contiguous(), "the f32 copy's destination is not contiguous"),
        (src is as_f32, "set_rows does not write the f32 copy"),
        (log.dtype.name == "f32", "set_rows must write f32 rows"),
        (as_f32.ndim == 2 and log.ndim == 2 and idx.ndim == 1,
         "batch axes: set_rows must take (B, 1) rows into (R, 1) at (B,) row ids"),
        (as_f32.shape[-1] == 1, "set_rows rows must hold one value"),
        (all(aligned(t) for t in (tokens, as_f32, log, idx)), "strides or offsets that split an element"),
        (_distinct_bases(x, tokens, as_f32, dst), "the logits and the three destinations must not share storage"),
    )
    for holds, reason in checks:
        if not holds:
            return reason
    return True


def greedy_specs(nodes: Sequence[Tensor], ptr: Ptr, ws: Sequence[int], sms: int) -> list[KernelSpec]:
    picked, tokens, _, as_f32, log = nodes
    return argmax_split_specs(picked.srcs[0], tokens, ptr, ws, sms, as_f32, log)


def bind_greedy_pick(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    return launch_split(ctx, nodes[0].srcs[0], lambda w, sms: greedy_specs(nodes, ctx.ptr, w, sms),
                        nodes[-1].describe())


# ==================================================================================================
# What the plugin yields

KERNELS: list[Kernel] = [
    *(Kernel(op, bind_copy, supports_copy, name="copy") for op in ("cpy", "dup", "cont")),
    Kernel("get_rows", bind_get_rows, supports_get_rows, name="get_rows"),
    Kernel("set_rows", bind_set_rows, supports_set_rows, name="set_rows"),
    Kernel("concat", _binder(concat_specs), supports_concat, name="concat"),
    Kernel("repeat", _binder(repeat_specs), supports_repeat, name="repeat"),
    Kernel("pad", _binder(pad_specs), supports_f32_layout, name="pad"),
    Kernel("pad_reflect_1d", _binder(pad_reflect_specs), supports_f32_layout, name="pad_reflect_1d"),
    Kernel("roll", _binder(roll_specs), supports_f32_layout, name="roll"),
    Kernel("diag", _binder(diag_specs), supports_f32_layout, name="diag"),
    Kernel("tri", _binder(tri_specs), supports_f32_layout, name="tri"),
    Kernel("arange", _binder(arange_specs), supports_arange, name="arange"),
    Kernel("fill", _binder(fill_specs), supports_fill, name="fill"),
    Kernel("set", _binder(set_acc_specs), supports_set_acc, name="set"),
    Kernel("acc", _binder(set_acc_specs), supports_set_acc, name="acc"),
    Kernel("timestep_embedding", _binder(timestep_specs), supports_timestep, name="timestep_embedding"),
    Kernel("sum", _binder(sum_specs), supports_sum, name="sum"),
    Kernel("sum_rows", _binder(sum_rows_specs), supports_row_reduce, name="sum_rows"),
    Kernel("mean", _binder(sum_rows_specs), supports_row_reduce, name="mean"),
    Kernel("cumsum", _binder(cumsum_specs), supports_row_reduce, name="cumsum"),
    # few long rows (a decode step's logits) split over blocks; the rest one block a row
    Kernel("argmax", bind_argmax_split, supports_argmax_split, name="argmax_split"),
    Kernel("argmax", _binder(argmax_specs), supports_row_reduce, name="argmax_block"),
    Kernel("count_equal", _binder(count_equal_specs), supports_count_equal, name="count_equal"),
    Kernel("argsort", bind_argsort, supports_argsort_on, name="bitonic"),
    Kernel("top_k", bind_top_k, supports_top_k_on, name="top_k"),
]

#: longest patterns first: dispatch takes the first rule whose check passes
FUSIONS: list[FusionRule] = sorted(
    [*(FusionRule(name, pattern, bind=bind_moe, check=moe_check, outputs=(2,)) for name, pattern in MOE_PATTERNS),
     FusionRule("greedy_pick", GREEDY_PATTERN, bind=bind_greedy_pick, check=greedy_check, outputs=GREEDY_WRITES)],
    key=lambda r: -len(r.pattern))
