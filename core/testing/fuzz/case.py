"""What a fuzz case is (`FuzzCase`, the graph it builds: `Built`) and what running one can give (`Outcome`).

A case is drawn from its seed alone, without building anything, so the runner knows its
description and whether it is bad even when the worker that builds and runs it dies.
"""

from __future__ import annotations

import enum
import re
from typing import Any, Callable

import attrs
import numpy as np

from ...tensor import Tensor
from ..cases import Case


class Outcome(str, enum.Enum):
    MATCH = "match"  # a valid case whose result equals the CPU reference within the harness bounds
    NAMED = "named"  # an OpdispatchError whose message names the op, or the tensor or input concerned
    CRASH = "crash"  # the worker process died
    HANG = "hang"  # the case ran past its timeout
    UNNAMED = "unnamed"  # any other exception, or an OpdispatchError that names nothing of the case
    ACCEPTED = "accepted"  # a bad case that ran without error
    MISMATCH = "mismatch"  # a valid run whose result is wrong (or that raised after a bad run of its plan)


#: the outcomes that fail a fuzz run
FAILING = (Outcome.CRASH, Outcome.HANG, Outcome.UNNAMED, Outcome.ACCEPTED, Outcome.MISMATCH)


@attrs.define
class Built:
    """A case's graph: its outputs, good feeds and, for a bad-feed case, the bad feeds.

    `case` gives the NMSE bound and the comparable form of the outputs (as in the conformance sweep).
    """

    case: Case
    outputs: list[Tensor]
    feeds: dict[Tensor, Any]
    bad_feeds: dict[Tensor, Any] | None = None


@attrs.frozen
class FuzzCase:
    """One case: everything but `build` is known from the seed without building a tensor."""

    seed: int
    op: str
    #: "valid", "valid-param", or the mutation family: "param-type", "feed", "index", ...
    kind: str
    bad: bool
    description: str
    #: names besides the op that an error may name instead (the tensor or input changed)
    names: tuple[str, ...]
    build: Callable[[np.random.Generator], Built] = attrs.field(repr=False)

    def names_any(self, message: str) -> bool:
        """Whether `message` names the op or one of `names` as a whole word ('sum' is not in 'sum_rows')."""
        return any(re.search(rf"(?<![\w]){re.escape(n)}(?!\w)", message) for n in (self.op, *self.names))
