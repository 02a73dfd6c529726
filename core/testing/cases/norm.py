"""Cases of the norms and the fused rms_norm+mul(+add) patterns."""

from __future__ import annotations

import itertools
from typing import Iterator

from ... import ops
from ...tensor import Tensor
from .base import LAYOUTS, Case, Inputs, bound, dims
from .registry import fused, generator

NORM_RANGE = (-10.0, 10.0)


@generator("norm", "rms_norm", "l2_norm")
def _norms(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], layout: str, eps: float) -> Case:
        return Case(op, f"{dims(shape)} {layout} eps={eps:g}",
                    lambda inp: getattr(ops, op)(inp.uniform(shape, "f32", *NORM_RANGE, layout), eps), bound(op))

    eps0 = 1e-12 if op == "l2_norm" else 1e-6
    if not full:
        yield one((3, 4, 5, 64), "contig", eps0)
        yield one((2, 7, 65), "perm", eps0)
        yield one((13, 11), "strided", 1e-5)
        return
    for rows, layout, eps in itertools.product((5, 64, 65, 1024, 4096), LAYOUTS, (eps0, 1e-5)):
        yield one((2, 3, 7, rows), layout, eps)


@generator("group_norm")
def _group_norm(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], groups: int, layout: str) -> Case:
        return Case(op, f"{dims(shape)} groups={groups} {layout}",
                    lambda inp: ops.group_norm(inp.uniform(shape, "f32", *NORM_RANGE, layout), groups), bound(op))

    yield one((2, 10, 5, 7), 4, "contig")
    yield one((1, 32, 4, 4), 8, "perm")
    if full:
        for shape, groups, layout in itertools.product(((2, 320, 8, 8), (1, 13, 11, 7)), (1, 4, 32), LAYOUTS):
            yield one(shape, groups, layout)


def rms_norm_mul_case(with_add: bool, shape: tuple[int, ...], w_shape: tuple[int, ...],
                      layout: str = "contig") -> Case:
    def make(inp: Inputs) -> Tensor:
        out = ops.mul(ops.rms_norm(inp.uniform(shape, "f32", *NORM_RANGE, layout), 1e-6), inp.uniform(w_shape))
        return ops.add(out, inp.uniform(shape)) if with_add else out

    return Case("add" if with_add else "mul", f"x={dims(shape)} w={dims(w_shape)} {layout}", make, bound("rms_norm"),
                fused="rms_norm_mul_add" if with_add else "rms_norm_mul")


def _rms_norm_fused(with_add: bool, full: bool) -> Iterator[Case]:
    yield rms_norm_mul_case(with_add, (3, 5, 64), (64,))
    yield rms_norm_mul_case(with_add, (2, 7, 65), (2, 7, 65), "perm")
    if full:
        for rows, layout in itertools.product((5, 1024, 4096), LAYOUTS):
            yield rms_norm_mul_case(with_add, (4, 3, rows), (rows,), layout)
            yield rms_norm_mul_case(with_add, (4, 3, rows), (1, 3, rows), layout)


@fused("rms_norm_mul", needs=("rms_norm", "mul"))
def _rms_norm_mul(name: str, full: bool) -> Iterator[Case]:
    return _rms_norm_fused(False, full)


@fused("rms_norm_mul_add", needs=("rms_norm", "mul", "add"))
def _rms_norm_mul_add(name: str, full: bool) -> Iterator[Case]:
    return _rms_norm_fused(True, full)
