"""Liveness-based memory plan: every intermediate gets an offset in one arena per device.

Each value that needs device memory for a while is a `Slot` with a lifetime
[first, last] in step indices. Slots whose lifetimes overlap must not overlap
in memory; others may share bytes. Offsets are assigned largest-first at the
lowest address that fits, a simple and good heuristic for interval colouring.
An elementwise node may also take over the slot of a source it reads for the
last time (in-place reuse), as ggml-alloc does.
"""

from __future__ import annotations

from typing import Hashable, Iterable

import attrs

ALIGN = 256  # bytes; covers CUDA's vector loads and cache lines


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@attrs.define(eq=False)
class Slot:
    """A range of arena bytes with a lifetime; several keys may share one slot."""

    keys: list[Hashable]
    nbytes: int
    first: int
    last: int
    offset: int = -1


@attrs.define(eq=False)
class MemoryPlan:
    """Slots of one device's arena; `peak` is the arena size."""

    slots: list[Slot] = attrs.field(factory=list)
    by_key: dict[Hashable, Slot] = attrs.field(factory=dict)
    peak: int = 0

    def add(self, key: Hashable, nbytes: int, first: int, last: int) -> None:
        slot = Slot([key], nbytes, first, last)
        self.slots.append(slot)
        self.by_key[key] = slot

    def share(self, key: Hashable, with_key: Hashable, last: int) -> None:
        """`key` reuses the slot of `with_key` (in place), extending its lifetime to `last`."""
        slot = self.by_key[with_key]
        slot.keys.append(key)
        self.by_key[key] = slot
        self.extend(key, last)

    def extend(self, key: Hashable, last: int) -> None:
        """Keep `key`'s slot alive until step `last` (a later write or copy into it)."""
        slot = self.by_key[key]
        slot.last = max(slot.last, last)

    def offset(self, key: Hashable) -> int:
        return self.by_key[key].offset

    def total(self) -> int:
        """Bytes if nothing shared memory: what the plan saves against."""
        return sum(align(s.nbytes) for s in self.slots)

    def place(self) -> None:
        """Assign offsets: largest first, each at the lowest gap free during its lifetime."""
        placed: list[Slot] = []
        for slot in sorted(self.slots, key=lambda s: (-s.nbytes, s.first)):
            busy = sorted(
                (p.offset, p.offset + align(p.nbytes))
                for p in placed
                if p.first <= slot.last and slot.first <= p.last
            )
            offset = 0
            for lo, hi in busy:
                if offset + align(slot.nbytes) <= lo:
                    break
                offset = max(offset, hi)
            slot.offset = offset
            placed.append(slot)
        self.peak = max((s.offset + align(s.nbytes) for s in self.slots), default=0)


def overlapping(slots: Iterable[Slot]) -> list[tuple[Slot, Slot]]:
    """Pairs of slots live at the same time whose bytes overlap (must be empty)."""
    slots = list(slots)
    bad = []
    for i, a in enumerate(slots):
        for b in slots[i + 1:]:
            live = a.first <= b.last and b.first <= a.last
            mem = a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes
            if live and mem:
                bad.append((a, b))
    return bad
