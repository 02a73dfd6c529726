"""Drawing a fuzz case from its seed: a family (valid, or a kind of bad input), a base case it applies
to, and the family's choices. The seed alone decides all three, so a printed seed replays a case.
"""

from __future__ import annotations

import functools

import numpy as np

from . import feeds, params, tensors
from .calls import Call
from .case import Built, FuzzCase
from .catalogue import Base, bases
from .mutation import Family, Mutation, pick

#: family -> (weight, what it does to a base; None: nothing)
FAMILIES: dict[str, tuple[int, Family | None]] = {
    "valid": (30, None),
    "valid-param": (6, params.valid_param),
    "param-type": (14, params.param_type),
    "param-range": (10, params.param_range),
    "shape": (7, tensors.shape),
    "rank": (3, tensors.rank),
    "negative-dim": (2, tensors.negative_dim),
    "dtype": (7, tensors.dtype),
    "huge": (7, tensors.huge),
    "feed": (10, feeds.feed),
    "index": (6, feeds.index),
}


@functools.lru_cache(maxsize=None)
def applicable(kind: str) -> tuple[int, ...]:
    """The bases (by position) `kind` applies to (whether it does depends on shapes, not on its choices)."""
    family = FAMILIES[kind][1]
    every = bases()
    if family is None:
        return tuple(range(len(every)))
    return tuple(i for i, b in enumerate(every) if family(np.random.default_rng(0), b) is not None)


def _build(base: Base, mutation: Mutation | None, rng: np.random.Generator) -> Built:
    outputs, fed = base.case.build(rng)
    built = Built(base.case, outputs, fed)
    return mutation.apply(built, Call.of(outputs[0]), rng) if mutation else built


def draw(seed: int) -> FuzzCase:
    """The fuzz case of `seed`; nothing is built until its `build` is called."""
    rng = np.random.default_rng(seed)
    kinds = list(FAMILIES)
    weights = np.array([FAMILIES[k][0] for k in kinds], float)
    kind = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
    base = bases()[pick(rng, applicable(kind))]
    family = FAMILIES[kind][1]
    mutation = family(rng, base) if family else None
    description = base.case.name + (f" {kind}: {mutation.what}" if mutation else "")
    return FuzzCase(seed, base.call.op, kind, bool(mutation and mutation.bad), description,
                    mutation.names if mutation else (), functools.partial(_build, base, mutation))


def case_seeds(seed: int, n: int) -> list[int]:
    """The seeds of a run's n cases (a longer run of the same seed starts with the same cases)."""
    return [int(s) for s in np.random.default_rng(seed).integers(0, 2**63 - 1, n, dtype=np.int64)]
