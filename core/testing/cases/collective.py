"""Cases of the collectives: all_reduce_sum over a group of one device, cuda0 (the identity; on cuda0 NCCL
runs it, with a communicator of one rank). Groups of several devices are tested by the tensor split
itself, tests/test_tensor_split.py."""

from __future__ import annotations

from typing import Iterator

from ... import ops
from .base import Case, bound, dims, pick
from .registry import generator


@generator("all_reduce_sum")
def _all_reduce_sum(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], layout: str) -> Case:
        return Case(op, f"{dims(shape)} {layout} group of one",
                    lambda inp: ops.all_reduce_sum(inp.uniform(shape, layout=layout), "cuda0", 0), bound(op))

    for shape, layout in pick(full, (((4, 2048), "contig"), ((7, 3, 65), "perm")),
                              (((4, 2048), "contig"), ((1, 4096), "contig"), ((4, 2048), "T"), ((4, 2048), "strided"),
                              ((7, 3, 65), "perm"))):
        yield one(shape, layout)
