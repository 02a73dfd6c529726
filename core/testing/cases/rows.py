"""Cases of the row and copy ops: get_rows, set_rows, cpy, dup, cont, set, acc."""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Sequence

from ... import ops
from ...ops.base import BLOCK_FORMATS, ENCODABLE, FLOATS, QUANTS
from ...tensor import Tensor
from .base import LAYOUTS, SAMPLED, Case, Inputs, block, bound, dims
from .registry import generator


def get_rows_case(dt: str, shape: tuple[int, ...], n: int, layout: str = "contig") -> Case:
    def make(inp: Inputs) -> Tensor:
        a = inp.ints(shape, -1000, 1000) if dt == "i32" else inp.source(shape, dt, layout)
        return ops.get_rows(a, inp.ints((*shape[:-2], n), 0, shape[-2]))

    return Case("get_rows", f"{dt} {dims(shape)} n={n} {layout}", make, bound("get_rows"))


@generator("get_rows")
def _get_rows(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield get_rows_case("f32", (10, 5), 3)
        yield get_rows_case("f16", (2, 3, 10, 13), 4, "perm")
        yield get_rows_case("q4_0", (16, 64), 7)
        yield get_rows_case("i32", (10, 5), 3)
        yield get_rows_case("q4_K", (16, 512), 5)
        yield get_rows_case("iq2_xs", (2, 3, 10, 256), 4, "perm")
        yield get_rows_case("mxfp4", (7, 64), 9, "strided")
        return
    for dt, shape, n in itertools.product(FLOATS + QUANTS, ((256, 64), (2, 3, 10, 96)), (1, 7, 32)):
        yield get_rows_case(dt, shape, n)
    for dt, layout in itertools.product(FLOATS + ("q8_0",), ("perm", "strided")):
        yield get_rows_case(dt, (2, 3, 10, 64), 5, layout)
    for dt in SAMPLED:
        for shape, n in itertools.product(((37, block(dt, 2)), (2, 3, 10, block(dt))), (1, 7, 32)):
            yield get_rows_case(dt, shape, n)
        for layout in ("perm", "strided"):
            yield get_rows_case(dt, (2, 3, 10, block(dt)), 5, layout)
    yield get_rows_case("i32", (2, 3, 10, 13), 5)


def set_rows_case(dst_dt: str, dst_shape: tuple[int, ...], n: int, idx_dt: str = "i64",
                  idx_batch: tuple[int, ...] = (), layout: str = "contig") -> Case:
    *batch, rows, cols = dst_shape

    def make(inp: Inputs) -> Tensor:
        dst = inp.uniform(dst_shape, dst_dt)
        src = inp.uniform((*batch, n, cols), layout=layout)
        return ops.set_rows(dst, src, inp.ids((*idx_batch, n), rows, idx_dt))

    label = f"dst={dst_dt} {dims(dst_shape)} n={n} idx={idx_dt}{dims(idx_batch) and ' ' + dims(idx_batch)} src:{layout}"
    return Case("set_rows", label, make, bound("set_rows", dst_dt, n * cols * math.prod(batch)))


@generator("set_rows")
def _set_rows(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield set_rows_case("f32", (16, 13), 5)
        yield set_rows_case("f16", (2, 3, 10, 7), 4, "i32", (1, 3))
        yield set_rows_case("q8_0", (8, 64), 3)
        yield set_rows_case("bf16", (2, 3, 10, 7), 4, layout="perm")
        yield set_rows_case("q4_K", (8, 256), 3)
        return
    for dt, idx_dt, (shape, idx_batch), n in itertools.product(
            FLOATS + QUANTS, ("i32", "i64"), (((256, 64), ()), ((2, 3, 16, 96), (2, 3)), ((2, 3, 16, 96), (1, 1))),
            (1, 7)):
        yield set_rows_case(dt, shape, n, idx_dt, idx_batch)
    for dt, layout in itertools.product(FLOATS + ("q4_0",), ("perm", "T", "strided")):
        yield set_rows_case(dt, (2, 3, 16, 64), 5, layout=layout)
    for dt, idx_dt, n in itertools.product((q for q in SAMPLED if q in ENCODABLE), ("i32", "i64"), (1, 7)):
        yield set_rows_case(dt, (2, 3, 16, block(dt)), n, idx_dt, (2, 3))


def cpy_case(src: str, dst: str, shape: tuple[int, ...], layout: str = "contig",
             dst_shape: tuple[int, ...] = ()) -> Case:
    lo, hi = (-100.0, 100.0) if "i32" in (src, dst) else (-1.0, 1.0)
    dst_shape = dst_shape or shape

    def make(inp: Inputs) -> Tensor:
        a = inp.ints(shape, -1000, 1000) if src == "i32" else inp.source(shape, src, layout, lo, hi)
        return ops.cpy(a, inp.source(dst_shape, dst) if dst != "i32" else inp.ints(dst_shape, -5, 5))

    label = f"{src}->{dst} {dims(shape)}{'->' + dims(dst_shape) if dst_shape != shape else ''} {layout}"
    return Case("cpy", label, make, bound("cpy", dst, math.prod(shape), src))


@generator("cpy")
def _cpy(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield cpy_case("f32", "f16", (5, 7, 13), "T")
        yield cpy_case("f16", "f32", (2, 5, 7, 13), "perm", (70, 13))
        yield cpy_case("f32", "q8_0", (4, 64))
        yield cpy_case("q4_0", "f32", (3, 64), "strided")
        yield cpy_case("q6_K", "f32", (3, 256), "strided")
        yield cpy_case("iq3_xxs", "f16", (2, 3, 256), "perm")
        yield cpy_case("f32", "mxfp4", (4, 64))
        return
    plain = FLOATS + ("i32",)
    for src, dst, layout in itertools.product(plain, plain, LAYOUTS):
        if not (src == "i32" and layout != "contig"):
            yield cpy_case(src, dst, (2, 3, 5, 13), layout)
    for q, f, layout in itertools.product(QUANTS, FLOATS, ("contig", "perm", "strided")):
        yield cpy_case(f, q, (2, 3, 5, 64), layout)
        yield cpy_case(q, f, (2, 3, 5, 64), layout)
    for q, f, layout in itertools.product(SAMPLED, FLOATS, ("contig", "perm", "strided")):
        if q in ENCODABLE:
            yield cpy_case(f, q, (2, 3, 5, block(q)), layout)
        yield cpy_case(q, f, (2, 3, 5, block(q)), layout)
    for q in BLOCK_FORMATS:  # a block format to itself: blocks copied as they are
        yield cpy_case(q, q, (2, 3, 5, block(q)), "perm")
    yield cpy_case("f32", "f16", (256, 4096), dst_shape=(4096, 256))


def _copy_like(op: str, full: bool,
               variants: Sequence[tuple[str, str, tuple[int, ...], tuple[int, ...] | None]]) -> Iterator[Case]:
    """dup and cont: (dtype, layout, shape, cont's new shape or None) for the default sweep."""
    def one(dt: str, layout: str, shape: tuple[int, ...], new_shape: tuple[int, ...] | None) -> Case:
        def make(inp: Inputs) -> Tensor:
            a = inp.ints(shape, -1000, 1000) if dt == "i32" else inp.source(shape, dt, layout)
            return ops.cont(a, new_shape) if new_shape else getattr(ops, op)(a)

        label = f"{dt} {dims(shape)}{'->' + dims(new_shape) if new_shape else ''} {layout}"
        return Case(op, label, make, bound(op, dt, src=dt))

    if not full:
        for variant in variants:
            yield one(*variant)
        return
    for dt, layout in itertools.product(FLOATS + ("i32",) + BLOCK_FORMATS, LAYOUTS):
        if (dt in BLOCK_FORMATS and layout == "T") or (dt == "i32" and layout != "contig"):
            continue
        k = block(dt, 2) if dt in SAMPLED else 64
        yield one(dt, layout, (2, 3, 5, k), None)
        if op == "cont":
            yield one(dt, layout, (2, 3, 5, k), (6, 5 * k))


@generator("dup")
def _dup(op: str, full: bool) -> Iterator[Case]:
    return _copy_like(op, full, (("f32", "T", (3, 5, 7), None), ("f16", "perm", (2, 3, 5, 13), None),
                                 ("q4_0", "strided", (3, 64), None), ("i32", "contig", (5, 7), None),
                                 ("q5_K", "perm", (2, 3, 4, 256), None), ("iq1_m", "strided", (3, 256), None)))


@generator("cont")
def _cont(op: str, full: bool) -> Iterator[Case]:
    return _copy_like(op, full, (("f32", "T", (3, 5, 7), None), ("bf16", "perm", (2, 3, 5, 13), (6, 65)),
                                 ("q8_0", "perm", (2, 3, 4, 64), (6, 256)), ("iq4_xs", "strided", (3, 256), None),
                                 ("iq2_s", "perm", (2, 3, 4, 256), (6, 1024))))


def _set_acc_case(op: str, dt: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...], at: int,
                  strides: tuple[int, ...] | None = None) -> Case:
    def make(inp: Inputs) -> Tensor:
        if dt == "i32":
            a, b = inp.ints(a_shape, -1000, 1000), inp.ints(b_shape, -1000, 1000)
        else:
            a, b = inp.uniform(a_shape), inp.uniform(b_shape)
        return getattr(ops, op)(a, b, at * 4, strides)

    return Case(op, f"{dt} a={dims(a_shape)} b={dims(b_shape)} at={at} strides={strides}", make, bound(op))


@generator("set", "acc")
def _set_acc(op: str, full: bool) -> Iterator[Case]:
    yield _set_acc_case(op, "f32", (5, 13), (7,), 4)
    yield _set_acc_case(op, "f32", (6, 10), (3, 4), 12)
    if op == "set":
        yield _set_acc_case(op, "i32", (2, 6, 10), (2, 3, 4), 22)
    else:
        yield _set_acc_case(op, "f32", (6, 10), (2, 3), 1, (80, 4))
    if full:
        yield _set_acc_case(op, "f32", (4, 64, 64), (2, 32, 32), 64 * 8 + 8)
        yield _set_acc_case(op, "f32", (2, 3, 5, 7), (3, 5, 7), 3 * 5 * 7)
