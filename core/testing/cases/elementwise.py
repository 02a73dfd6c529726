"""Cases of the elementwise ops: binary with broadcasting, maps, unary, scale, clamp, glu, multi_add."""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator, Sequence

from ... import ops
from ...ops.base import FLOATS
from ...ops.elementwise import GLU_KINDS, UNARY_OPS
from ...tensor import Tensor
from .base import EDGES, LAYOUTS, NON_FINITE, ZEROS, Case, Inputs, bound, dims, pick
from .registry import fused, generator

BINARY = ("add", "sub", "mul", "div")


def binary_case(op: str, dt: str, b_shape: Sequence[int], nr: Sequence[int], layout: str = "contig",
                b_dtype: str | None = None) -> Case:
    a_shape = tuple(x * r for x, r in zip((1,) * (len(nr) - len(b_shape)) + tuple(b_shape), nr))
    lo, hi = (0.9, 1.1) if op in ("mul", "div") else (-1.0, 1.0)

    def make(inp: Inputs) -> Tensor:
        a = inp.uniform(a_shape, dt, lo, hi, layout)
        b = inp.uniform(b_shape, b_dtype or dt, lo, hi, layout if tuple(b_shape) == a_shape else "contig")
        return getattr(ops, op)(a, b)

    label = f"{dt}{'+' + b_dtype if b_dtype else ''} a={dims(a_shape)} b={dims(b_shape)} {layout}"
    return Case(op, label, make, bound(op, dt))


