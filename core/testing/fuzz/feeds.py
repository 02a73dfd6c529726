"""Bad feeds, and index data out of range.

A bad feed is given to a plan that has run with good feeds: a second graph of the same structure
(the plan cache gives it the first one's plan), so that errors must name this graph's inputs, not
those of the graph the plan was made for. Index data past the table (the row count, 2**31-1,
2**63-1) or negative is fed to get_rows, set_rows, add_id and mul_mat_id, directly or through a
`top_k` whose scores put a row's maximum past the range.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ...tensor import Tensor, input as new_input
from .calls import Call
from .case import Built
from .catalogue import Base
from .mutation import Mutation, pick

BadValue = Callable[[np.ndarray], Any]


def _resized(v: np.ndarray, delta: int) -> np.ndarray:
    return np.resize(v, (*v.shape[:-1], v.shape[-1] + delta))


def _objects(v: np.ndarray) -> np.ndarray:
    out = np.empty(v.shape, object)
    out.fill(object())
    return out


def _overflowing(t: Tensor) -> BadValue:
    """An integer feed with one value that t's dtype cannot hold."""
    def make(v: np.ndarray) -> np.ndarray:
        if t.dtype.name == "i64":
            out = np.asarray(v).astype(np.uint64)
            out.flat[0] = 2**64 - 1
        else:
            out = np.asarray(v).astype(np.int64)
            out.flat[0] = 2**40
        return out

    return make


def _bad_values(t: Tensor) -> list[tuple[BadValue, str]]:
    """(bad value from the good one, why) for input t."""
    dt = t.dtype
    out: list[tuple[BadValue, str]] = [
        (lambda v: _resized(v, dt.block_size), "a last axis one block longer"),
        (lambda v: np.asarray(v)[None], "an extra leading axis"),
        (lambda v: np.asarray(v).astype(str), "an array of numeric strings"),
        (lambda v: "abc", "a string"),
        (_objects, "an array of objects"),
        (lambda v: None, "None"),
    ]
    if dt.is_int:
        out += [(lambda v: np.asarray(v, np.float64), "a float array for an integer input"),
                (_overflowing(t), f"a value {dt.name} cannot hold")]
    else:
        out += [(lambda v: np.asarray(v) + 1j, "a complex array"),
                (lambda v: np.zeros(np.shape(v), "datetime64[s]"), "a datetime array")]
    if dt.is_quant:
        raw = t.array_layout()[0]
        out.append((lambda v: np.zeros((*raw[:-1], raw[-1] + 1), np.uint8), "raw blocks a byte too long"))
    return out


def _named(built: Built, name: str) -> Tensor:
    return next(t for t in built.feeds if t.name == name)


def feed(rng: np.random.Generator, base: Base) -> Mutation | None:
    if not base.inputs:
        return None
    leaf = pick(rng, base.inputs)
    name = leaf.name
    options: list[tuple[BadValue | str, str]] = [*_bad_values(leaf), ("missing", "no value"),
                                                 ("unknown", "a value for a tensor not in the graph")]
    how, why = pick(rng, options)

    def apply(built: Built, call: Call, rng: np.random.Generator) -> Built:
        t = _named(built, name)
        bad = dict(built.feeds)
        if how == "missing":
            del bad[t]
        elif how == "unknown":
            bad[new_input("fz_unknown", t.shape, t.dtype)] = built.feeds[t]
        else:
            bad[t] = how(built.feeds[t])
        return Built(built.case, built.outputs, built.feeds, bad)

    names = ("fz_unknown",) if how == "unknown" else (name,)
    return Mutation("feed", True, f"input '{name}' {leaf.shape} {leaf.dtype.name} fed {why}", apply, names)


#: op -> (index argument, table argument, the table's axis the index ranges over)
INDEXED = {"get_rows": ("idx", "a", -2), "set_rows": ("idx", "dst", -2), "add_id": ("ids", "b", 0),
           "mul_mat_id": ("ids", "as_", 0)}


def index(rng: np.random.Generator, base: Base) -> Mutation | None:
    spec = INDEXED.get(base.call.op)
    if spec is None:
        return None
    slot, table, axis = spec
    idx = base.call.t(slot)
    n = base.call.t(table).shape[axis]
    if idx.is_leaf:
        return _direct(rng, idx, n)
    scores = idx.srcs[0] if idx.op == "top_k" else None
    if scores is not None and scores.is_leaf and scores.shape[-1] > n:
        return _computed(rng, scores, n)
    return None


def _direct(rng: np.random.Generator, idx: Tensor, n: int) -> Mutation:
    values = [n, n + 7, 2**31 - 1, -1, -(n + 1), -2**31] + ([2**63 - 1, -2**63] if idx.dtype.name == "i64" else [])
    value = pick(rng, values)
    pos = int(rng.integers(idx.size))
    name = idx.name

    def apply(built: Built, call: Call, rng: np.random.Generator) -> Built:
        t = _named(built, name)
        arr = np.asarray(built.feeds[t]).astype(t.dtype.numpy)
        arr.flat[pos] = value
        return Built(built.case, built.outputs, built.feeds, {**built.feeds, t: arr})

    return Mutation("index", True, f"{name}.flat[{pos}] = {value} (range [0, {n}))", apply, (name,))


def _computed(rng: np.random.Generator, scores: Tensor, n: int) -> Mutation:
    cols = scores.shape[-1]
    row = int(rng.integers(scores.size // cols))
    col = int(rng.integers(n, cols))
    name = scores.name

    def apply(built: Built, call: Call, rng: np.random.Generator) -> Built:
        t = _named(built, name)
        arr = np.array(built.feeds[t], np.float64)
        arr.reshape(-1, cols)[row, col] = arr.max() + 1.0
        return Built(built.case, built.outputs, built.feeds, {**built.feeds, t: arr})

    return Mutation("index", True, f"top_k picks column {col} of '{name}' row {row} (range [0, {n}))", apply,
                    (name,))
