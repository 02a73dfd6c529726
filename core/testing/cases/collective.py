"""Cases of the collectives: all_reduce_sum over a group of one device (the identity; groups of several
devices are tested by the tensor split itself, tests/test_tensor_split.py)."""

from __future__ import annotations

from typing import Iterator

from ... import ops
from .base import LAYOUTS, Case, bound, dims, pick
from .registry import generator


@generator("all_reduce_sum")
def _all_reduce_sum(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], layout: str) -> Case:
        return Case(op, f"{dims(shape)} {layout} group of one",
                    lambda inp: ops.all_reduce_sum(inp.uniform(shape, layout=layout), "cpu", 0), bound(op))

    for shape in pick(full, ((4, 2048),), ((4, 2048), (1, 4096), (7, 3, 65))):
        for layout in pick(full, ("contig",), LAYOUTS):
            yield one(shape, layout)
