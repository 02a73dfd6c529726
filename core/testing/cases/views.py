"""Cases of the views (view, reshape, permute, transpose), of an input and of a node."""

from __future__ import annotations

from typing import Callable, Iterator

from ... import ops
from ...tensor import Tensor
from .base import Case, bound, dims
from .registry import generator


@generator("view", "reshape", "permute", "transpose")
def _views(op: str, full: bool) -> Iterator[Case]:
    shape = (2, 3, 20)
    take: Callable[[Tensor], Tensor] = {
        "view": lambda t: t.view((3, 5), (t.strides[-2], 8), 12),
        "reshape": lambda t: t.reshape(6, 5, 4),
        "permute": lambda t: t.permute(2, 0, 1),
        "transpose": lambda t: t.transpose(),
    }[op]
    yield Case(op, f"of an input {dims(shape)}", lambda inp: take(inp.uniform(shape)), bound(op))
    yield Case(op, f"of a node {dims(shape)}", lambda inp: take(ops.neg(inp.uniform(shape))), bound(op))
