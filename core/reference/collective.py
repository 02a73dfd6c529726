"""Reference kernel of the collectives (all_reduce_sum), and the host rendezvous the CPU devices meet at.

On CPU devices (cpu0, cpu1: the test pair of a tensor split) each rank's plan runs in its own thread
(core/group.py); a rank's all_reduce_sum puts its part in the group's `HostGroup` and waits for every
peer's, then each rank sums the parts in rank order, so every rank gets the same bits. A group of one is
the identity and meets no one (the conformance cases).
"""

from __future__ import annotations

import threading

import attrs
import numpy as np

from ..errors import LaunchError
from ..ops.collective import group_devices
from ..tensor import Tensor
from . import load, reference, store

class PeerFailed(LaunchError):
    """A rank waited at a host rendezvous for a peer that failed (or never came)."""


#: how long a rank waits for its peers at a rendezvous before giving up (a peer that failed aborts it sooner)
RENDEZVOUS_TIMEOUT_S = 300.0


@attrs.define(eq=False)
class HostGroup:
    """Where the ranks of one group (device names in rank order) meet: each rank's part, and a barrier that
    every rank passes twice a collective (all parts in; all parts read)."""

    names: tuple[str, ...]
    parts: list[np.ndarray | None] = attrs.field(init=False)
    barrier: threading.Barrier = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.parts = [None] * len(self.names)
        self.barrier = threading.Barrier(len(self.names))

    def exchange(self, rank: int, part: np.ndarray) -> list[np.ndarray]:
        """Every rank's part, once all have given theirs; LaunchError if a peer does not come (or aborted)."""
        self.parts[rank] = part
        self._wait(rank)
        parts = list(self.parts)  # type: ignore[arg-type]
        self._wait(rank)  # nobody overwrites a part before every rank has taken them all
        return parts  # type: ignore[return-value]

    def _wait(self, rank: int) -> None:
        try:
            self.barrier.wait(RENDEZVOUS_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise PeerFailed(f"all_reduce_sum: rank {rank} ({self.names[rank]}) of group {','.join(self.names)} "
                              "was left alone at the host rendezvous: a peer failed or never came") from None

    def abort(self) -> None:
        """A rank failed: wake every rank waiting here, and fail every rank that comes later, with PeerFailed
        (until `reset`)."""
        self.barrier.abort()

    def reset(self) -> None:
        """Usable again, once every rank of the failed run has returned."""
        self.barrier = threading.Barrier(len(self.names))
        self.parts = [None] * len(self.names)


_GROUPS: dict[tuple[str, ...], HostGroup] = {}
_LOCK = threading.Lock()


def host_group(names: tuple[str, ...]) -> HostGroup:
    """The rendezvous of the group of devices `names` (one per group, made on first use)."""
    with _LOCK:
        group = _GROUPS.get(names)
        if group is None:
            group = _GROUPS[names] = HostGroup(names)
        return group


@reference("all_reduce_sum")
def _all_reduce_sum(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    names = group_devices(node.op, node.params["group"])
    mine = load(x, node.srcs[0])
    if len(names) == 1:
        store(out, mine, node)
        return
    parts = host_group(names).exchange(node.params["rank"], mine.copy())
    total = parts[0].copy()
    for p in parts[1:]:  # in rank order, in f32 as NCCL sums: every rank gets the same bits
        total += p
    store(out, total, node)
