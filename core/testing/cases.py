"""Conformance cases, after ggml's test-backend-ops: one small graph per case.

A `Case` names the op under test (its graph's first output), a label with the
shapes, dtypes and params, a builder that draws fresh random inputs, the NMSE
bound and, for perf mode, the FLOPs (memory-bound cases count bytes instead).
Generators follow the conformance sweep of OPS.md: per-op input ranges, every
dtype an op takes, contiguous and non-contiguous sources, odd sizes (5, 7,
11, 13; K = 65, 80, 588), broadcasting, and the fused patterns, each compared
on its final node.

Each generator yields a small default set (2 to 6 cases per op: the whole
set runs in seconds on a CPU) or, with `full=True`, the whole sweep. Building
a case touches no device: it only makes tensors and numpy values.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterable, Iterator, Sequence

import attrs
import numpy as np

from .. import ops
from ..dtypes import DType, dtype as as_dtype
from ..ops.base import FLOATS, OPS, QUANTS
from ..ops.elementwise import GLU_KINDS, UNARY_OPS
from ..ops.layout import TRI_KINDS
from ..tensor import Tensor, input as new_input, param

#: ops whose bound is not the 1e-7 default (OPS.md)
OP_BOUNDS: dict[str, float] = {
    "mul_mat": 5e-4, "mul_mat_id": 5e-4, "out_prod": 5e-4, "flash_attn_ext": 5e-4, "soft_max": 1e-6,
}
HALF_BOUND = 1e-4  # f16/bf16 results (DESIGN.md)
LAYOUTS = ("contig", "perm", "T", "strided")


def bound(op: str, out: str | DType = "f32", n: int = 1, src: str | DType = "f32") -> float:
    """The NMSE bound of `op` writing `out`; `n` values quantized from `src` for block formats.

    Quantized results: ggml's estimate of one code off by one in n values
    uniform in [-1, 1] (test_cpy), since a last-place tie may round either way.
    """
    base = OP_BOUNDS.get(op, 1e-7)
    dt = as_dtype(out)
    if dt.is_quant:
        step = {"q4_0": 1 / 8, "q4_1": 1 / 8, "q5_0": 1 / 16, "q5_1": 1 / 16, "q8_0": 1 / 64}[dt.name]
        err = step * step * (16 if as_dtype(src).name == "f16" else 1)
        return max(base, err / (0.25 * max(n, 1)))
    if dt.name in ("f16", "bf16"):
        return max(base, HALF_BOUND)
    return base


def _s(shape: Sequence[int]) -> str:
    return "x".join(str(n) for n in shape)


@attrs.define
class Inputs:
    """Makes a case's input tensors and draws their values; `feeds` maps each leaf to them."""

    rng: np.random.Generator
    feeds: dict[Tensor, np.ndarray] = attrs.field(factory=dict)

    def _leaf(self, shape: Sequence[int], dt: str, values: np.ndarray) -> Tensor:
        t = new_input(f"in{len(self.feeds)}", shape, dt)
        self.feeds[t] = values
        return t

    def uniform(self, shape: Sequence[int], dtype: str = "f32", lo: float = -1.0, hi: float = 1.0,
                layout: str = "contig") -> Tensor:
        """A tensor of `shape` with values uniform in [lo, hi), laid out as `layout`:

        contig; perm: axes -3 and -2 of the storage swapped (rows contiguous, out
        of order); T: the last two axes swapped (rows not contiguous); strided: a
        window on rows padded by a block at each end, at a byte offset.
        """
        shape, dt = tuple(shape), as_dtype(dtype)
        draw = lambda s: self.rng.uniform(lo, hi, s)  # noqa: E731
        if layout == "contig":
            return self._leaf(shape, dt.name, draw(shape))
        if layout == "perm" and len(shape) >= 3:
            axes = list(range(len(shape)))
            axes[-3], axes[-2] = axes[-2], axes[-3]
            leaf_shape = tuple(shape[a] for a in axes)
            return self._leaf(leaf_shape, dt.name, draw(leaf_shape)).permute(*axes)
        if layout == "T" and len(shape) >= 2 and not dt.is_quant:
            leaf_shape = shape[:-2] + (shape[-1], shape[-2])
            return self._leaf(leaf_shape, dt.name, draw(leaf_shape)).transpose()
        if layout == "strided":
            leaf_shape = shape[:-1] + (shape[-1] + 2 * dt.block_size,)
            leaf = self._leaf(leaf_shape, dt.name, draw(leaf_shape))
            return leaf.view(shape, leaf.strides, dt.block_bytes)
        raise ValueError(f"layout {layout!r} does not apply to {dt.name} {shape} (layouts: {', '.join(LAYOUTS)})")

    def ints(self, shape: Sequence[int], lo: int, hi: int, dtype: str = "i32") -> Tensor:
        """Integers uniform in [lo, hi)."""
        return self._leaf(shape, dtype, self.rng.integers(lo, hi, tuple(shape)))

    def ids(self, shape: Sequence[int], n: int, dtype: str = "i32") -> Tensor:
        """Indices in [0, n), distinct along the last axis (set_rows rows, experts per token)."""
        shape = tuple(shape)
        if shape[-1] > n:
            raise ValueError(f"{shape[-1]} distinct indices out of {n}")
        order = np.argsort(self.rng.random(shape[:-1] + (n,)), axis=-1)
        return self._leaf(shape, dtype, order[..., : shape[-1]])

    def mask(self, shape: Sequence[int], dtype: str = "f16", empty_rows: bool = False) -> Tensor:
        """An attention mask: values in [-1, 1) with a random block of -inf in each row.

        Column 0 stays finite so no row is fully masked, unless `empty_rows`
        masks every other row completely (their result is defined as 0).
        """
        shape = tuple(shape)
        values = self.rng.uniform(-1.0, 1.0, shape)
        cols = shape[-1]
        start = self.rng.integers(1, max(cols, 2), shape[:-1])[..., None]
        end = self.rng.integers(start, cols + 1)
        c = np.arange(cols)
        values[(c >= start) & (c < end)] = -np.inf
        if empty_rows:
            values[..., ::2, :] = -np.inf
        return self._leaf(shape, dtype, values)

    def weight(self, shape: Sequence[int], dtype: str, lo: float = -1.0, hi: float = 1.0) -> Tensor:
        """A param (weights fixed at build time), for plugins that prepare weights when binding."""
        return param(f"w{len(self.feeds)}", self.rng.uniform(lo, hi, tuple(shape)), dtype)


Make = Callable[[Inputs], "Tensor | Sequence[Tensor]"]


