"""Cases of the norms and the fused rms_norm+mul(+add) patterns."""

from __future__ import annotations

import itertools
from typing import Iterator

import numpy as np

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


#: norm edge rows: zeros, some +inf, a NaN, all -inf; then values in [-10, 10)
NORM_EDGE_ROWS = ((0.0,), (0.5, -0.3, np.inf, 0.7), (np.nan, 1.0), (-np.inf,))


@generator("norm", "rms_norm", "l2_norm")
def _norm_edges(op: str, full: bool) -> Iterator[Case]:
    def one(cols: int, eps: float) -> Case:
        return Case(op, f"edges 6x{cols} eps={eps:g}",
                    lambda inp: getattr(ops, op)(inp.special((6, cols), "f32", rows=NORM_EDGE_ROWS, lo=-10.0,
                                                             hi=10.0), eps), bound(op))

    # l2_norm's tiny eps: ggml's 1 / max(norm, eps), whose eps * eps would underflow
    eps = 1e-30 if op == "l2_norm" else 1e-6
    yield one(37, eps)
    yield one(64, eps)  # float4 rows
    if full:
        for cols, e in itertools.product((5, 1024, 4096), (eps, 1e-5)):
            yield one(cols, e)


@generator("group_norm")
def _group_norm_edges(op: str, full: bool) -> Iterator[Case]:
    # (2, 4, 3, 5), 2 groups: sample 0's group 0 (rows 0..5) zeros, its group 1 with +inf (NaN)
    rows = ((0.0,),) * 6 + ((0.5, np.inf, -0.25),)
    yield Case(op, "edges 2x4x3x5 groups=2 zero and inf groups",
               lambda inp: ops.group_norm(inp.special((2, 4, 3, 5), "f32", rows=rows, lo=-10.0, hi=10.0), 2),
               bound(op))


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
