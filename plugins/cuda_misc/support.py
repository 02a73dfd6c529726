"""cuda_misc's support predicates: per op a table of (condition, reason) read top to bottom, after
ggml's supports_op, on opdispatch.support's kit.

They read only shapes, strides, dtypes and the device's facts, so plans for a device description
are made (and tested) without a GPU; anything declined runs on the reference.
"""

from __future__ import annotations

from typing import Callable, Sequence

from opdispatch.backends.cuda.devices import facts
from opdispatch.backends.cuda.kernels import GLU_CODES
from opdispatch.hookspecs import Device
from opdispatch.ops.base import FLOATS
from opdispatch.support import GRID_YZ_MAX, Rule, first_failure, fits_int, outer_rows, rows_packed, whole_elements
from opdispatch.tensor import Tensor

from .specs.elementwise import BINARY_PAIRS
from .specs.layout import window
from .specs.reduce import argmax_splits
from .specs.rows import DECODE_ONLY, ENCODED, MAX_ROW, PLAIN, RAW_DTYPES, copy_kind, pow2
from .specs.sort import MAX_SORT, chunk_limit, sort_rows


def table(*rules: Rule) -> Callable[[Device, Tensor], bool | str]:
    """A `Kernel.supports` predicate reading `rules` for the node."""
    def supports(device: Device, node: Tensor) -> bool | str:
        return first_failure(node, rules)

    return supports


def _src(i: int) -> Callable[[Tensor], Tensor]:
    return lambda n: n.srcs[i]


def dtype_in(names: Sequence[str], what: Callable[[Tensor], Tensor] = lambda n: n) -> Callable[[Tensor], bool]:
    return lambda n: what(n).dtype.name in names


def elements_fit(t: Tensor) -> bool:
    """Flat indices fit the kernels' 32-bit unravel."""
    return fits_int(t.size)


def _all_whole(n: Tensor) -> bool:
    return all(whole_elements(s) for s in n.srcs)


# -- elementwise, unary, glu ----------------------------------------------------------------------


def _srcs(n: Tensor) -> list[Tensor]:
    return [s for s in n.srcs if s is not None]


def _float_srcs(n: Tensor) -> bool:
    return all(s.dtype.name in FLOATS for s in _srcs(n) if not (n.op == "add_id" and s is n.srcs[2]))


def _rows_fit(n: Tensor) -> bool:
    """Row and column counts of the general kernels fit their 32-bit indices."""
    return fits_int(outer_rows(n), *n.shape[-1:])


def _pair_ok(n: Tensor) -> bool:
    return (n.srcs[0].dtype.name, n.srcs[1].dtype.name) in BINARY_PAIRS


def _pair_reason(n: Tensor) -> str:
    return f"{n.srcs[0].dtype.name} a with {n.srcs[1].dtype.name} b not supported (mixed f16/bf16)"


def _common(n: Tensor) -> tuple[Rule, ...]:
    return (
        (_float_srcs, "sources must be f32, f16 or bf16 (" + ", ".join(s.dtype.name for s in _srcs(n)) + ")"),
        (lambda n: n.dtype.name in FLOATS, f"the result must be f32, f16 or bf16 (got {n.dtype.name})"),
        (lambda n: n.is_contiguous(), "the result must be contiguous"),
        (lambda n: all(whole_elements(s) for s in _srcs(n)), "strides must be whole elements"),
    )


def binary_ok(device: Device, n: Tensor) -> bool | str:
    """add, sub, mul, div, add1: any layout (specs.elementwise.binary_spec picks the path)."""
    return first_failure(n, (*_common(n), (_pair_ok, _pair_reason(n)), (_rows_fit, "at most 2**31 - 1 rows")))


def add_id_ok(device: Device, n: Tensor) -> bool | str:
    return first_failure(n, (
        *_common(n),
        (_pair_ok, _pair_reason(n)),
        (lambda n: fits_int(n.shape[0] * n.shape[1], n.shape[2]), "at most 2**31 - 1 rows"),
    ))