@attrs.frozen
class Case:
    """One conformance case: `make` builds the graph, its first output is the node under test."""

    op: str
    label: str
    make: Make = attrs.field(repr=False)
    bound: float = 1e-7
    #: FLOPs of one run for compute-bound ops; 0: perf mode counts bytes
    flops: int = 0
    #: bytes one run moves, where inputs + outputs overstate it (a gather reads only its rows); 0: those
    nbytes: int = 0
    #: name of the fused pattern this case exercises ("" for a single op)
    fused: str = ""
    #: maps an output's values to a comparable form (top_k returns its k indices in any order)
    canon: Callable[[np.ndarray], np.ndarray] | None = attrs.field(default=None, repr=False)

    @property
    def group(self) -> str:
        """What the summary lists it under: the op, or 'fused:<pattern>'."""
        return f"fused:{self.fused}" if self.fused else self.op

    @property
    def name(self) -> str:
        return f"{self.group}[{self.label}]"

    def build(self, rng: np.random.Generator | None = None) -> tuple[list[Tensor], dict[Tensor, np.ndarray]]:
        """(outputs, feeds): a fresh graph and fresh random values for each of its inputs."""
        inp = Inputs(rng if rng is not None else np.random.default_rng())
        got = self.make(inp)
        outputs = [got] if isinstance(got, Tensor) else list(got)
        if outputs[0].op != self.op:
            raise ValueError(f"case {self.name}: first output is a {outputs[0].op} node, not {self.op}")
        return outputs, inp.feeds


Generator = Callable[[str, bool], Iterable[Case]]
#: op name -> generator(op, full)
GENERATORS: dict[str, Generator] = {}
#: fused pattern name -> (ops it needs, generator(name, full))
FUSED: dict[str, tuple[tuple[str, ...], Generator]] = {}


def generator(*op_names: str) -> Callable[[Generator], Generator]:
    def register(fn: Generator) -> Generator:
        for name in op_names:
            GENERATORS[name] = fn
        return fn

    return register


def fused(name: str, needs: Sequence[str]) -> Callable[[Generator], Generator]:
    def register(fn: Generator) -> Generator:
        FUSED[name] = (tuple(needs), fn)
        return fn

    return register


def groups() -> list[str]:
    """Every op of `OPS`, then every fused pattern, in the order the sweep runs them."""
    return [*OPS, *(f"fused:{name}" for name in FUSED)]


def cases(group: str, full: bool = False) -> list[Case]:
    """The cases of one group (an op name or 'fused:<pattern>'); [] when it has none.

    A group without cases is an op with no generator, or a fused pattern
    whose ops are not all in `OPS` yet: callers report it, never skip it.
    """
    if group not in groups():
        raise KeyError(f"unknown op '{group}' (known: {', '.join(groups())})")
    if group.startswith("fused:"):
        name = group[len("fused:"):]
        return list(FUSED[name][1](name, full)) if _available(group) else []
    gen = GENERATORS.get(group)
    return list(gen(group, full)) if gen is not None else []


def _available(group: str) -> bool:
    """An op of `OPS`, or a fused pattern whose ops all are."""
    if group.startswith("fused:"):
        return all(n in OPS for n in FUSED[group[len("fused:"):]][0])
    return group in OPS


def sweep(select: Iterable[str] = (), full: bool = False, perf: bool = False) -> dict[str, list[Case]]:
    """group -> cases for the groups named in `select` (all when empty).

    A fused pattern may be named with or without its 'fused:' prefix; 'fused' names them all.
    With `perf`, a group that has perf cases gets those instead (see `perf_cases`).
    """
    every = groups()
    names = set(select)
    patterns = {g[len("fused:"):]: g for g in every if g.startswith("fused:")}
    unknown = names - set(every) - set(patterns) - {"fused"}
    if unknown:
        raise KeyError(f"unknown op or pattern: {', '.join(sorted(unknown))} (known: {', '.join(every)})")
    chosen = {patterns.get(n, n) for n in names} | (set(patterns.values()) if "fused" in names else set())
    return {g: (perf and perf_cases(g)) or cases(g, full) for g in every if not names or g in chosen}


def _pick(full: bool, default: Iterable, every: Iterable) -> Iterable:
    return every if full else default


# -- matrix products ------------------------------------------------------------------


def _mul_mat_case(ta: str, m: int, n: int, k: int, bs: tuple[int, int] = (1, 1), nr: tuple[int, int] = (1, 1),
                  tb: str = "f32", layout: str = "contig", weights: bool = False) -> Case:
    a_shape = (*bs, m, k)
    b_shape = (bs[0] * nr[0], bs[1] * nr[1], n, k)

    def make(inp: Inputs) -> Tensor:
        a = inp.weight(a_shape, ta) if weights else inp.uniform(a_shape, ta)
        return ops.mul_mat(a, inp.uniform(b_shape, tb, layout=layout))

    label = f"a={ta} b={tb} m={m} n={n} k={k} bs={_s(bs)} nr={_s(nr)}" + (f" b:{layout}" if layout != "contig" else "")
    batch = b_shape[0] * b_shape[1]
    return Case("mul_mat", label + (" param" if weights else ""), make, bound("mul_mat"), 2 * m * n * k * batch)


