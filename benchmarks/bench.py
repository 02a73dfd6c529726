"""Shared by the benchmarks: device timing, and plans ready to launch."""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import opdispatch as od

#: runs timed back to back before one synchronize
REPS = 20

#: bytes the instances of a cold benchmark (conftest.measure_cold) touch in all: five times the
#: H200's 50 MB L2, so no instance finds its data left in the cache by the ones before it
COLD_BYTES = 256 << 20


def cold_copies(nbytes: int, most: int = 64) -> int:
    """Instances of an op moving `nbytes` each that together touch COLD_BYTES (at least 2, at most `most`)."""
    return max(2, min(most, math.ceil(COLD_BYTES / nbytes)))


def device_seconds(fn: Callable[[], None], sync: Callable[[], None], reps: int = REPS, rounds: int = 15) -> float:
    """Median seconds of one call of `fn`, timed over `reps` calls per round.

    The launch and sync overheads of one call are amortised the same way for
    opdispatch and for the torch baseline.
    """
    fn()
    sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / reps)
    times.sort()
    return times[len(times) // 2]


def ready(outputs, feeds: dict, plugin: str, *, ops: Sequence[str] = (), kernel: str | None = None) -> od.Plan:  # noqa: ANN001
    """A plan on cuda0 with its inputs written, checked to run where the benchmark says:
    every launch (of `ops`, default all) by `plugin` on cuda0, and by `kernel` if given."""
    plan = od.compile(outputs, "cuda0")
    for s in plan.steps:
        if s.kind in ("kernel", "fused") and (not ops or s.nodes[0].op in ops):
            assert s.plugin == plugin and s.device.name == "cuda0", plan.explain()
            assert kernel is None or s.kernel == kernel, plan.explain()
    for t, v in feeds.items():
        plan.write(t, v)
    return plan