@generator(*BINARY)
def _binary(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield binary_case(op, "f32", (3, 4, 5, 10), (1, 1, 1, 1))
        yield binary_case(op, "f32", (1, 4, 1, 10), (2, 1, 5, 1))
        yield binary_case(op, "f16", (2, 7, 5, 13), (1, 1, 1, 1), "perm")
        yield binary_case(op, "bf16", (13,), (11, 7, 1), "strided")
        return
    bcasts = ((1, 1, 1, 1), (1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 1), (2, 1, 1, 1), (1, 1, 2, 2), (1, 2, 2, 2),
              (2, 2, 2, 2))
    for dt, shape, nr in itertools.product(FLOATS, ((3, 4, 5, 10), (3, 4, 5, 16), (1, 1, 1, 1)), bcasts):
        yield binary_case(op, dt, shape, nr)
    for dt, layout in itertools.product(FLOATS, ("perm", "T", "strided")):
        yield binary_case(op, dt, (2, 7, 5, 13), (1, 1, 1, 1), layout)
    yield binary_case(op, "f32", (1, 1, 1, 4096), (1, 1, 32, 1))
    yield binary_case(op, "f16", (3, 4, 5, 10), (1, 1, 1, 1), b_dtype="f32")
    yield binary_case(op, "f16", (1, 1, 1, 10), (2, 3, 4, 1), b_dtype="f32")


def multi_add_case(n_add: int, shape: tuple[int, ...], b_shape: tuple[int, ...]) -> Case:
    def make(inp: Inputs) -> Tensor:
        out = inp.uniform(shape)
        for _ in range(n_add):
            out = ops.add(out, inp.uniform(b_shape))
        return out

    return Case("add", f"{n_add} adds a={dims(shape)} b={dims(b_shape)}", make, bound("add"), fused="multi_add")


@fused("multi_add", needs=("add",))
def _multi_add(name: str, full: bool) -> Iterator[Case]:
    for n_add in pick(full, (2, 5), range(2, 9)):
        yield multi_add_case(n_add, (3, 5, 64), (3, 5, 64))
    if full:
        for n_add in (3, 8):
            yield multi_add_case(n_add, (4, 7, 4096), (1, 1, 4096))


@generator("add1")
def _add1(op: str, full: bool) -> Iterator[Case]:
    def one(dt: str, shape: tuple[int, ...], layout: str) -> Case:
        return Case(op, f"{dt} {dims(shape)} {layout}",
                    lambda inp: ops.add1(inp.uniform(shape, dt, layout=layout), inp.uniform((1,), dt)), bound(op, dt))

    for dt, layout in pick(full, (("f32", "contig"), ("f16", "perm")), itertools.product(FLOATS, LAYOUTS)):
        yield one(dt, (5, 7, 11), layout)


@generator("add_id")
def _add_id(op: str, full: bool) -> Iterator[Case]:
    def one(dt: str, t: int, u: int, c: int, n_exp: int, layout: str) -> Case:
        def make(inp: Inputs) -> Tensor:
            return ops.add_id(inp.uniform((t, u, c), dt, layout=layout), inp.uniform((n_exp, c), dt),
                              inp.ints((t, u), 0, n_exp))

        return Case(op, f"{dt} t={t} u={u} c={c} e={n_exp} {layout}", make, bound(op, dt))

    yield one("f32", 5, 2, 13, 4, "contig")
    yield one("f16", 3, 4, 64, 8, "perm")
    if full:
        for dt, layout in itertools.product(FLOATS, LAYOUTS):
            yield one(dt, 32, 4, 2880, 32, layout)


def map_case(op: str, dt: str, shape: Sequence[int], layout: str, lo: float, hi: float, **params: float) -> Case:
    extra = " ".join(f"{k}={v}" for k, v in params.items())
    return Case(op, f"{dt} {dims(shape)} {layout} [{lo:g},{hi:g}]" + (f" {extra}" if extra else ""),
                lambda inp: getattr(ops, op)(inp.uniform(shape, dt, lo, hi, layout), **params), bound(op, dt))


#: input ranges of the maps whose domain or periodicity asks for one (ggml's test choices)
MAP_RANGES: dict[str, tuple[float, float]] = {
    "sqrt": (0.0, 10.0), "log": (0.1, 10.0), "sin": (-6.5, 6.5), "cos": (-6.5, 6.5),
}
EXP_LIKE = ("exp", "expm1", "softplus")
UNARY_RANGE = (-150.0, 150.0)


def _map_variants(full: bool) -> Iterable[tuple[str, tuple[int, ...], str]]:
    if not full:
        return (("f32", (13, 11, 7, 5), "contig"), ("f16", (2, 128, 5), "T"))
    return itertools.product(FLOATS, ((13, 11, 7, 5), (2, 2, 2, 128)), LAYOUTS)


@generator("sqr", "sqrt", "log", "sin", "cos")
def _maps(op: str, full: bool) -> Iterator[Case]:
    lo, hi = MAP_RANGES.get(op, (-1.0, 1.0))
    for dt, shape, layout in _map_variants(full):
        yield map_case(op, dt, shape, layout, lo, hi)


@generator(*UNARY_OPS, "leaky_relu")
def _unary(op: str, full: bool) -> Iterator[Case]:
    for dt, shape, layout in _map_variants(full):
        lo, hi = (-10.0, 10.0) if op in EXP_LIKE and dt != "f32" else UNARY_RANGE
        yield map_case(op, dt, shape, layout, lo, hi, **({"negative_slope": 0.1} if op == "leaky_relu" else {}))


@generator("scale")
def _scale(op: str, full: bool) -> Iterator[Case]:
    variants = (("f32", "contig", 0.5, 0.0), ("f16", "perm", 2.0, 0.25), ("bf16", "T", -1.5, 1.0))
    for dt, layout, s, b in pick(full, variants, itertools.product(FLOATS, LAYOUTS, (0.5, -3.0), (0.0, 0.25))):
        yield map_case(op, dt, (3, 5, 13), layout, -1.0, 1.0, s=s, bias=b)


@generator("clamp")
def _clamp(op: str, full: bool) -> Iterator[Case]:
    for dt, layout in pick(full, (("f32", "contig"), ("f16", "T")), itertools.product(FLOATS, LAYOUTS)):
        yield map_case(op, dt, (3, 5, 13), layout, -1.0, 1.0, min=-0.5, max=0.5)


def glu_case(kind: str, dt: str, split: bool, swapped: bool, layout: str, rows: tuple[int, ...], nc: int) -> Case:
    lo, hi = UNARY_RANGE

    def make(inp: Inputs) -> Tensor:
        if split:
            return ops.glu_split(inp.uniform((*rows, nc), dt, lo, hi, layout),
                                 inp.uniform((*rows, nc), dt, lo, hi, layout), kind)
        return ops.glu(inp.uniform((*rows, 2 * nc), dt, lo, hi, layout), kind, swapped)

    how = "split" if split else ("swapped" if swapped else "fused")
    return Case("glu", f"{kind} {dt} {how} {dims(rows)}x{nc} {layout}", make, bound("glu", dt))


@generator("glu")
def _glu(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield glu_case("reglu", "f32", False, False, "contig", (3, 5), 64)
        yield glu_case("geglu", "f16", False, True, "contig", (4,), 13)
        yield glu_case("swiglu", "f32", True, False, "perm", (2, 3), 11)
        yield glu_case("geglu_erf", "bf16", False, False, "strided", (5,), 32)
        yield glu_case("geglu_quick", "f32", False, True, "perm", (2, 3), 7)
        yield glu_case("swiglu_oai", "f32", True, False, "contig", (3,), 64)
        return
    for kind, dt, (split, swapped), layout in itertools.product(
            GLU_KINDS, FLOATS, ((False, False), (False, True), (True, False)), ("contig", "perm", "strided")):
        yield glu_case(kind, dt, split, swapped, layout, (2, 7), 13)
    for kind in GLU_KINDS:
        yield glu_case(kind, "f32", False, False, "contig", (32,), 4096)


# -- edge values (docs/ops.md, "Edge values") --------------------------------------------------------

EDGE_RANGE = (-10.0, 10.0)


def edge_map_case(op: str, dt: str, **params: float) -> Case:
    """A map over values in [-10, 10) with a third of them infinities, NaN, signed zeros and subnormals."""
    lo, hi = EDGE_RANGE
    extra = "".join(f" {k}={v:g}" for k, v in params.items())
    return Case(op, f"edges {dt} 7x33{extra}",
                lambda inp: getattr(ops, op)(inp.special((7, 33), dt, EDGES, 1 / 3, lo, hi), **params), bound(op, dt))


@generator("sqr", "sqrt", "log", "sin", "cos", *UNARY_OPS, "leaky_relu")
def _map_edges(op: str, full: bool) -> Iterator[Case]:
    for dt in pick(full, ("f32", "bf16"), FLOATS):
        yield edge_map_case(op, dt, **({"negative_slope": 0.1} if op == "leaky_relu" else {}))


@generator("scale", "clamp")
def _param_map_edges(op: str, full: bool) -> Iterator[Case]:
    params = {"s": -2.0, "bias": 0.5} if op == "scale" else {"min": -0.5, "max": 0.5}
    for dt in pick(full, ("f32",), FLOATS):
        yield edge_map_case(op, dt, **params)


@generator(*BINARY)
def _binary_edges(op: str, full: bool) -> Iterator[Case]:
    # x / subnormal and subnormal * inf are left out: the GPUs flush a subnormal operand to zero
    # (docs/ops.md, "Edge values")
    values = NON_FINITE + ZEROS if op in ("div", "mul") else EDGES

    def one(dt: str) -> Case:
        def make(inp: Inputs) -> Tensor:
            return getattr(ops, op)(inp.special((3, 5, 33), dt, values, 0.25), inp.special((5, 33), dt, values, 0.25))

        return Case(op, f"edges {dt} a=3x5x33 b=5x33", make, bound(op, dt))

    for dt in pick(full, ("f32",), FLOATS):
        yield one(dt)


@generator("glu")
def _glu_edges(op: str, full: bool) -> Iterator[Case]:
    def one(kind: str, dt: str) -> Case:
        def make(inp: Inputs) -> Tensor:
            # no subnormals: the product flushes them (subnormal * inf; docs/ops.md, "Edge values")
            return ops.glu(inp.special((5, 2 * 33), dt, NON_FINITE + ZEROS, 0.25, *EDGE_RANGE), kind)

        return Case(op, f"edges {kind} {dt} 5x33", make, bound(op, dt))

    for kind, dt in pick(full, (("swiglu", "f32"), ("swiglu_oai", "f32")), itertools.product(GLU_KINDS, FLOATS)):
        yield one(kind, dt)
