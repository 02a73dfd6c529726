"""The valid cases fuzz cases start from: every default conformance case, and graphs whose indices are
computed (`top_k` feeding get_rows, set_rows, add_id and mul_mat_id, the MoE router's path).

Each `Base` is built once with a fixed seed to learn its node under test's call and input leaves;
shapes, dtypes and leaf names do not depend on the seed, only values do.
"""

from __future__ import annotations

import functools
from typing import Callable

import attrs
import numpy as np

from ... import ops
from ...tensor import Tensor
from ..cases import Case, Inputs, bound, cases, groups
from .calls import Call


@attrs.frozen
class Base:
    case: Case
    call: Call
    #: the graph's input leaves (fed at each run), in feed order
    inputs: tuple[Tensor, ...]


def _router(inp: Inputs, shape: tuple[int, ...], valid: int) -> Tensor:
    """Scores whose row maxima lie in the first `valid` columns: top_k(scores, 1) is in [0, valid)."""
    scores = inp.uniform(shape, lo=-1.0, hi=-0.5)
    inp.feeds[scores][..., :valid] += 1.5
    return scores


def _computed(op: str, label: str, make: Callable[[Inputs], Tensor]) -> Case:
    return Case(op, f"{label}, index = top_k(scores, 1)", make, bound(op))


#: graphs whose index source is a node: the index is in range for the good feeds, and a bad feed moves
#: a row's maximum past the range (the runtime index checks must catch computed indices too)
COMPUTED = (
    _computed("get_rows", "f32 6x5 scores=11", lambda inp: ops.get_rows(
        inp.uniform((6, 5)), ops.top_k(_router(inp, (11,), 6), 1))),
    _computed("set_rows", "f32 6x5 scores=11", lambda inp: ops.set_rows(
        inp.uniform((6, 5)), inp.uniform((1, 5)), ops.top_k(_router(inp, (11,), 6), 1))),
    _computed("add_id", "f32 t=3 c=13 e=4 scores=9", lambda inp: ops.add_id(
        inp.uniform((3, 1, 13)), inp.uniform((4, 13)), ops.top_k(_router(inp, (3, 9), 4), 1))),
    _computed("mul_mat_id", "f32 e=4 m=16 k=65 t=3 scores=9", lambda inp: ops.mul_mat_id(
        inp.uniform((4, 16, 65)), inp.uniform((3, 1, 65)), ops.top_k(_router(inp, (3, 9), 4), 1))),
)


@functools.lru_cache(maxsize=1)
def bases() -> tuple[Base, ...]:
    """Every default conformance case, then the computed-index graphs."""
    every = [c for g in groups() for c in cases(g)] + list(COMPUTED)
    out = []
    for case in every:
        outputs, feeds = case.build(np.random.default_rng(0))
        out.append(Base(case, Call.of(outputs[0]), tuple(feeds)))
    return tuple(out)
