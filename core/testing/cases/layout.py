"""Cases of the layout ops: concat, repeat, pad, pad_reflect_1d, roll, arange, fill, diag, tri, timestep_embedding."""

from __future__ import annotations

import itertools
from typing import Iterator

from ... import ops
from ...ops.base import FLOATS, QUANTS
from ...ops.layout import TRI_KINDS
from ...tensor import Tensor
from .base import LAYOUTS, Case, Inputs, bound, dims, pick
from .registry import generator


@generator("concat")
def _concat(op: str, full: bool) -> Iterator[Case]:
    def one(dt: str, a_shape: tuple[int, ...], axis: int, extra: int, layout: str) -> Case:
        b_shape = tuple(n + extra if i == axis % len(a_shape) else n for i, n in enumerate(a_shape))

        def make(inp: Inputs) -> Tensor:
            if dt == "i32":
                return ops.concat(inp.ints(a_shape, -99, 99), inp.ints(b_shape, -99, 99), axis)
            return ops.concat(inp.uniform(a_shape, dt, layout=layout), inp.uniform(b_shape, dt), axis)

        return Case(op, f"{dt} a={dims(a_shape)} b={dims(b_shape)} axis={axis} {layout}", make, bound(op, dt))

    if not full:
        yield one("f32", (3, 5, 7), -1, -3, "contig")
        yield one("f16", (2, 3, 5, 7), 0, 1, "perm")
        yield one("i32", (3, 5, 7), 1, 2, "contig")
        yield one("q8_0", (2, 64), 0, 1, "contig")
        return
    for dt, axis, layout in itertools.product(FLOATS + ("i32",), range(4), LAYOUTS):
        if dt != "i32" or layout == "contig":
            yield one(dt, (2, 3, 5, 7), axis, 2, layout)
    for q, axis in itertools.product(QUANTS, range(3)):
        yield one(q, (2, 3, 64), axis, 32 if axis == 2 else 1, "contig")


@generator("repeat")
def _repeat(op: str, full: bool) -> Iterator[Case]:
    def one(dt: str, shape: tuple[int, ...], to: tuple[int, ...], layout: str = "contig") -> Case:
        def make(inp: Inputs) -> Tensor:
            a = inp.ints(shape, -99, 99, dt) if dt in ("i16", "i32") else inp.uniform(shape, dt, layout=layout)
            return ops.repeat(a, to)

        return Case(op, f"{dt} {dims(shape)}->{dims(to)} {layout}", make, bound(op, dt))

    yield one("f32", (1, 3, 1, 5), (2, 3, 4, 10))
    yield one("f16", (5,), (2, 3, 10))
    yield one("i32", (2, 3), (4, 3))
    if full:
        for dt, layout in itertools.product(FLOATS, ("perm", "T", "strided")):
            yield one(dt, (2, 3, 5), (4, 6, 10), layout)
        yield one("i16", (3, 5), (2, 6, 5))


@generator("pad")
def _pad(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], pads: tuple[tuple[int, int], ...], layout: str) -> Case:
        return Case(op, f"{dims(shape)} pads={pads} {layout}",
                    lambda inp: ops.pad(inp.uniform(shape, layout=layout), pads), bound(op))

    yield one((3, 5, 7), ((0, 1), (2, 0), (1, 3)), "contig")
    yield one((2, 3, 5, 7), ((1, 0), (0, 0), (0, 2), (3, 1)), "perm")
    if full:
        for layout in ("T", "strided"):
            yield one((2, 3, 5, 7), ((1, 1), (2, 2), (0, 3), (4, 0)), layout)


@generator("pad_reflect_1d")
def _pad_reflect_1d(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], p0: int, p1: int, layout: str) -> Case:
        return Case(op, f"{dims(shape)} p0={p0} p1={p1} {layout}",
                    lambda inp: ops.pad_reflect_1d(inp.uniform(shape, layout=layout), p0, p1), bound(op))

    yield one((3, 10), 2, 3, "contig")
    yield one((2, 4, 13), 0, 5, "perm")
    if full:
        for layout in ("T", "strided"):
            yield one((3, 5, 64), 7, 9, layout)


@generator("roll")
def _roll(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], shifts: tuple[int, ...], layout: str) -> Case:
        return Case(op, f"{dims(shape)} shifts={shifts} {layout}",
                    lambda inp: ops.roll(inp.uniform(shape, layout=layout), shifts), bound(op))

    yield one((3, 5, 7), (1, -2, 3), "contig")
    yield one((2, 3, 4, 5), (0, 1, 0, -4), "perm")
    if full:
        for layout in ("T", "strided"):
            yield one((2, 3, 4, 13), (1, -2, 3, 12), layout)


@generator("arange")
def _arange(op: str, full: bool) -> Iterator[Case]:
    def one(start: float, stop: float, step: float) -> Case:
        return Case(op, f"{start}..{stop} step {step}", lambda inp: ops.arange(start, stop, step), bound(op))

    for args in pick(full, ((0, 10, 1), (-3.5, 7.25, 0.75)),
                      ((0, 10, 1), (-3.5, 7.25, 0.75), (0, 100000, 1), (1.0, 2.0, 0.001))):
        yield one(*args)


@generator("fill")
def _fill(op: str, full: bool) -> Iterator[Case]:
    def one(dt: str, shape: tuple[int, ...], value: float) -> Case:
        return Case(op, f"{dt} {dims(shape)} value={value}", lambda inp: ops.fill(inp.uniform(shape, dt), value),
                    bound(op, dt))

    for args in pick(full, (("f32", (3, 5), 2.5), ("f16", (2, 3, 4), -1.25)),
                      itertools.product(("f32", "f16"), ((3, 5), (2, 3, 5, 7), (4096,)), (0.0, -1.25))):
        yield one(*args)


@generator("diag")
def _diag(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...]) -> Case:
        return Case(op, dims(shape), lambda inp: ops.diag(inp.uniform(shape)), bound(op))

    for shape in pick(full, ((7,), (2, 3, 1, 5)), ((7,), (2, 3, 1, 5), (1, 64), (3, 1, 13))):
        yield one(shape)


@generator("tri")
def _tri(op: str, full: bool) -> Iterator[Case]:
    def one(kind: str, layout: str) -> Case:
        return Case(op, f"{kind} 2x5x5 {layout}", lambda inp: ops.tri(inp.uniform((2, 5, 5), layout=layout), kind),
                    bound(op))

    for kind, layout in itertools.product(TRI_KINDS, LAYOUTS if full else ("contig",)):
        yield one(kind, layout)


@generator("timestep_embedding")
def _timestep_embedding(op: str, full: bool) -> Iterator[Case]:
    def one(n: int, dim: int, period: int) -> Case:
        return Case(op, f"n={n} dim={dim} max_period={period}",
                    lambda inp: ops.timestep_embedding(inp.uniform((n,), lo=0.0, hi=1000.0), dim, period), bound(op))

    for args in pick(full, ((5, 16, 10000), (3, 15, 10000)),
                      ((5, 16, 10000), (3, 15, 10000), (2, 320, 10000), (7, 1281, 100))):
        yield one(*args)