def map_ok(device: Device, n: Tensor) -> bool | str:
    """A map op on any layout (specs.unary.unary_spec picks the path)."""
    return first_failure(n, (
        *_common(n),
        (lambda n: n.dtype == n.srcs[0].dtype, "the result must have the source's dtype"),
        (_rows_fit, "at most 2**31 - 1 rows"),
    ))


def glu_ok(device: Device, n: Tensor) -> bool | str:
    return first_failure(n, (
        *_common(n),
        (lambda n: all(s.dtype == n.dtype for s in _srcs(n)), "sources and result must share one dtype"),
        (lambda n: all(rows_packed(s) for s in n.srcs), "rows must be contiguous"),
        (lambda n: n.params["kind"] in GLU_CODES, f"unknown glu kind {n.params.get('kind')!r}"),
        (_rows_fit, "at most 2**31 - 1 rows"),
    ))


# -- copies, rows, layout ops ---------------------------------------------------------------------


def _contiguous_pair(n: Tensor) -> bool:
    return n.srcs[0].is_contiguous() and n.is_contiguous()


def _packed_blocks(t: Tensor) -> bool:
    """A block format's rows hold their blocks back to back."""
    return not t.dtype.is_quant or t.rows_contiguous()


def _blocks_compiled(n: Tensor) -> bool:
    """Kernels move the 32-value block formats only (concat)."""
    return all(not t.dtype.is_quant or t.dtype.name in ENCODED for t in (n, *n.srcs))


def _moved(n: Tensor) -> bool:
    """rows.cu has traits for every block format involved (quant.cuh's and quant_k.cuh's)."""
    return all(not t.dtype.is_quant or t.dtype.name in ENCODED + DECODE_ONLY for t in (n, *n.srcs))


def _not_encoding(n: Tensor) -> bool:
    """quant_k.cuh's formats are decoded and copied, never encoded."""
    return n.dtype.name not in DECODE_ONLY or n.srcs[0].dtype == n.dtype


def _raw_unit(n: Tensor) -> bool:
    """A strided same-dtype copy moves Block<N> units of 16-bit words: blocks of an odd size (mxfp4) only
    go contiguously (copy_contig's bytes)."""
    src = n.srcs[0].dtype
    return not (src == n.dtype and src.is_quant and src.name not in RAW_DTYPES) or _contiguous_pair(n)


copy_ok = table(
    (_moved, "no kernel moves this block format"),
    (_not_encoding, "no kernel quantizes to the K-quants, iq4_nl, iq4_xs, mxfp4 or the grid I-quants "
                     "(they are decoded and copied)"),
    (_raw_unit, "blocks of an odd size (mxfp4) are copied between contiguous tensors only"),
    (lambda n: copy_kind(n.srcs[0].dtype, n.dtype) is not None, "no kernel converts this pair of dtypes"),
    (lambda n: whole_elements(n.srcs[0]) and whole_elements(n), "strides or offsets that split an element"),
    (lambda n: elements_fit(n) or (_contiguous_pair(n) and not (n.dtype.is_quant or n.srcs[0].dtype.is_quant)),
     "strided or quantizing copies of 2**31 elements or more"),
)

get_rows_ok = table(
    (dtype_in(PLAIN + ENCODED + DECODE_ONLY, _src(0)), "a must be f32, f16, bf16, i32 or a block format"),
    (dtype_in(("i32",), _src(1)), "indices must be i32"),
    (lambda n: _packed_blocks(n.srcs[0]), "quantized rows must be packed"),
    (lambda n: whole_elements(n.srcs[0]) and whole_elements(n.srcs[1]), "strides or offsets that split an element"),
    (lambda n: fits_int(outer_rows(n)), "at most 2**31 - 1 rows"),
    (lambda n: n.shape[-1] <= MAX_ROW, "rows longer than the grid covers"),
)

set_rows_ok = table(
    (dtype_in(FLOATS + ENCODED), "dst must be f32, f16, bf16 or a 32-value block format (q4_0 .. q8_0)"),
    (dtype_in(("f32",), _src(1)), "src must be f32"),
    (dtype_in(("i32", "i64"), _src(2)), "indices must be i32 or i64"),
    (_packed_blocks, "quantized rows must be packed"),
    (_all_whole, "strides or offsets that split an element"),
    (lambda n: fits_int(outer_rows(n.srcs[1])), "at most 2**31 - 1 rows"),
    (lambda n: n.shape[-1] <= MAX_ROW, "rows longer than the grid covers"),
)