@generator("mul_mat")
def _mul_mat(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _mul_mat_case("f32", 16, 1, 65)
        yield _mul_mat_case("f16", 13, 9, 80, bs=(2, 3), nr=(1, 2))
        yield _mul_mat_case("bf16", 7, 16, 64, bs=(1, 2), layout="perm")
        yield _mul_mat_case("q4_0", 16, 1, 64, weights=True)
        yield _mul_mat_case("q8_0", 11, 8, 96)
        return
    for ta in FLOATS + QUANTS:
        for k in ((32, 96, 576) if ta in QUANTS else (65, 80, 588)):
            for n in (*range(1, 10), 16, 128, 512):
                yield _mul_mat_case(ta, 16, n, k)
    for ta, bs, nr, n in itertools.product(("f32", "f16", "q4_0", "q8_0"), ((1, 1), (1, 3), (2, 1), (2, 3)),
                                           ((1, 1), (1, 2), (2, 1), (2, 2)), (1, 9)):
        yield _mul_mat_case(ta, 13, n, 64, bs, nr)
    for ta, layout, n in itertools.product(("f32", "f16", "q8_0"), ("perm", "T", "strided"), (1, 16)):
        yield _mul_mat_case(ta, 16, n, 64, (1, 2), (2, 1), layout=layout)
    for ta, tb, n in itertools.product(("f32", "f16", "bf16"), ("f16", "bf16"), (1, 16)):
        yield _mul_mat_case(ta, 16, n, 80, tb=tb)
    for ta in ("f16", "q4_0", "q5_1"):
        yield _mul_mat_case(ta, 16, 4, 64, weights=True)


def _mul_mat_id_case(ta: str, n_exp: int, n_used: int, n_tok: int, m: int, k: int, b_rows: int) -> Case:
    def make(inp: Inputs) -> Tensor:
        experts = inp.uniform((n_exp, m, k), ta)
        b = inp.uniform((n_tok, b_rows, k))
        return ops.mul_mat_id(experts, b, inp.ids((n_tok, n_used), n_exp))

    label = f"as={ta} e={n_exp} used={n_used} t={n_tok} m={m} k={k} b_rows={b_rows}"
    return Case("mul_mat_id", label, make, bound("mul_mat_id"), 2 * m * k * n_tok * n_used)


@generator("mul_mat_id")
def _mul_mat_id(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _mul_mat_id_case("f32", 4, 2, 5, 16, 65, 2)
        yield _mul_mat_id_case("q4_0", 8, 4, 3, 16, 64, 1)
        yield _mul_mat_id_case("f16", 8, 2, 9, 13, 80, 2)
        return
    for ta in FLOATS + QUANTS:
        k = 96 if ta in QUANTS else 80
        for (n_exp, used), n_tok in itertools.product(((4, 2), (8, 4), (32, 4)), (1, 4, 32, 129)):
            for b_rows in (1, used):
                yield _mul_mat_id_case(ta, n_exp, used, n_tok, 16, k, b_rows)


def _out_prod_case(ta: str, k: int, m: int, n: int, bs: tuple[int, int] = (1, 1), nr: tuple[int, int] = (1, 1),
                   layout: str = "contig") -> Case:
    def make(inp: Inputs) -> Tensor:
        a = inp.uniform((*bs, k, m), ta)
        return ops.out_prod(a, inp.uniform((bs[0] * nr[0], bs[1] * nr[1], k, n), layout=layout))

    label = f"a={ta} k={k} m={m} n={n} bs={_s(bs)} nr={_s(nr)}" + (f" b:{layout}" if layout != "contig" else "")
    return Case("out_prod", label, make, bound("out_prod"), 2 * m * n * k * bs[0] * bs[1] * nr[0] * nr[1])


@generator("out_prod")
def _out_prod(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _out_prod_case("f32", 13, 7, 5)
        yield _out_prod_case("f16", 16, 11, 9, (2, 3), (1, 2))
        yield _out_prod_case("q8_0", 11, 64, 5)
        yield _out_prod_case("f32", 7, 13, 16, layout="T")
        return
    for ta in FLOATS + QUANTS:
        m = 64 if ta in QUANTS else 13
        for k, n in itertools.product((1, 7, 65), (1, 5, 16)):
            yield _out_prod_case(ta, k, m, n)
        for bs, nr in itertools.product(((1, 1), (2, 3)), ((1, 1), (2, 2))):
            yield _out_prod_case(ta, 16, m, 9, bs, nr)
        yield _out_prod_case(ta, 16, m, 9, layout="T")


# -- elementwise -------------------------------------------------------------------------

BINARY = ("add", "sub", "mul", "div")


def _binary_case(op: str, dt: str, b_shape: Sequence[int], nr: Sequence[int], layout: str = "contig",
                 b_dtype: str | None = None) -> Case:
    a_shape = tuple(x * r for x, r in zip((1,) * (len(nr) - len(b_shape)) + tuple(b_shape), nr))
    lo, hi = (0.9, 1.1) if op in ("mul", "div") else (-1.0, 1.0)

    def make(inp: Inputs) -> Tensor:
        a = inp.uniform(a_shape, dt, lo, hi, layout)
        b = inp.uniform(b_shape, b_dtype or dt, lo, hi, layout if tuple(b_shape) == a_shape else "contig")
        return getattr(ops, op)(a, b)

    label = f"{dt}{'+' + b_dtype if b_dtype else ''} a={_s(a_shape)} b={_s(b_shape)} {layout}"
    return Case(op, label, make, bound(op, dt))


@generator(*BINARY)
def _binary(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _binary_case(op, "f32", (3, 4, 5, 10), (1, 1, 1, 1))
        yield _binary_case(op, "f32", (1, 4, 1, 10), (2, 1, 5, 1))
        yield _binary_case(op, "f16", (2, 7, 5, 13), (1, 1, 1, 1), "perm")
        yield _binary_case(op, "bf16", (13,), (11, 7, 1), "strided")
        return
    bcasts = ((1, 1, 1, 1), (1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 1), (2, 1, 1, 1), (1, 1, 2, 2), (1, 2, 2, 2),
              (2, 2, 2, 2))
    for dt, shape, nr in itertools.product(FLOATS, ((3, 4, 5, 10), (3, 4, 5, 16), (1, 1, 1, 1)), bcasts):
        yield _binary_case(op, dt, shape, nr)
    for dt, layout in itertools.product(FLOATS, ("perm", "T", "strided")):
        yield _binary_case(op, dt, (2, 7, 5, 13), (1, 1, 1, 1), layout)
    yield _binary_case(op, "f32", (1, 1, 1, 4096), (1, 1, 32, 1))
    yield _binary_case(op, "f16", (3, 4, 5, 10), (1, 1, 1, 1), b_dtype="f32")
    yield _binary_case(op, "f16", (1, 1, 1, 10), (2, 3, 4, 1), b_dtype="f32")


def _multi_add_case(n_add: int, shape: tuple[int, ...], b_shape: tuple[int, ...]) -> Case:
    def make(inp: Inputs) -> Tensor:
        out = inp.uniform(shape)
        for _ in range(n_add):
            out = ops.add(out, inp.uniform(b_shape))
        return out

    return Case("add", f"{n_add} adds a={_s(shape)} b={_s(b_shape)}", make, bound("add"), fused="multi_add")


@fused("multi_add", needs=("add",))
def _multi_add(name: str, full: bool) -> Iterator[Case]:
    for n_add in _pick(full, (2, 5), range(2, 9)):
        yield _multi_add_case(n_add, (3, 5, 64), (3, 5, 64))
    if full:
        for n_add in (3, 8):
            yield _multi_add_case(n_add, (4, 7, 4096), (1, 1, 4096))


@generator("add1")
def _add1(op: str, full: bool) -> Iterator[Case]:
    def one(dt: str, shape: tuple[int, ...], layout: str) -> Case:
        return Case(op, f"{dt} {_s(shape)} {layout}",
                    lambda inp: ops.add1(inp.uniform(shape, dt, layout=layout), inp.uniform((1,), dt)), bound(op, dt))

    for dt, layout in _pick(full, (("f32", "contig"), ("f16", "perm")), itertools.product(FLOATS, LAYOUTS)):
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


def _map_case(op: str, dt: str, shape: Sequence[int], layout: str, lo: float, hi: float, **params: float) -> Case:
    extra = " ".join(f"{k}={v}" for k, v in params.items())
    return Case(op, f"{dt} {_s(shape)} {layout} [{lo:g},{hi:g}]" + (f" {extra}" if extra else ""),
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
        yield _map_case(op, dt, shape, layout, lo, hi)


@generator(*UNARY_OPS, "leaky_relu")
def _unary(op: str, full: bool) -> Iterator[Case]:
    for dt, shape, layout in _map_variants(full):
        lo, hi = (-10.0, 10.0) if op in EXP_LIKE and dt != "f32" else UNARY_RANGE
        yield _map_case(op, dt, shape, layout, lo, hi, **({"negative_slope": 0.1} if op == "leaky_relu" else {}))


@generator("scale")
def _scale(op: str, full: bool) -> Iterator[Case]:
    variants = (("f32", "contig", 0.5, 0.0), ("f16", "perm", 2.0, 0.25), ("bf16", "T", -1.5, 1.0))
    for dt, layout, s, b in _pick(full, variants, itertools.product(FLOATS, LAYOUTS, (0.5, -3.0), (0.0, 0.25))):
        yield _map_case(op, dt, (3, 5, 13), layout, -1.0, 1.0, s=s, bias=b)


@generator("clamp")
def _clamp(op: str, full: bool) -> Iterator[Case]:
    for dt, layout in _pick(full, (("f32", "contig"), ("f16", "T")), itertools.product(FLOATS, LAYOUTS)):
        yield _map_case(op, dt, (3, 5, 13), layout, -1.0, 1.0, min=-0.5, max=0.5)


def _glu_case(kind: str, dt: str, split: bool, swapped: bool, layout: str, rows: tuple[int, ...], nc: int) -> Case:
    lo, hi = UNARY_RANGE

    def make(inp: Inputs) -> Tensor:
        if split:
            return ops.glu_split(inp.uniform((*rows, nc), dt, lo, hi, layout),
                                 inp.uniform((*rows, nc), dt, lo, hi, layout), kind)
        return ops.glu(inp.uniform((*rows, 2 * nc), dt, lo, hi, layout), kind, swapped)

    how = "split" if split else ("swapped" if swapped else "fused")
    return Case("glu", f"{kind} {dt} {how} {_s(rows)}x{nc} {layout}", make, bound("glu", dt))


@generator("glu")
def _glu(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _glu_case("reglu", "f32", False, False, "contig", (3, 5), 64)
        yield _glu_case("geglu", "f16", False, True, "contig", (4,), 13)
        yield _glu_case("swiglu", "f32", True, False, "perm", (2, 3), 11)
        yield _glu_case("geglu_erf", "bf16", False, False, "strided", (5,), 32)
        yield _glu_case("geglu_quick", "f32", False, True, "perm", (2, 3), 7)
        yield _glu_case("swiglu_oai", "f32", True, False, "contig", (3,), 64)
        return
    for kind, dt, (split, swapped), layout in itertools.product(
            GLU_KINDS, FLOATS, ((False, False), (False, True), (True, False)), ("contig", "perm", "strided")):
        yield _glu_case(kind, dt, split, swapped, layout, (2, 7), 13)
    for kind in GLU_KINDS:
        yield _glu_case(kind, "f32", False, False, "contig", (32,), 4096)


# -- norms ---------------------------------------------------------------------------------

NORM_RANGE = (-10.0, 10.0)


@generator("norm", "rms_norm", "l2_norm")
def _norms(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], layout: str, eps: float) -> Case:
        return Case(op, f"{_s(shape)} {layout} eps={eps:g}",
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
        return Case(op, f"{_s(shape)} groups={groups} {layout}",
                    lambda inp: ops.group_norm(inp.uniform(shape, "f32", *NORM_RANGE, layout), groups), bound(op))

    yield one((2, 10, 5, 7), 4, "contig")
    yield one((1, 32, 4, 4), 8, "perm")
    if full:
        for shape, groups, layout in itertools.product(((2, 320, 8, 8), (1, 13, 11, 7)), (1, 4, 32), LAYOUTS):
            yield one(shape, groups, layout)


def _rms_norm_mul_case(with_add: bool, shape: tuple[int, ...], w_shape: tuple[int, ...],
                       layout: str = "contig") -> Case:
    def make(inp: Inputs) -> Tensor:
        out = ops.mul(ops.rms_norm(inp.uniform(shape, "f32", *NORM_RANGE, layout), 1e-6), inp.uniform(w_shape))
        return ops.add(out, inp.uniform(shape)) if with_add else out

    return Case("add" if with_add else "mul", f"x={_s(shape)} w={_s(w_shape)} {layout}", make, bound("rms_norm"),
                fused="rms_norm_mul_add" if with_add else "rms_norm_mul")


def _rms_norm_fused(with_add: bool, full: bool) -> Iterator[Case]:
    yield _rms_norm_mul_case(with_add, (3, 5, 64), (64,))
    yield _rms_norm_mul_case(with_add, (2, 7, 65), (2, 7, 65), "perm")
    if full:
        for rows, layout in itertools.product((5, 1024, 4096), LAYOUTS):
            yield _rms_norm_mul_case(with_add, (4, 3, rows), (rows,), layout)
            yield _rms_norm_mul_case(with_add, (4, 3, rows), (1, 3, rows), layout)


@fused("rms_norm_mul", needs=("rms_norm", "mul"))
def _rms_norm_mul(name: str, full: bool) -> Iterator[Case]:
    return _rms_norm_fused(False, full)


@fused("rms_norm_mul_add", needs=("rms_norm", "mul", "add"))
def _rms_norm_mul_add(name: str, full: bool) -> Iterator[Case]:
    return _rms_norm_fused(True, full)


# -- attention -----------------------------------------------------------------------------


def _soft_max_case(shape: tuple[int, ...], mask: str | None = None, scale: float = 1.0, max_bias: float = 0.0,
                   sinks: bool = False, mask_shape: tuple[int, ...] | None = None) -> Case:
    def make(inp: Inputs) -> Tensor:
        m = inp.mask(mask_shape or (1, 1, *shape[-2:]), mask) if mask else None
        s = inp.uniform((shape[-3],)) if sinks else None
        return ops.soft_max(inp.uniform(shape), m, scale, max_bias, s)

    label = f"{_s(shape)} mask={mask and _s(mask_shape or (1, 1, *shape[-2:]))}:{mask} scale={scale:g} " \
            f"max_bias={max_bias:g} sinks={sinks}"
    return Case("soft_max", label, make, bound("soft_max"))


@generator("soft_max")
def _soft_max(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _soft_max_case((1, 32, 2, 16))
        yield _soft_max_case((1, 4, 7, 32), "f16", 0.1)
        yield _soft_max_case((2, 4, 5, 13), "f32", 1.0, 8.0, True, (2, 1, 8, 13))
        return
    for cols, mask, scale, max_bias, sinks in itertools.product(
            (16, 1023, 4096), (None, "f16", "f32"), (1.0, 0.1), (0.0, 8.0), (False, True)):
        if max_bias and not mask:
            continue
        yield _soft_max_case((2, 4, 3, cols), mask, scale, max_bias, sinks)
    for mask_shape in ((1, 1, 3, 33), (2, 1, 3, 33), (1, 4, 16, 33), (2, 4, 3, 33)):
        yield _soft_max_case((2, 4, 3, 33), "f16", 0.1, 8.0, True, mask_shape)
    yield _soft_max_case((1, 3, 2, 200001))
    yield _soft_max_case((1, 3, 2, 200001), "f32", 0.1, 8.0, True)


def _rope_case(dt: str, mode: str, shape: tuple[int, ...], n_dims: int, freq_factors: bool = False,
               yarn: bool = False, layout: str = "contig") -> Case:
    b, t, h, d = shape
    params = dict(freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0, beta_fast=32.0,
                  beta_slow=1.0, n_ctx_orig=0)
    if yarn:
        params.update(freq_base=500000.0, freq_scale=0.25, ext_factor=1.0, attn_factor=1.2, n_ctx_orig=4096)

    def make(inp: Inputs) -> Tensor:
        ff = inp.uniform((n_dims // 2,), lo=0.9, hi=1.1) if freq_factors else None
        x = inp.uniform(shape, dt, layout=layout)
        return ops.rope(x, inp.ints((t,), 0, 512), n_dims, mode, freq_factors=ff, **params)

    label = f"{dt} {mode} {_s(shape)} n_dims={n_dims} ff={freq_factors} yarn={yarn} {layout}"
    return Case("rope", label, make, bound("rope", dt))


@generator("rope")
def _rope(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _rope_case("f32", "normal", (1, 7, 4, 64), 64)
        yield _rope_case("f16", "neox", (2, 5, 3, 128), 64, freq_factors=True)
        yield _rope_case("f32", "neox", (1, 5, 4, 80), 80, yarn=True, layout="perm")
        return
    for dt, mode, d, partial, ff, yarn, layout in itertools.product(
            ("f32", "f16"), ("normal", "neox"), (64, 80, 128), (False, True), (False, True), (False, True),
            ("contig", "perm")):
        yield _rope_case(dt, mode, (2, 13, 4, d), d // 2 if partial else d, ff, yarn, layout)


def _fa_case(d: int, n_kv: int, hq: int, hkv: int, n_q: int, kv: str = "f16", mask: bool = True,
             batch: int = 1, sinks: bool = False, max_bias: float = 0.0, softcap: float = 0.0,
             q_dtype: str = "f32", dv: int | None = None, empty_rows: bool = False, mask_batch: bool = False) -> Case:
    dv = dv or d
    pad = -(-n_q // 16) * 16  # mask rows padded, as ggml pads them to GGML_KQ_MASK_PAD

    def make(inp: Inputs) -> Tensor:
        q = inp.uniform((batch, hq, n_q, d), q_dtype, layout="perm")
        k = inp.uniform((batch, hkv, n_kv, d), kv, layout="perm")
        v = inp.uniform((batch, hkv, n_kv, dv), kv, layout="perm")
        m = inp.mask((batch if mask_batch else 1, 1, pad, n_kv), "f16", empty_rows) if mask or max_bias else None
        s = inp.uniform((hq,)) if sinks else None
        return ops.flash_attn_ext(q, k, v, m, 1.0 / math.sqrt(d), max_bias, softcap, s)

    label = (f"d={d}{f'/{dv}' if dv != d else ''} kv={n_kv} h={hq}/{hkv} q={n_q} b={batch} {q_dtype}/{kv} "
             f"mask={mask or bool(max_bias)}{'(b)' if mask_batch else ''}{' empty-rows' if empty_rows else ''} "
             f"sinks={sinks} max_bias={max_bias:g} softcap={softcap:g}")
    flops = 2 * batch * hq * n_q * n_kv * (d + dv)
    return Case("flash_attn_ext", label, make, bound("flash_attn_ext"), flops)


@generator("flash_attn_ext")
def _flash_attn_ext(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _fa_case(64, 113, 4, 4, 1)
        yield _fa_case(128, 113, 8, 2, 7, mask=False)
        yield _fa_case(80, 113, 4, 1, 3, "bf16", batch=2, sinks=True, softcap=10.0, mask_batch=True)
        yield _fa_case(64, 113, 4, 4, 2, "q8_0", max_bias=8.0)
        return
    for d, n_kv, gqa, mask in itertools.product((64, 80, 96, 128, 256), (113, 512, 1024), (1, 4, 8), (False, True)):
        yield _fa_case(d, n_kv, 2 * gqa, 2, 1 if n_kv != 512 else 35, mask=mask)
    for d, kv in itertools.product((64, 128), ("f32", "f16", "bf16", "q8_0", "q4_0")):
        yield _fa_case(d, 512, 8, 2, 7, kv, sinks=True)
        yield _fa_case(d, 512, 8, 2, 7, kv, max_bias=8.0)
        yield _fa_case(d, 512, 8, 2, 7, kv, softcap=10.0)
        yield _fa_case(d, 113, 4, 4, 35, kv, batch=2, mask_batch=True)
    yield _fa_case(128, 113, 4, 2, 5, q_dtype="f16")
    yield _fa_case(192, 113, 4, 1, 5, dv=128)
    yield _fa_case(64, 113, 4, 2, 8, empty_rows=True)
    yield _fa_case(64, 113, 4, 2, 8, empty_rows=True, sinks=True)


@generator("diag_mask_inf")
def _diag_mask_inf(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], n_past: int, layout: str) -> Case:
        return Case(op, f"{_s(shape)} n_past={n_past} {layout}",
                    lambda inp: ops.diag_mask_inf(inp.uniform(shape, layout=layout), n_past), bound(op))

    yield one((2, 3, 10, 10), 5, "contig")
    yield one((1, 5, 13), 0, "perm")
    if full:
        for shape, n_past, layout in itertools.product(((3, 7, 7), (2, 5, 16)), (0, 3), ("T", "strided")):
            yield one(shape, n_past, layout)


@fused("rope_set_rows", needs=("rope", "view", "set_rows"))
def _rope_set_rows(name: str, full: bool) -> Iterator[Case]:
    def one(cache: str, mode: str, n_tok: int, heads: int, d: int, rows: int, idx: str) -> Case:
        def make(inp: Inputs) -> Tensor:
            k = ops.rope(inp.uniform((1, n_tok, heads, d)), inp.ints((n_tok,), 0, 512), d, mode)
            dst = inp.uniform((rows, heads * d), cache)
            return ops.set_rows(dst, k.view((n_tok, heads * d)), inp.ids((n_tok,), rows, idx))

        return Case("set_rows", f"cache={cache} {mode} t={n_tok} h={heads} d={d} rows={rows} idx={idx}", make,
                    bound("set_rows", cache, n_tok * heads * d), fused=name)

    yield one("f16", "neox", 1, 4, 64, 32, "i64")
    yield one("f32", "normal", 5, 2, 128, 16, "i32")
    if full:
        for cache, mode, n_tok in itertools.product(("f32", "f16", "bf16", "q8_0"), ("normal", "neox"), (1, 7, 64)):
            yield one(cache, mode, n_tok, 8, 128, 256, "i64")


# -- rows and copies -----------------------------------------------------------------------


def _get_rows_case(dt: str, shape: tuple[int, ...], n: int, layout: str = "contig") -> Case:
    def make(inp: Inputs) -> Tensor:
        a = inp.ints(shape, -1000, 1000) if dt == "i32" else inp.uniform(shape, dt, layout=layout)
        return ops.get_rows(a, inp.ints((*shape[:-2], n), 0, shape[-2]))

    return Case("get_rows", f"{dt} {_s(shape)} n={n} {layout}", make, bound("get_rows"))


@generator("get_rows")
def _get_rows(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _get_rows_case("f32", (10, 5), 3)
        yield _get_rows_case("f16", (2, 3, 10, 13), 4, "perm")
        yield _get_rows_case("q4_0", (16, 64), 7)
        yield _get_rows_case("i32", (10, 5), 3)
        return
    for dt, shape, n in itertools.product(FLOATS + QUANTS, ((256, 64), (2, 3, 10, 96)), (1, 7, 32)):
        yield _get_rows_case(dt, shape, n)
    for dt, layout in itertools.product(FLOATS + ("q8_0",), ("perm", "strided")):
        yield _get_rows_case(dt, (2, 3, 10, 64), 5, layout)
    yield _get_rows_case("i32", (2, 3, 10, 13), 5)


def _set_rows_case(dst_dt: str, dst_shape: tuple[int, ...], n: int, idx_dt: str = "i64",
                   idx_batch: tuple[int, ...] = (), layout: str = "contig") -> Case:
    *batch, rows, cols = dst_shape

    def make(inp: Inputs) -> Tensor:
        dst = inp.uniform(dst_shape, dst_dt)
        src = inp.uniform((*batch, n, cols), layout=layout)
        return ops.set_rows(dst, src, inp.ids((*idx_batch, n), rows, idx_dt))

    label = f"dst={dst_dt} {_s(dst_shape)} n={n} idx={idx_dt}{_s(idx_batch) and ' ' + _s(idx_batch)} src:{layout}"
    return Case("set_rows", label, make, bound("set_rows", dst_dt, n * cols * math.prod(batch)))


@generator("set_rows")
def _set_rows(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _set_rows_case("f32", (16, 13), 5)
        yield _set_rows_case("f16", (2, 3, 10, 7), 4, "i32", (1, 3))
        yield _set_rows_case("q8_0", (8, 64), 3)
        yield _set_rows_case("bf16", (2, 3, 10, 7), 4, layout="perm")
        return
    for dt, idx_dt, (shape, idx_batch), n in itertools.product(
            FLOATS + QUANTS, ("i32", "i64"), (((256, 64), ()), ((2, 3, 16, 96), (2, 3)), ((2, 3, 16, 96), (1, 1))),
            (1, 7)):
        yield _set_rows_case(dt, shape, n, idx_dt, idx_batch)
    for dt, layout in itertools.product(FLOATS + ("q4_0",), ("perm", "T", "strided")):
        yield _set_rows_case(dt, (2, 3, 16, 64), 5, layout=layout)


def _cpy_case(src: str, dst: str, shape: tuple[int, ...], layout: str = "contig", dst_shape: tuple[int, ...] = ()) -> Case:
    lo, hi = (-100.0, 100.0) if "i32" in (src, dst) else (-1.0, 1.0)
    dst_shape = dst_shape or shape

    def make(inp: Inputs) -> Tensor:
        a = inp.ints(shape, -1000, 1000) if src == "i32" else inp.uniform(shape, src, lo, hi, layout)
        return ops.cpy(a, inp.uniform(dst_shape, dst) if dst != "i32" else inp.ints(dst_shape, -5, 5))

    label = f"{src}->{dst} {_s(shape)}{'->' + _s(dst_shape) if dst_shape != shape else ''} {layout}"
    return Case("cpy", label, make, bound("cpy", dst, math.prod(shape), src))


@generator("cpy")
def _cpy(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _cpy_case("f32", "f16", (5, 7, 13), "T")
        yield _cpy_case("f16", "f32", (2, 5, 7, 13), "perm", (70, 13))
        yield _cpy_case("f32", "q8_0", (4, 64))
        yield _cpy_case("q4_0", "f32", (3, 64), "strided")
        return
    plain = FLOATS + ("i32",)
    for src, dst, layout in itertools.product(plain, plain, LAYOUTS):
        if not (src == "i32" and layout != "contig"):
            yield _cpy_case(src, dst, (2, 3, 5, 13), layout)
    for q, f, layout in itertools.product(QUANTS, FLOATS, ("contig", "perm", "strided")):
        yield _cpy_case(f, q, (2, 3, 5, 64), layout)
        yield _cpy_case(q, f, (2, 3, 5, 64), layout)
    yield _cpy_case("f32", "f16", (256, 4096), dst_shape=(4096, 256))


def _copy_like(op: str, full: bool,
               variants: Sequence[tuple[str, str, tuple[int, ...], tuple[int, ...] | None]]) -> Iterator[Case]:
    """dup and cont: (dtype, layout, shape, cont's new shape or None) for the default sweep."""
    def one(dt: str, layout: str, shape: tuple[int, ...], new_shape: tuple[int, ...] | None) -> Case:
        def make(inp: Inputs) -> Tensor:
            a = inp.ints(shape, -1000, 1000) if dt == "i32" else inp.uniform(shape, dt, layout=layout)
            return ops.cont(a, new_shape) if new_shape else getattr(ops, op)(a)

        return Case(op, f"{dt} {_s(shape)}{'->' + _s(new_shape) if new_shape else ''} {layout}", make, bound(op, dt))

    if not full:
        for variant in variants:
            yield one(*variant)
        return
    for dt, layout in itertools.product(FLOATS + ("i32",) + QUANTS, LAYOUTS):
        if (dt in QUANTS and layout == "T") or (dt == "i32" and layout != "contig"):
            continue
        yield one(dt, layout, (2, 3, 5, 64), None)
        if op == "cont":
            yield one(dt, layout, (2, 3, 5, 64), (6, 5 * 64))


@generator("dup")
def _dup(op: str, full: bool) -> Iterator[Case]:
    return _copy_like(op, full, (("f32", "T", (3, 5, 7), None), ("f16", "perm", (2, 3, 5, 13), None),
                                 ("q4_0", "strided", (3, 64), None), ("i32", "contig", (5, 7), None)))


@generator("cont")
def _cont(op: str, full: bool) -> Iterator[Case]:
    return _copy_like(op, full, (("f32", "T", (3, 5, 7), None), ("bf16", "perm", (2, 3, 5, 13), (6, 65)),
                                 ("q8_0", "perm", (2, 3, 4, 64), (6, 256))))


def _set_acc_case(op: str, dt: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...], at: int,
                  strides: tuple[int, ...] | None = None) -> Case:
    def make(inp: Inputs) -> Tensor:
        if dt == "i32":
            a, b = inp.ints(a_shape, -1000, 1000), inp.ints(b_shape, -1000, 1000)
        else:
            a, b = inp.uniform(a_shape), inp.uniform(b_shape)
        return getattr(ops, op)(a, b, at * 4, strides)

    return Case(op, f"{dt} a={_s(a_shape)} b={_s(b_shape)} at={at} strides={strides}", make, bound(op))


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


# -- layout ops -------------------------------------------------------------------------------


@generator("concat")
def _concat(op: str, full: bool) -> Iterator[Case]:
    def one(dt: str, a_shape: tuple[int, ...], axis: int, extra: int, layout: str) -> Case:
        b_shape = tuple(n + extra if i == axis % len(a_shape) else n for i, n in enumerate(a_shape))

        def make(inp: Inputs) -> Tensor:
            if dt == "i32":
                return ops.concat(inp.ints(a_shape, -99, 99), inp.ints(b_shape, -99, 99), axis)
            return ops.concat(inp.uniform(a_shape, dt, layout=layout), inp.uniform(b_shape, dt), axis)

        return Case(op, f"{dt} a={_s(a_shape)} b={_s(b_shape)} axis={axis} {layout}", make, bound(op, dt))

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

        return Case(op, f"{dt} {_s(shape)}->{_s(to)} {layout}", make, bound(op, dt))

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
        return Case(op, f"{_s(shape)} pads={pads} {layout}",
                    lambda inp: ops.pad(inp.uniform(shape, layout=layout), pads), bound(op))

    yield one((3, 5, 7), ((0, 1), (2, 0), (1, 3)), "contig")
    yield one((2, 3, 5, 7), ((1, 0), (0, 0), (0, 2), (3, 1)), "perm")
    if full:
        for layout in ("T", "strided"):
            yield one((2, 3, 5, 7), ((1, 1), (2, 2), (0, 3), (4, 0)), layout)


@generator("pad_reflect_1d")
def _pad_reflect_1d(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], p0: int, p1: int, layout: str) -> Case:
        return Case(op, f"{_s(shape)} p0={p0} p1={p1} {layout}",
                    lambda inp: ops.pad_reflect_1d(inp.uniform(shape, layout=layout), p0, p1), bound(op))

    yield one((3, 10), 2, 3, "contig")
    yield one((2, 4, 13), 0, 5, "perm")
    if full:
        for layout in ("T", "strided"):
            yield one((3, 5, 64), 7, 9, layout)


@generator("roll")
def _roll(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], shifts: tuple[int, ...], layout: str) -> Case:
        return Case(op, f"{_s(shape)} shifts={shifts} {layout}",
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

    for args in _pick(full, ((0, 10, 1), (-3.5, 7.25, 0.75)),
                      ((0, 10, 1), (-3.5, 7.25, 0.75), (0, 100000, 1), (1.0, 2.0, 0.001))):
        yield one(*args)


@generator("fill")
def _fill(op: str, full: bool) -> Iterator[Case]:
    def one(dt: str, shape: tuple[int, ...], value: float) -> Case:
        return Case(op, f"{dt} {_s(shape)} value={value}", lambda inp: ops.fill(inp.uniform(shape, dt), value),
                    bound(op, dt))

    for args in _pick(full, (("f32", (3, 5), 2.5), ("f16", (2, 3, 4), -1.25)),
                      itertools.product(("f32", "f16"), ((3, 5), (2, 3, 5, 7), (4096,)), (0.0, -1.25))):
        yield one(*args)


@generator("diag")
def _diag(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...]) -> Case:
        return Case(op, _s(shape), lambda inp: ops.diag(inp.uniform(shape)), bound(op))

    for shape in _pick(full, ((7,), (2, 3, 1, 5)), ((7,), (2, 3, 1, 5), (1, 64), (3, 1, 13))):
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

    for args in _pick(full, ((5, 16, 10000), (3, 15, 10000)),
                      ((5, 16, 10000), (3, 15, 10000), (2, 320, 10000), (7, 1281, 100))):
        yield one(*args)


# -- views --------------------------------------------------------------------------------


@generator("view", "reshape", "permute", "transpose")
def _views(op: str, full: bool) -> Iterator[Case]:
    shape = (2, 3, 20)
    take: Callable[[Tensor], Tensor] = {
        "view": lambda t: t.view((3, 5), (t.strides[-2], 8), 12),
        "reshape": lambda t: t.reshape(6, 5, 4),
        "permute": lambda t: t.permute(2, 0, 1),
        "transpose": lambda t: t.transpose(),
    }[op]
    yield Case(op, f"of an input {_s(shape)}", lambda inp: take(inp.uniform(shape)), bound(op))
    yield Case(op, f"of a node {_s(shape)}", lambda inp: take(ops.neg(inp.uniform(shape))), bound(op))


# -- reductions and sorting -----------------------------------------------------------------


@generator("sum", "sum_rows", "mean", "cumsum")
def _sums(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], layout: str, dt: str = "f32") -> Case:
        # Positive values: a sum that cancels to ~0 would make NMSE measure rounding, not the kernel.
        return Case(op, f"{dt} {_s(shape)} {layout}",
                    lambda inp: getattr(ops, op)(inp.uniform(shape, dt, 0.1, 1.0, layout)), bound(op, dt))

    yield one((3, 4, 5, 10), "contig")
    yield one((2, 7, 65), "perm")
    if not full:
        return
    for layout in LAYOUTS:
        yield one((13, 11, 7, 5), layout)
    yield one((4, 4096), "T")
    yield one((1, 1 << 16), "contig")
    if op == "sum":
        for dt in ("f16", "bf16"):
            yield one((13, 11, 7, 5), "perm", dt)


@generator("argmax")
def _argmax(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...]) -> Case:
        return Case(op, _s(shape), lambda inp: ops.argmax(inp.uniform(shape)), bound(op))

    # (1, 32000): a decode step's logits, which GPUs split over blocks
    for shape in _pick(full, ((5, 13), (3, 100), (1, 32000)),
                       ((5, 13), (3, 100), (1, 32000), (64, 4096), (6, 32001), (16, 128256), (1 << 16,))):
        yield one(shape)


@fused("greedy_pick", needs=("argmax", "cpy", "view", "set_rows"))
def _greedy_pick(name: str, full: bool) -> Iterator[Case]:
    """LlamaModel.build(greedy=True)'s last nodes: argmax -> cpy (i32) -> cpy (f32, rows of one value in
    a view) -> set_rows of those into a log, in that execution order."""
    def one(b: int, vocab: int, idx: str) -> Case:
        def make(inp: Inputs) -> list[Tensor]:
            picked = ops.argmax(inp.uniform((b, vocab)))
            as_f32 = ops.cpy(picked, inp.uniform((b + 1, 1)).view((b, 1), (4, 4), 4))
            log = ops.set_rows(inp.uniform((4 * b, 1)), as_f32, inp.ids((b,), 4 * b, idx))
            return [ops.cpy(picked, inp.ints((b,), -9, 0)), log, as_f32]  # every destination compared

        return Case("cpy", f"b={b} vocab={vocab} idx={idx}", make, bound("cpy"), fused=name)

    yield one(1, 32000, "i64")
    if full:
        for b, vocab, idx in itertools.product((3, 16), (31, 128256), ("i32", "i64")):
            yield one(b, vocab, idx)


@generator("count_equal")
def _count_equal(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...]) -> Case:
        return Case(op, _s(shape), lambda inp: ops.count_equal(inp.ints(shape, 0, 4), inp.ints(shape, 0, 4)),
                    bound(op))

    for shape in _pick(full, ((4, 500), (3, 5, 7)), ((4, 500), (3, 5, 7), (1, 1 << 20))):
        yield one(shape)


@generator("argsort")
def _argsort(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], order: str) -> Case:
        return Case(op, f"{_s(shape)} {order}", lambda inp: ops.argsort(inp.uniform(shape), order), bound(op))

    for n, order in itertools.product((16, 33) if not full else (1, 7, 16, 33, 1000, 1024, 4097, 1 << 16, 1 << 20),
                                      ("asc", "desc")):
        yield one((3 if n <= 4097 else 1, n), order)


@generator("top_k")
def _top_k(op: str, full: bool) -> Iterator[Case]:
    def one(rows: int, n: int, k: int) -> Case:
        # The k indices come in any order: compare them sorted.
        return Case(op, f"{rows}x{n} k={k}", lambda inp: ops.top_k(inp.uniform((rows, n)), k), bound(op),
                    canon=lambda v: np.sort(v, axis=-1))

    for args in _pick(full, ((3, 32, 4), (5, 100, 10)),
                      ((3, 32, 4), (5, 100, 10), (2, 4096, 40), (1, 1 << 16, 8), (7, 128, 128))):
        yield one(*args)


@fused("topk_moe", needs=("soft_max", "top_k", "get_rows", "reshape"))
def _topk_moe(name: str, full: bool) -> Iterator[Case]:
    def one(n_tok: int, n_exp: int, k: int) -> Case:
        def make(inp: Inputs) -> Tensor:
            probs = ops.soft_max(inp.uniform((n_tok, n_exp)))
            picked = ops.top_k(probs, k)
            return ops.get_rows(probs.reshape(n_tok, n_exp, 1), picked)

        # The k weights of a token come in top_k's order, which is free: compare them sorted.
        return Case("get_rows", f"t={n_tok} e={n_exp} k={k}", make, bound("soft_max"), fused=name,
                    canon=lambda v: np.sort(v, axis=-2))

    yield one(5, 8, 2)
    if full:
        for n_tok, (n_exp, k) in itertools.product((1, 7, 512), ((8, 2), (32, 4), (128, 8))):
            yield one(n_tok, n_exp, k)


# -- fused matmul patterns ------------------------------------------------------------------------


@fused("mul_mat_add", needs=("mul_mat", "add"))
def _mul_mat_add(name: str, full: bool) -> Iterator[Case]:
    def one(ta: str, m: int, n: int, k: int) -> Case:
        def make(inp: Inputs) -> Tensor:
            return ops.add(ops.mul_mat(inp.uniform((m, k), ta), inp.uniform((n, k))), inp.uniform((m,)))

        return Case("add", f"a={ta} m={m} n={n} k={k}", make, bound("mul_mat"), 2 * m * n * k, fused=name)

    yield one("f16", 16, 1, 64)
    yield one("q8_0", 13, 7, 96)
    if full:
        for ta, n in itertools.product(FLOATS + QUANTS, (1, 8, 64)):
            yield one(ta, 64, n, 256)


@fused("mul_mat_glu", needs=("mul_mat", "glu"))
def _mul_mat_glu(name: str, full: bool) -> Iterator[Case]:
    def one(ta: str, kind: str, m: int, n: int, k: int) -> Case:
        def make(inp: Inputs) -> Tensor:
            x = inp.uniform((n, k))
            gate, up = (ops.mul_mat(inp.uniform((m, k), ta), x) for _ in range(2))
            return ops.glu_split(gate, up, kind)

        return Case("glu", f"{kind} a={ta} m={m} n={n} k={k}", make, bound("mul_mat"), 4 * m * n * k, fused=name)

    yield one("f16", "swiglu", 16, 1, 64)
    yield one("q4_0", "geglu", 13, 3, 96)
    if full:
        for ta, kind, n in itertools.product(("f32", "f16", "bf16", "q4_0", "q8_0"), ("swiglu", "geglu"), (1, 8)):
            yield one(ta, kind, 64, n, 256)


# -- perf mode ------------------------------------------------------------------------------------


def _bytes_only(case: Case) -> Case:
    """`case` measured in bytes/s: mat-vec and decode attention are bound by memory, not FLOPs."""
    return attrs.evolve(case, flops=0)


#: perf mode's cases: shapes large enough for bandwidth and FLOPs to show (DESIGN.md's targets),
#: after ggml's make_test_cases_perf; a group without any is timed on its test cases
PERF: dict[str, Callable[[], list[Case]]] = {
    "add": lambda: [_binary_case("add", "f32", (16384, 4096), (1, 1)), _binary_case("add", "f32", (4096,), (16384, 1))],
    "mul": lambda: [_binary_case("mul", "f32", (4096,), (16384, 1)), _binary_case("mul", "bf16", (16384, 4096), (1, 1))],
    "scale": lambda: [_map_case("scale", "f32", (16384, 4096), "contig", -1.0, 1.0, s=0.5, bias=0.0)],
    "silu": lambda: [_map_case("silu", dt, (16384, 4096), "contig", -10.0, 10.0) for dt in ("f32", "bf16")],
    "gelu": lambda: [_map_case("gelu", "f32", (16384, 4096), "contig", -10.0, 10.0)],
    "glu": lambda: [_glu_case("swiglu", dt, True, False, "contig", (4096,), 14336) for dt in ("f32", "bf16")],
    "norm": lambda: [Case("norm", "16384x4096", lambda inp: ops.norm(inp.uniform((16384, 4096), lo=-10, hi=10)))],
    "rms_norm": lambda: [Case("rms_norm", "16384x4096",
                              lambda inp: ops.rms_norm(inp.uniform((16384, 4096), lo=-10, hi=10)))],
    "fused:rms_norm_mul": lambda: [_rms_norm_mul_case(False, (16384, 4096), (4096,))],
    "fused:rms_norm_mul_add": lambda: [_rms_norm_mul_case(True, (16384, 4096), (4096,))],
    "fused:multi_add": lambda: [_multi_add_case(4, (8192, 4096), (8192, 4096))],
    "soft_max": lambda: [_soft_max_case((1, 32, 512, 4096), "f16", 0.088)],
    "rope": lambda: [_rope_case(dt, "neox", (1, 4096, 32, 128), 128) for dt in ("f32", "f16")],
    "cpy": lambda: [_cpy_case("f32", dst, (16384, 4096)) for dst in ("f16", "bf16", "q8_0")],
    "dup": lambda: [Case("dup", "f32 16384x4096", lambda inp: ops.dup(inp.uniform((16384, 4096))))],
    "get_rows": lambda: [attrs.evolve(_get_rows_case(dt, (32000, 4096), 512), nbytes=512 * (row + 4096 * 4))
                         for dt, row in (("f32", 4096 * 4), ("q8_0", 4096 // 32 * 34))],
    "set_rows": lambda: [attrs.evolve(_set_rows_case("f16", (8192, 1024), 512), nbytes=512 * 1024 * (4 + 2))],
    "mul_mat": lambda: [
        *(_mul_mat_case(dt, 8192, 8192, 8192, tb=dt) for dt in ("f16", "bf16")),
        _mul_mat_case("bf16", 4096, 512, 4096, tb="bf16"),
        *(_bytes_only(_mul_mat_case(dt, 32768, 1, 4096)) for dt in ("bf16", "q8_0", "q4_0")),
    ],
    "flash_attn_ext": lambda: [
        _bytes_only(_fa_case(128, 8192, 32, 8, 1, mask=False)),
        _fa_case(128, 4096, 32, 8, 4096),
    ],
    "argsort": lambda: [Case("argsort", "64x4096 desc", lambda inp: ops.argsort(inp.uniform((64, 4096)), "desc"))],
}


def perf_cases(group: str) -> list[Case]:
    """Perf mode's cases of `group`; [] when it has none."""
    return PERF[group]() if group in PERF and _available(group) else []
