"""What the norm kernels accept, as tables of (condition, reason) read top to bottom.

Each predicate returns True or the reason of the first condition that fails,
after ggml's `supports_op`. Conditions only look at shapes, strides and
dtypes, so plans can be made and tested on a device description.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from opdispatch.hookspecs import Device
from opdispatch.ops.base import can_repeat, pad4
from opdispatch.tensor import Tensor

Rule = tuple[Callable[[Tensor], bool], str]

INT_MAX = 2**31 - 1


def first_failure(t: Tensor, rules: Sequence[Rule]) -> bool | str:
    """True if every condition holds for `t`, else the reason of the first that does not."""
    for holds, reason in rules:
        if not holds(t):
            return reason
    return True


def whole_elements(t: Tensor) -> bool:
    """Strides the kernels can take in elements."""
    return all(s % t.dtype.block_bytes == 0 for s in t.strides)


def outer_rows(t: Tensor) -> int:
    """Rows of a tensor read row by row: the product of all but its last axis."""
    return math.prod(t.shape[:-1])


def _inner_contiguous(t: Tensor, axes: int) -> bool:
    """The last `axes` axes are packed (size-1 axes ignored)."""
    step = t.dtype.block_bytes
    for n, s in zip(reversed(t.shape[-axes:]), reversed(t.strides[-axes:])):
        if n != 1 and s != step:
            return False
        step *= n
    return True


def _x(n: Tensor) -> Tensor:
    return n.srcs[0]


#: norm, rms_norm, l2_norm: x -> a contiguous result of x's shape.
ROW_NORM: tuple[Rule, ...] = (
    (lambda n: _x(n).dtype.name == "f32", "x must be f32"),
    (lambda n: n.dtype.name == "f32", "the result must be f32"),
    (lambda n: 1 <= _x(n).ndim <= 4, "x must have 1 to 4 dimensions"),
    (lambda n: _x(n).rows_contiguous(), "rows must be contiguous"),
    (lambda n: whole_elements(_x(n)), "strides must be whole elements"),
    (lambda n: n.is_contiguous(), "the result must be contiguous"),
    (lambda n: n.shape[-1] <= INT_MAX, "rows must be shorter than 2**31"),
    (lambda n: outer_rows(n) <= INT_MAX, "at most 2**31 - 1 rows"),
)

#: group_norm: x (N, C, H, W) with (C, H, W) packed; any sample stride.
GROUP_NORM: tuple[Rule, ...] = (
    (lambda n: _x(n).dtype.name == "f32", "x must be f32"),
    (lambda n: n.dtype.name == "f32", "the result must be f32"),
    (lambda n: 1 <= _x(n).ndim <= 4, "x must have 1 to 4 dimensions"),
    (lambda n: _inner_contiguous(_x(n), 3), "(C, H, W) must be contiguous"),
    (lambda n: whole_elements(_x(n)), "strides must be whole elements"),
    (lambda n: n.is_contiguous(), "the result must be contiguous"),
    (lambda n: math.prod(pad4(_x(n).shape)[1:]) <= INT_MAX, "a sample must hold fewer than 2**31 elements"),
    (lambda n: n.params["groups"] * pad4(_x(n).shape)[0] <= INT_MAX, "at most 2**31 - 1 groups in all"),
)


def operand_rules(out: Tensor) -> tuple[Rule, ...]:
    """A weight or residual the fused kernel combines with the normalized `out`."""
    return (
        (lambda t: t.dtype.name == "f32", "must be f32"),
        (lambda t: 1 <= t.ndim <= 4, "must have 1 to 4 dimensions"),
        (lambda t: can_repeat(t.shape, out.shape), f"must broadcast by modulo into {out.shape}"),
        (lambda t: t.rows_contiguous(), "rows must be contiguous"),
        (lambda t: whole_elements(t), "strides must be whole elements"),
    )


def row_norm(device: Device, node: Tensor) -> bool | str:
    return first_failure(node, ROW_NORM)


def group_norm(device: Device, node: Tensor) -> bool | str:
    return first_failure(node, GROUP_NORM)
