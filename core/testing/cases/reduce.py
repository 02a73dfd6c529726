"""Cases of the reductions and sorts, and the fused greedy_pick and topk_moe patterns."""

from __future__ import annotations

import itertools
from typing import Iterator

import numpy as np

from ... import ops
from ...tensor import Tensor
from .base import LAYOUTS, NON_FINITE, SUBNORMALS, ZEROS, Case, Inputs, bound, dims, pick
from .registry import fused, generator


@generator("sum", "sum_rows", "mean", "cumsum")
def _sums(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], layout: str, dt: str = "f32") -> Case:
        # Positive values: a sum that cancels to ~0 would make NMSE measure rounding, not the kernel.
        return Case(op, f"{dt} {dims(shape)} {layout}",
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


# -- edge values (docs/ops.md, "Edge values") --------------------------------------------------------

#: sum edge rows: +inf (inf), +inf and -inf (NaN), a NaN; then values in [0.1, 1)
SUM_EDGE_ROWS = ((0.5, np.inf, 0.25), (0.5, np.inf, -np.inf), (0.3, np.nan))


@generator("sum", "sum_rows", "mean", "cumsum")
def _sum_edges(op: str, full: bool) -> Iterator[Case]:
    if op == "sum":  # one number: a +inf in it, no -inf or NaN
        make = lambda inp: ops.sum(inp.special((3, 5, 37), "f32", (np.inf,), 0.01, 0.1, 1.0))  # noqa: E731
    else:
        make = lambda inp: getattr(ops, op)(inp.special((5, 37), "f32", rows=SUM_EDGE_ROWS, lo=0.1, hi=1.0))  # noqa: E731
    yield Case(op, "edges", make, bound(op))


def tied(inp: Inputs, shape: tuple[int, ...], share: float = 0.2) -> np.ndarray:
    """Small integers (many ties) with a `share` of NaN, infinities, signed zeros and subnormals."""
    values = inp.rng.integers(-3, 4, shape).astype(np.float64)
    hit = inp.rng.random(shape) < share
    values[hit] = inp.rng.choice(np.asarray(NON_FINITE + ZEROS + SUBNORMALS), int(hit.sum()))
    return values


@generator("argmax")
def _argmax_edges(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...]) -> Case:
        def make(inp: Inputs) -> Tensor:
            values = tied(inp, shape)
            values[0] = np.nan  # a row of NaN: 0
            values[1, ::2] = np.nan  # NaN and -inf: the last -inf
            values[1, 1::2] = -np.inf
            values[(values != 0) & (np.abs(values) < 1e-30)] = 2.0  # no subnormals: the GPUs compare them as 0
            return ops.argmax(inp.given(values))

        return Case(op, f"edges {dims(shape)} ties, NaN, -inf", make, bound(op))

    yield one((6, 13))
    yield one((2, 32000))  # rows split over blocks


@generator("argsort")
def _argsort_edges(op: str, full: bool) -> Iterator[Case]:
    for n, order in itertools.product((33, 1000) if full else (33,), ("asc", "desc")):
        yield Case(op, f"edges 3x{n} {order} ties, NaN, inf, zeros, subnormals",
                   lambda inp, n=n, order=order: ops.argsort(inp.given(tied(inp, (3, n))), order), bound(op))


@generator("top_k")
def _top_k_edges(op: str, full: bool) -> Iterator[Case]:
    yield Case(op, "edges 3x100 k=10 ties, NaN, inf, zeros, subnormals",
               lambda inp: ops.top_k(inp.given(tied(inp, (3, 100))), 10), bound(op), canon=lambda v: np.sort(v, axis=-1))


@generator("argmax")
def _argmax(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...]) -> Case:
        return Case(op, dims(shape), lambda inp: ops.argmax(inp.uniform(shape)), bound(op))

    # (1, 32000): a decode step's logits, which GPUs split over blocks
    for shape in pick(full, ((5, 13), (3, 100), (1, 32000)),
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
        return Case(op, dims(shape), lambda inp: ops.count_equal(inp.ints(shape, 0, 4), inp.ints(shape, 0, 4)),
                    bound(op))

    for shape in pick(full, ((4, 500), (3, 5, 7)), ((4, 500), (3, 5, 7), (1, 1 << 20))):
        yield one(shape)


@generator("argsort")
def _argsort(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], order: str) -> Case:
        return Case(op, f"{dims(shape)} {order}", lambda inp: ops.argsort(inp.uniform(shape), order), bound(op))

    for n, order in itertools.product((16, 33) if not full else (1, 7, 16, 33, 1000, 1024, 4097, 1 << 16, 1 << 20),
                                      ("asc", "desc")):
        yield one((3 if n <= 4097 else 1, n), order)


@generator("top_k")
def _top_k(op: str, full: bool) -> Iterator[Case]:
    def one(rows: int, n: int, k: int) -> Case:
        # The k indices come in any order: compare them sorted.
        return Case(op, f"{rows}x{n} k={k}", lambda inp: ops.top_k(inp.uniform((rows, n)), k), bound(op),
                    canon=lambda v: np.sort(v, axis=-1))

    for args in pick(full, ((3, 32, 4), (5, 100, 10)),
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

    def edges(inp: Inputs) -> Tensor:
        # a row of -inf (probabilities 0), a row with a NaN (every probability NaN), then finite logits
        probs = ops.soft_max(inp.special((5, 8), "f32", rows=((-np.inf,), (0.5, np.nan))))
        return ops.get_rows(probs.reshape(5, 8, 1), ops.top_k(probs, 2))

    yield Case("get_rows", "edges t=5 e=8 k=2 -inf and NaN rows", edges, bound("soft_max"), fused=name,
               canon=lambda v: np.sort(v, axis=-2))