concat_ok = table(
    (_blocks_compiled, "concat moves the 32-value block formats only"),
    (_all_whole, "strides or offsets that split an element"),
    (elements_fit, "2**31 elements or more"),
)

repeat_ok = table(
    (dtype_in(("f32", "f16", "bf16", "i16", "i32"), _src(0)), "a must be f32, f16, bf16, i16 or i32"),
    (lambda n: whole_elements(n.srcs[0]), "strides or offsets that split an element"),
    (elements_fit, "2**31 elements or more"),
)

_F32_IN_OUT: tuple[Rule, ...] = (
    (dtype_in(("f32",), _src(0)), "x must be f32"),
    (lambda n: whole_elements(n.srcs[0]), "misaligned strides"),
    (elements_fit, "2**31 elements or more"),
)

#: pad, pad_reflect_1d, roll, diag, tri
f32_layout_ok = table(*_F32_IN_OUT)
timestep_ok = table(*_F32_IN_OUT)
arange_ok = table((elements_fit, "2**31 elements or more"))
fill_ok = table((dtype_in(("f32", "f16")), "the result must be f32 or f16"))

set_acc_ok = table(
    (_all_whole, "strides or offsets that split an element"),
    (elements_fit, "2**31 elements or more"),
    (lambda n: window(n) is not None, "the window overlaps itself"),
)


# -- reductions ------------------------------------------------------------------------------------

_F32_ROWS: tuple[Rule, ...] = (
    (dtype_in(("f32",), _src(0)), "x must be f32"),
    (lambda n: whole_elements(n.srcs[0]), "strides or offsets that split an element"),
    (lambda n: fits_int(outer_rows(n.srcs[0])), "at most 2**31 - 1 rows"),
    (lambda n: fits_int(n.srcs[0].shape[-1]), "rows of 2**31 elements or more"),
)

#: sum_rows, mean, cumsum, argmax with one block a row
row_reduce_ok = table(*_F32_ROWS)

sum_ok = table(
    (dtype_in(FLOATS, _src(0)), "x must be f32, f16 or bf16"),
    (lambda n: whole_elements(n.srcs[0]), "strides or offsets that split an element"),
    (lambda n: elements_fit(n.srcs[0]), "2**31 elements or more"),
)

count_equal_ok = table(
    (_all_whole, "strides or offsets that split an element"),
    (lambda n: elements_fit(n.srcs[0]), "2**31 elements or more"),
)


def argmax_split_ok(device: Device, node: Tensor) -> bool | str:
    """Few long rows only: the others run one block a row (row_reduce_ok)."""
    ok = row_reduce_ok(device, node)
    if ok is not True:
        return ok
    return argmax_splits(node, facts(device).sm_count) or "one block a row: many rows or short ones"


# -- sorting --------------------------------------------------------------------------------------

_argsort_rows_ok = table(*_F32_ROWS, (lambda n: n.shape[-1] <= MAX_SORT, f"rows longer than {MAX_SORT}"))


def argsort_ok(device: Device, node: Tensor) -> bool | str:
    """Rows longer than a chunk merge through global memory: grid.y holds the rows."""
    ok = _argsort_rows_ok(device, node)
    if ok is not True:
        return ok
    if node.shape[-1] > chunk_limit(device) and sort_rows(node) > GRID_YZ_MAX:
        return f"more than {GRID_YZ_MAX} rows longer than {chunk_limit(device)}"
    return True


def top_k_ok(device: Device, node: Tensor) -> bool | str:
    ok = first_failure(node, _F32_ROWS)
    if ok is not True:
        return ok
    if node.shape[-1] > chunk_limit(device) and pow2(node.params["k"]) > chunk_limit(device):
        return f"k above {chunk_limit(device)} on rows longer than that"
    return True
