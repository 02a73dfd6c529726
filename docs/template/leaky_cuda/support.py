"""What leaky.cu accepts: a table of (condition, reason), read top to bottom."""

from __future__ import annotations

from opdispatch.hookspecs import Device
from opdispatch.support import INT_MAX, Rule, first_failure
from opdispatch.tensor import Tensor

LEAKY: tuple[Rule, ...] = (
    (lambda n: n.srcs[0].dtype.name == "f32" and n.dtype.name == "f32", "f32 only"),
    (lambda n: n.srcs[0].is_contiguous() and n.is_contiguous(), "x and the result must be contiguous"),
    (lambda n: n.size <= INT_MAX, "at most 2**31 - 1 elements"),
)


def leaky(device: Device, node: Tensor) -> bool | str:
    return first_failure(node, LEAKY)
