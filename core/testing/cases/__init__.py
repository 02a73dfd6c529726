"""Conformance cases, after ggml's test-backend-ops: one small graph per case.

A `Case` names the op under test (its graph's first output), a label with the
shapes, dtypes and params, a builder that draws fresh random inputs, the NMSE
bound and, for perf mode, the FLOPs (memory-bound cases count bytes instead).
One module per op family, as in `opdispatch.ops`, registers a generator per op
and per fused pattern (compared on its final node); the sweep they follow
(input ranges, layouts, sizes, bounds) is docs/conformance.md's.

Each generator yields a small default set (2 to 6 cases per op: the whole
set runs in seconds on a CPU) or, with `full=True`, the whole sweep.
"""

from __future__ import annotations

from typing import Iterable

# Imported for their registrations; fused patterns are swept in the order they register.
from . import elementwise, norm, attention, rows, layout, views, reduce, matmul, collective  # noqa: F401
from .base import LAYOUTS, Case, Inputs, bound
from .perf import perf_cases
from .registry import cases, groups

__all__ = ["LAYOUTS", "Case", "Inputs", "bound", "cases", "groups", "perf_cases", "sweep"]


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
