"""What the norm kernels accept, as tables of (condition, reason) read top to bottom.

Each predicate returns True or the reason of the first condition that fails
(`opdispatch.support`), after ggml's `supports_op`.
"""

from __future__ import annotations

import math

from opdispatch.hookspecs import Device
from opdispatch.ops.base import can_repeat, pad4
from opdispatch.support import INT_MAX, Rule, first_failure, inner_packed, outer_rows, whole_elements
from opdispatch.tensor import Tensor


def _x(n: Tensor) -> Tensor:
    return n.srcs[0]


#: norm, rms_norm, l2_norm: x -> a contiguous result of x's shape.
ROW_NORM: tuple[Rule, ...] = (
    (lambda n: _x(n).dtype.name == "f32", "x must be f32"),
    (lambda n: n.dtype.name == "f32", "the result must be f32"),
    (lambda n: 1 <= _x(n).ndim <= 4, "x must have 1 to 4 dimensions"),
    (lambda n: _x(n).rows_contiguous(), "rows must be contiguous"),
    (lambda n: whole_elements(_x(n)), "strides and the view offset must be whole elements"),
    (lambda n: n.is_contiguous(), "the result must be contiguous"),
    (lambda n: n.shape[-1] <= INT_MAX, "rows must be shorter than 2**31"),
    (lambda n: outer_rows(n) <= INT_MAX, "at most 2**31 - 1 rows"),
)

#: group_norm: x (N, C, H, W) with (C, H, W) packed; any sample stride.
GROUP_NORM: tuple[Rule, ...] = (
    (lambda n: _x(n).dtype.name == "f32", "x must be f32"),
    (lambda n: n.dtype.name == "f32", "the result must be f32"),
    (lambda n: 1 <= _x(n).ndim <= 4, "x must have 1 to 4 dimensions"),
    (lambda n: inner_packed(_x(n), 3), "(C, H, W) must be contiguous"),
    (lambda n: whole_elements(_x(n)), "strides and the view offset must be whole elements"),
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
        (lambda t: whole_elements(t), "strides and the view offset must be whole elements"),
    )


def row_norm(device: Device, node: Tensor) -> bool | str:
    return first_failure(node, ROW_NORM)


def group_norm(device: Device, node: Tensor) -> bool | str:
    return first_failure(node, GROUP_NORM)
