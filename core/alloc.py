"""Liveness-based memory plan: every intermediate gets an offset in one arena per device.

Each value that needs device memory for a while is a `Slot` with a lifetime
[first, last] in step indices. Slots whose lifetimes overlap must not overlap
in memory; others may share bytes. Offsets are assigned largest-first at the
lowest address that fits, a simple and good heuristic for interval colouring.
A node whose op reuses source 0 (`OpDef.reuses_src0`: elementwise maps, norms)
may also take over the slot of that source when it reads it for the last time
(in-place reuse), as ggml-alloc does. `plan_memory` makes a plan's slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Iterable, Mapping

import attrs

from .ops import OPS
from .tensor import Flag

if TYPE_CHECKING:
    from .graph import Graph
    from .hookspecs import Device
    from .sched import Step
    from .tensor import Tensor

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


def plan_memory(graph: Graph, steps: list[Step], homes: Mapping[Tensor, Device]) -> dict[str, MemoryPlan]:
    """Arena slots per device: node outputs and per-run copies, with in-place reuse."""
    memory: dict[str, MemoryPlan] = {}
    last: dict[tuple[Tensor, str], int] = {}
    held: set[tuple[Tensor, Device]] = set()  # (base, device) with a buffer on that device

    def holder(b: Tensor, dev: Device) -> str:
        # Host-memory devices read each other's buffers without copies.
        if (b, dev) in held or not dev.host_memory:
            return dev.name
        return homes[b].name if homes[b].host_memory else dev.name

    for i, step in enumerate(steps):  # pass 1: last read of each (base, device)
        if step.kind == "view":
            continue
        if step.kind == "copy":
            held.add((step.out, step.device))
            last[(step.out, step.src_device.name)] = i
            continue
        inside = set(step.nodes)
        for n in step.nodes:
            for s in n.srcs:
                if s is not None and s not in inside:
                    last[(s.base, holder(s.base, step.device))] = i
        held.update((t.base, step.device) for t in step.written)
    for o in graph.outputs:
        last[(o.base, homes[o.base].name)] = len(steps)

    for i, step in enumerate(steps):  # pass 2: slots
        if step.kind == "view":
            continue
        for t in step.written:
            b = t.base
            if b.is_leaf and (step.kind != "copy" or b.flags & Flag.PARAM or homes[b] is step.device):
                continue  # leafs live in persistent buffers at home, and so do param copies
            mem = memory.setdefault(step.device.name, MemoryPlan())
            key = (b, step.device.name)
            end = max(last.get(key, i), i)
            if key in mem.by_key:
                mem.extend(key, end)
            elif step.kind == "kernel" and _may_reuse(graph, step, last, mem, i):
                mem.share(key, (step.out.srcs[0], step.device.name), end)
            else:
                mem.add(key, b.nbytes, i, end)
    for mem in memory.values():
        mem.place()
    return memory


def _may_reuse(graph: Graph, step: Step, last: Mapping[tuple[Tensor, str], int], mem: MemoryPlan, i: int) -> bool:
    """May the node of `step` write over source 0, which it reads for the last time?
    (Its op's definition says so, same layout, no other source viewing those bytes.)"""
    out, dev = step.out, step.device.name
    src0 = out.srcs[0] if out.srcs else None
    opdef = OPS.get(out.op)
    return (opdef is not None and opdef.reuses_src0 and out.base is out and src0 is not None and src0.base is src0
            and (src0, dev) in mem.by_key and last.get((src0, dev)) == i and not graph.is_output(src0)
            and not any(s is not None and s.base is src0 for s in out.srcs[1:])
            and src0.nbytes == out.nbytes and src0.strides == out.strides and src0.dtype == out.dtype)
