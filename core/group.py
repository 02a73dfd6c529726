"""GroupPlan: the plans of a tensor split's ranks, one graph per device, run together.

A tensor split (docs/multi-device.md) compiles one graph per device: the same graph shape on each rank's
shard of the weights, with collective nodes (all_reduce_sum) whose kernels meet their peers (NCCL on GPUs,
core/reference/collective.py's host rendezvous on CPU devices). Each rank's plan is an ordinary one-device
plan (its scheduling, fusion, memory plan and CUDA graphs are those of one device); a GroupPlan runs
them concurrently: rank 0 on the calling thread, every other rank on a worker thread of its own, so that
a rank blocked in a collective (a host rendezvous; NCCL's first call, which connects the ranks) never
holds back a peer it waits for. On GPUs a rank's thread only queues work: the ranks' streams meet in
NCCL's kernels, and a decode step queued with `submit` is one CUDA graph per device.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, TypeVar

import attrs
import numpy as np

from .errors import PlanKeyError
from .hookspecs import Device
from .plan import Plan
from .reference.collective import PeerFailed, host_group
from .tensor import Flag, Tensor

T = TypeVar("T")

#: one pool of worker threads per group of devices, a thread per rank after the first
_POOLS: dict[tuple[str, ...], ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def _pool(names: tuple[str, ...]) -> ThreadPoolExecutor:
    with _LOCK:
        pool = _POOLS.get(names)
        if pool is None:
            pool = _POOLS[names] = ThreadPoolExecutor(len(names) - 1,
                                                      thread_name_prefix=f"opdispatch {','.join(names)}")
        return pool


def _peer_failed(exc: BaseException | None) -> bool:
    """Whether `exc` (or what it was raised from: a launch's error wraps its kernel's) is a PeerFailed."""
    while exc is not None:
        if isinstance(exc, PeerFailed):
            return True
        exc = exc.__cause__
    return False


@attrs.frozen
class RankShare:
    """What one rank holds: its device and the bytes of its params and states."""

    rank: int
    device: Device
    nbytes: int

    def describe(self) -> str:
        return f"rank {self.rank} on {self.device.name} ({self.nbytes / 2**20:.2f} MiB of params and states)"


@attrs.frozen
class TensorPlacement:
    """The ranks of a tensor split, as `Plan.placement` describes a layer split."""

    ranks: tuple[RankShare, ...]

    @property
    def devices(self) -> tuple[Device, ...]:
        return tuple(r.device for r in self.ranks)

    def describe(self) -> str:
        return "; ".join(r.describe() for r in self.ranks)


@attrs.define(eq=False)
class GroupPlan:
    """One plan per rank of a tensor split (`plans[r]` on `devices[r]`), run together (see the module
    docstring). Feeds go to every rank (the ranks' graphs share their inputs); outputs come from rank 0
    (every rank computes the same ones)."""

    plans: tuple[Plan, ...]
    placement: TensorPlacement
    _pool: ThreadPoolExecutor
    _bound: bool = False

    @classmethod
    def of(cls, plans: tuple[Plan, ...]) -> GroupPlan:
        shares = []
        for r, p in enumerate(plans):
            held = sum(t.nbytes for t in p.graph.leafs if t.flags & (Flag.PARAM | Flag.STATE))
            shares.append(RankShare(r, p.device, held))
        names = tuple(p.device.name for p in plans)
        return cls(plans, TensorPlacement(tuple(shares)), _pool(names))

    @property
    def device(self) -> Device:
        """The first rank's device (Plan.device: the first of a split's)."""
        return self.plans[0].device

    def _each(self, fn: Callable[[Plan], T]) -> list[T]:
        """fn(plan) for every rank at once (rank 0 here, the others on their threads). A rank that fails
        wakes the peers waiting for it at a host rendezvous (they fail with PeerFailed); once every rank
        has returned, the first failure that is not a PeerFailed is raised."""
        if not self._bound:  # binding allocates and uploads: one rank after the other, before any runs
            for p in self.plans:
                p._bind()
            self._bound = True
        group = host_group(self._names)

        def guarded(p: Plan) -> T:
            try:
                return fn(p)
            except BaseException:
                group.abort()
                raise

        futures = [self._pool.submit(guarded, p) for p in self.plans[1:]]
        errors: list[BaseException] = []
        results: list[Any] = []
        try:
            results.append(guarded(self.plans[0]))
        except BaseException as exc:  # noqa: BLE001 - raised below, once the peers are done
            errors.append(exc)
        for f in futures:
            exc = f.exception()
            if exc is None:
                results.append(f.result())
            else:
                errors.append(exc)
        if errors:
            group.reset()
            raise next((e for e in errors if not _peer_failed(e)), errors[0])
        return results

    @property
    def _names(self) -> tuple[str, ...]:
        return tuple(p.device.name for p in self.plans)

    # -- running: Plan's interface ------------------------------------------------------
    def run(self, feeds: Mapping[Tensor | str, Any] | None = None, *, copy: bool = True) -> list[np.ndarray]:
        """Every rank's Plan.run on the same feeds; rank 0's outputs."""
        return self._each(lambda p: p.run(feeds, copy=copy))[0]

    def submit(self, feeds: Mapping[Tensor | str, Any] | None = None) -> None:
        """Every rank's Plan.submit on the same feeds."""
        self._each(lambda p: p.submit(feeds))

    def write(self, t: Tensor | str, value: Any) -> None:
        """Write an input or state every rank's graph holds (the ranks' shared inputs and sampling states)."""
        self._each(lambda p: p.write(t, value))

    def read(self, t: Tensor | str) -> np.ndarray:
        """A tensor's value on the first rank holding it (shared ones: rank 0), once every rank is done."""
        self.synchronize()
        for p in self.plans:
            try:
                return p.read(t)
            except PlanKeyError:
                if p is self.plans[-1]:
                    raise
        raise AssertionError("unreachable")

    def synchronize(self) -> None:
        for p in self.plans:
            p.synchronize()

    def check(self) -> None:
        for p in self.plans:
            p.check()

    # -- inspection ------------------------------------------------------------------------
    def explain(self) -> str:
        """The split, then each rank's plan (its collective nodes among its steps)."""
        names = ", ".join(d.name for d in self.placement.devices)
        lines = [f"tensor split over {names}: {self.placement.describe()}"]
        for r, p in enumerate(self.plans):
            lines.append(f"rank {r}: " + p.explain())
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        """Plan.summary's counts, summed over the ranks (peaks per device)."""
        total: dict[str, Any] = {"nodes": 0, "launches": 0, "plugins": {}, "fusions": {}, "copies": 0, "peak": {}}
        for p in self.plans:
            s = p.summary()
            for k in ("nodes", "launches", "copies"):
                total[k] += s[k]
            for k in ("plugins", "fusions"):
                for name, n in s[k].items():
                    total[k][name] = total[k].get(name, 0) + n
            total["peak"].update(s["peak"])
        return total
