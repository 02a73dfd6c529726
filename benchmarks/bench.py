"""Shared by the benchmarks: device timing, and plans ready to launch."""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import attrs

import opdispatch as od

#: runs timed back to back before one synchronize
REPS = 20

#: bytes the input sets of a cold benchmark (conftest.measure_cold) hold in all: five times the
#: H200's 50 MB L2, so no instance finds its data left in the cache by the ones before it
COLD_BYTES = 256 << 20
#: instances a cold benchmark's CUDA graph holds at least, so that the cost of launching the graph
#: (and of its first node, which waits for nothing) is spread thin
COLD_INSTANCES = 32


@attrs.frozen
class Cold:
    """A cold benchmark's layout: `sets` input sets (COLD_BYTES or more in all), taken in turn by
    `instances` instances of the op (a multiple of `sets`)."""

    sets: int
    instances: int

    def of(self, i: int) -> int:
        """The input set of instance i."""
        return i % self.sets


def cold(nbytes: int, most_sets: int = 64) -> Cold:
    """The layout for an op moving `nbytes` an instance (at least 2 sets, at most `most_sets`)."""
    sets = max(2, min(most_sets, math.ceil(COLD_BYTES / nbytes)))
    return Cold(sets, sets * math.ceil(COLD_INSTANCES / sets))


def device_seconds(fn: Callable[[], None], sync: Callable[[], None], reps: int = REPS, rounds: int = 15) -> float:
    """Median seconds of one call of `fn`, timed over `reps` calls per round.

    The launch and sync overheads of one call are amortised the same way for
    opdispatch and for the torch baseline.
    """
    return interleaved_seconds([(fn, sync)], reps, rounds)[0]


def interleaved_seconds(timed: Sequence[tuple[Callable[[], object], Callable[[], None]]], reps: int = REPS,
                        rounds: int = 15) -> list[float]:
    """device_seconds of each (fn, sync) pair, their rounds taken in turn.

    Figures compared with one another are timed this way: clock and power drift
    over the measurement (a tensor-core GEMM at full speed is power-limited)
    then weighs on all of them alike, not on whichever ran last.
    """
    for fn, sync in timed:
        fn()
        sync()
    times: list[list[float]] = [[] for _ in timed]
    for _ in range(rounds):
        for (fn, sync), t in zip(timed, times):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            t.append((time.perf_counter() - t0) / reps)
    return [sorted(t)[len(t) // 2] for t in times]


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


def torch_graph(torch, issue: Callable[[], object]) -> Callable[[], None]:  # noqa: ANN001
    """`issue` captured once into a torch CUDA graph (after a warm-up run on a side stream, as torch asks):
    returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        issue()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        issue()
    return graph.replay
