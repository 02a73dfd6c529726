"""The predicate-table kit every plugin's `support.py` builds from (CUDA-free).

A table is a sequence of `Rule`s, (condition, reason) read top to bottom, after
ggml's `supports_op`; `first_failure` gives True or the first failing reason,
the return convention of `Kernel.supports`. The conditions here only read
shapes, strides, dtypes and view offsets, so plans can be made and tested on
a device description.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .tensor import Tensor

#: (condition on a node or tensor, the reason given when it does not hold)
Rule = tuple[Callable[[Tensor], bool], str]

#: the 32-bit limits kernels index with (`int`, `unsigned`), and CUDA's grid y/z limit
INT_MAX = 2**31 - 1
UINT_MAX = 2**32 - 1
GRID_YZ_MAX = 65535


def first_failure(t: Tensor, rules: Sequence[Rule]) -> bool | str:
    """True if every condition holds for `t`, else the reason of the first that does not."""
    for holds, reason in rules:
        if not holds(t):
            return reason
    return True


def access_unit(t: Tensor) -> int:
    """Bytes of one access of `t`'s data: an element of a plain type, a 16-bit word of a block
    format (block fields are read with 16-bit loads, so blocks need only 2-byte alignment), a byte
    of a format whose blocks have an odd size (mxfp4's 17: its traits read bytes)."""
    if not t.dtype.is_quant:
        return t.dtype.block_bytes
    return 2 if t.dtype.block_bytes % 2 == 0 else 1


def whole_elements(t: Tensor | None) -> bool:
    """Strides and the view offset are whole accesses (`access_unit`); None (an absent operand) passes."""
    if t is None:
        return True
    unit = access_unit(t)
    return t.view_offset % unit == 0 and all(s % unit == 0 for s in t.strides)


def rows_packed(t: Tensor | None) -> bool:
    """The last axis is contiguous; None passes."""
    return t is None or t.rows_contiguous()


def inner_packed(t: Tensor, axes: int) -> bool:
    """The last `axes` axes are packed, size-1 axes ignored."""
    step = t.dtype.block_bytes
    for n, s in zip(reversed(t.shape[-axes:]), reversed(t.strides[-axes:])):
        if n != 1 and s != step:
            return False
        step *= n
    return True


def rows_apart(t: Tensor) -> bool:
    """Rows (the second-last axis) do not overlap: the row stride covers a whole row."""
    if t.ndim < 2 or t.shape[-2] <= 1:
        return True
    return t.strides[-2] >= t.dtype.row_bytes(t.shape[-1])


def contiguous_vector(t: Tensor | None) -> bool:
    """A 1-d tensor with packed elements; None passes."""
    return t is None or (t.ndim == 1 and (t.shape[0] <= 1 or t.strides[0] == t.dtype.block_bytes))


def outer_rows(t: Tensor) -> int:
    """Rows of a tensor read row by row: the product of all but its last axis."""
    return math.prod(t.shape[:-1])


def fits_int(*sizes: int) -> bool:
    """Every size is a valid 32-bit `int` index bound: 0 <= n <= 2**31 - 1."""
    return all(0 <= n <= INT_MAX for n in sizes)
