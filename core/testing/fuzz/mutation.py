"""`Mutation`: what a fuzz family does to a valid base case, and the helpers the families share.

A family looks at a base (shapes, dtypes, params: no values) and returns a mutation, or None where
it does not apply; the mutation's `apply` runs in the worker, on a fresh build of the base.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import attrs
import numpy as np

from ...dtypes import dtype as as_dtype
from ...tensor import Tensor, input as new_input
from .calls import Call
from .case import Built
from .catalogue import Base

Apply = Callable[[Built, Call, np.random.Generator], Built]


@attrs.frozen
class Mutation:
    kind: str
    bad: bool
    #: what was changed, for the case's description
    what: str
    apply: Apply = attrs.field(repr=False)
    #: tensor or input names an error may name instead of the op
    names: tuple[str, ...] = ()


Family = Callable[[np.random.Generator, Base], "Mutation | None"]


def pick(rng: np.random.Generator, options: Sequence[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


def reachable(outputs: Iterable[Tensor]) -> set[Tensor]:
    """Every tensor the outputs read, through sources and view bases."""
    seen: set[Tensor] = set()
    todo = list(outputs)
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        todo.extend(s for s in t.srcs if s is not None)
        if t.view_src is not None:
            todo.append(t.view_src)
    return seen


def rebuilt(built: Built, node: Tensor, extra: dict[Tensor, Any] | None = None) -> Built:
    """`built` with `node` as its only output, feeds for the inputs it still reads (and `extra`'s)."""
    feeds = {**built.feeds, **(extra or {})}
    live = reachable([node])
    return Built(built.case, [node], {t: v for t, v in feeds.items() if t in live})


def values(rng: np.random.Generator, shape: Sequence[int], dt: str) -> np.ndarray:
    """Values for a new input: floats in [-1, 1), integers 0 (an index in range of any table)."""
    if as_dtype(dt).is_int:
        return np.zeros(tuple(shape), np.int64)
    return rng.uniform(-1.0, 1.0, tuple(shape))


def replace_tensor(name: str, shape: Sequence[int], dt: str) -> Apply:
    """Apply: the call's tensor `name` replaced by a new input 'fz_<name>' of `shape` and `dt`."""
    def apply(built: Built, call: Call, rng: np.random.Generator) -> Built:
        leaf = new_input(f"fz_{name}", shape, dt)
        return rebuilt(built, call.with_tensor(name, leaf).invoke(), {leaf: values(rng, shape, dt)})

    return apply
