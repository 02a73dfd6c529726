"""Binding a plan, on its first run: buffers, uploaded weights, pre-bound launches, feeders.

Each step's `bind(ctx, node)` runs once here and returns its launch;
consecutive launches on one device become one runner (`Backend.executor`,
CUDA: a captured graph). The inputs of a plan on a device whose backend
stages transfers are packed into one block there, so that `Plan.run` uploads
them all with one asynchronous copy from one staging buffer (pinned on CUDA)
and the outputs come back by asynchronous copies into another; the run waits
once, at its end (see `Feeder`). Before anything is allocated, what binding
will allocate is held against what each memory (a GPU's, the host's) has free
(`check_memory`): a plan too large raises OutOfMemory and allocates nothing.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

import attrs
import numpy as np

from .alloc import MemoryPlan
from .backends.base import (Backend, CopiesBetween, ReportsFreeMemory, StagedTransfers, StagingBackend, bytes_text,
                            host_free_memory)
from .errors import OutOfMemory
from .errorword import IndexTable
from .hookspecs import Device
from .tensor import Tensor

if TYPE_CHECKING:
    from .plan import Plan
    from .sched import Step

#: Buffers of leafs (params, states, inputs), one per tensor and device, shared by
#: every plan that uses the tensor and freed with it: prefill and decode plans
#: see one KV cache, and weights are uploaded once.
_RESIDENT: weakref.WeakKeyDictionary[Tensor, dict[str, Any]] = weakref.WeakKeyDictionary()


def resident(t: Tensor, dev: Device, backend: Backend) -> Any:
    """The buffer holding leaf `t` on `dev`, made (and filled with `t.data`) on first use.

    A leaf without data (a KV cache) starts as zeros on every backend: attention
    multiplies its masked, never-written rows by 0, and pool memory may hold NaN.
    A param used on a device away from its home (offloaded) gets one too:
    weights never change, so it is filled from their data once.
    """
    per_device = _RESIDENT.setdefault(t, {})
    if dev.name not in per_device:
        buf = backend.alloc(t.nbytes, t.describe())
        if t.data is not None:
            backend.write(buf, 0, t.data)
        else:
            backend.fill(buf, 0)
        per_device[dev.name] = buf
    return per_device[dev.name]


#: byte alignment of each input in a feeder's block and of each output in its staging buffer
FEED_ALIGN = 256


def _aligned(n: int) -> int:
    return -(-n // FEED_ALIGN) * FEED_ALIGN


@attrs.define(eq=False)
class Feeder:
    """The transfers of `Plan.run` on one device whose backend stages them (`StagedTransfers`).

    The plan's inputs on the device that had no buffer yet were given one
    block there (each input a sub-buffer of it, registered as its resident
    buffer, so `Plan.write` and other plans see the same bytes); `host`
    mirrors that block's layout. A run copies each input's bytes into
    `host` and queues ONE upload of the whole block (plus one per input that
    already had a buffer of its own) on the device's stream, before the
    plan's launches on that stream; then one download per output into
    `out_host`. Nothing waits until the run's single synchronize at its end.

    Why this is safe: the staging buffers are overwritten only by the next
    run of this plan, which starts after the previous run's synchronize
    returned (a run that raises waits for the device before it re-raises),
    or after the device took the previous submit's upload (the backend's
    `mark` after it), so an upload never reads bytes being rewritten; a
    download (run only) has landed before its bytes are handed out.
    """

    backend: StagingBackend
    #: input -> byte offset of its bytes in `host`
    inputs: dict[Tensor, int]
    host: Any
    #: (device buffer, byte offset there, byte offset in host, bytes): the uploads, in order
    uploads: list[tuple[Any, int, int, int]]
    #: output base -> (offset in out_host, device buffer, offset there); filled at the end of binding
    outputs: dict[Tensor, tuple[int, Any, int]] = attrs.field(factory=dict)
    out_host: Any = None

    def upload(self) -> None:
        for buf, off, host_off, n in self.uploads:
            self.backend.upload(buf, off, self.host, host_off, n)

    def download(self) -> None:
        for base, (host_off, buf, off) in self.outputs.items():
            self.backend.download(self.out_host, host_off, buf, off, base.nbytes)


@attrs.define(eq=False)
class Bound:
    """What binding made: buffers, and one runner per segment of the plan."""

    backends: dict[str, Backend]
    arenas: dict[str, Any]
    persistent: dict[tuple[Tensor, str], Any]
    runners: list[Callable[[], None]]
    #: the plan's arena slots and the device holding each base's own buffer
    memory: dict[str, MemoryPlan]
    homes: dict[Tensor, Device]
    #: device name -> its feeder (devices whose backends stage transfers)
    feeders: dict[str, Feeder] = attrs.field(factory=dict)
    #: what Plan.run needs on every run, computed once at the end of binding (`Plumbing`)
    plumbing: Plumbing | None = None
    #: the index uses of the plan's kernels and their error words (checked where the plan synchronizes)
    checks: IndexTable = attrs.field(factory=IndexTable)
    #: device name -> what the plan's binds on it share (Backend.bind_context's `shared`)
    shared: dict[str, dict[Any, Any]] = attrs.field(factory=dict)

    def where(self, b: Tensor, dev: Device) -> tuple[Any, int]:
        """(buffer, byte offset) of base `b` on `dev`."""
        key = (b, dev.name)
        if key in self.persistent:
            return self.persistent[key], 0
        mem = self.memory.get(dev.name)
        if mem is not None and key in mem.by_key:
            return self.arenas[dev.name], mem.offset(key)
        home = self.homes.get(b)
        if dev.host_memory and home is not None and home.host_memory and home is not dev:
            return self.where(b, home)
        raise RuntimeError(f"internal: {b.describe()} has no storage on {dev.name}")



@attrs.define(eq=False)
class Plumbing:
    """Per-run work of Plan.run resolved once at bind time, so a run does no per-leaf Python work:
    the plan's inputs; per input fed through a staging buffer, a typed view of its bytes there
    (`InputSlot`); per output, where its value comes from; the feeders to drive."""

    inputs: tuple[Tensor, ...]
    slots: dict[Tensor, InputSlot]
    #: per graph output: (its view of an output staging buffer, or None: read through Plan.read)
    outputs: list[np.ndarray | None]
    feeders: tuple[Feeder, ...]


@attrs.define(eq=False)
class InputSlot:
    """An input's bytes in its feeder's staging buffer, as an array of the input's shape and numpy dtype
    (None for block formats: those go through Plan._host_bytes)."""

    dst: np.ndarray | None
    raw: np.ndarray  # the same bytes, flat uint8
    is_int: bool


def bind_plan(plan: Plan) -> Bound:
    """Allocate `plan`'s buffers, upload its weights and bind every step's launch."""
    backends: dict[str, Backend] = {}
    for s in plan.steps:
        for dev in (s.device, s.src_device):
            if dev is not None and dev.name not in backends:
                if dev.backend_factory is None:
                    raise RuntimeError(f"device {dev.name} is a description only: it can plan, not run")
                backends[dev.name] = dev.backend_factory(dev)
    for leaf in plan.graph.leafs:
        dev = plan.homes[leaf]
        if dev.name not in backends:
            backends[dev.name] = dev.backend_factory(dev)
    check_memory(plan, backends)
    arenas = {name: backends[name].alloc(mem.peak, f"the arena of {name}") for name, mem in plan.memory.items()}
    bound = Bound(backends, arenas, {}, [], plan.memory, plan.homes)
    for name, backend in backends.items():
        if isinstance(backend, StagedTransfers):
            bound.feeders[name] = _make_feeder(plan, name, backend)
    for leaf in plan.graph.leafs:
        dev = plan.homes[leaf]
        bound.persistent[(leaf, dev.name)] = resident(leaf, dev, backends[dev.name])
    segment: list[tuple[str, Any]] = []
    seg_dev: Device | None = None

    def flush() -> None:
        nonlocal segment, seg_dev
        if segment:
            bound.runners.append(backends[seg_dev.name].executor(segment))
        segment, seg_dev = [], None

    for s in plan.steps:
        if s.kind == "view":
            continue
        if s.kind == "copy":
            flush()
            if s.note == "bind":  # a param: its buffer on this device is filled from its data
                bound.persistent[(s.out, s.device.name)] = resident(s.out, s.device, backends[s.device.name])
            else:
                bound.runners.append(_bind_copy(bound, s))
            continue
        if seg_dev is not None and seg_dev is not s.device:
            flush()
        seg_dev = s.device
        ctx = backends[s.device.name].bind_context(_resolver(bound, s.device), bound.checks,
                                                   bound.shared.setdefault(s.device.name, {}))
        launch = s.bind(ctx, s.nodes[0]) if s.kind == "kernel" else s.bind(ctx, s.nodes)
        segment.append((f"{s.describe()} by {s.plugin}:{s.kernel}", launch))
    flush()
    for name, feeder in bound.feeders.items():
        _feed_outputs(plan, bound, name, feeder)
    bound.plumbing = _plumbing(plan, bound)
    return bound


def check_memory(plan: Plan, backends: dict[str, Backend]) -> None:
    """Raise OutOfMemory if what binding `plan` will allocate exceeds what is free, per memory: the arenas,
    the leafs' buffers not made yet, and (host memory) the staging buffers. The message names the memory,
    the bytes asked and free, and the largest asks (the arena by its largest node). Memories whose backend
    does not report (`ReportsFreeMemory`) are not checked."""
    asks: dict[str, list[tuple[int, str]]] = {}  # memory -> (bytes, what)
    spaces: dict[str, tuple[str, int | None]] = {}
    for name, backend in backends.items():
        if isinstance(backend, ReportsFreeMemory):
            spaces[name] = backend.free_memory()

    def ask(device: str, nbytes: int, what: str) -> None:
        if device in spaces and nbytes:
            asks.setdefault(spaces[device][0], []).append((nbytes, what))

    for name, mem in plan.memory.items():
        biggest = max(mem.slots, key=lambda sl: sl.nbytes, default=None)
        top = f", its largest slot {biggest.keys[0][0].describe()}" if biggest is not None else ""
        ask(name, mem.peak, f"the arena of {name}{top}")
    leafs = dict.fromkeys([(leaf, plan.homes[leaf].name) for leaf in plan.graph.leafs]
                          + [(s.out, s.device.name) for s in plan.steps if s.kind == "copy" and s.note == "bind"])
    for t, name in leafs:
        if name not in _RESIDENT.get(t, {}):
            ask(name, _aligned(t.nbytes), t.describe())
    for name in (name for name, backend in backends.items() if isinstance(backend, StagedTransfers)):
        ins = sum(_aligned(t.nbytes) for t in plan.graph.inputs if plan.homes[t].name == name)
        outs = sum(_aligned(b.nbytes) for b in {o.base for o in plan.graph.outputs} if plan.homes[b].name == name)
        if ins + outs:
            asks.setdefault("host", []).append((ins + outs, f"the staging buffers of {name}'s inputs and outputs"))
    free_of = {space: free for space, free in spaces.values()}
    if "host" in asks and "host" not in free_of:
        free_of["host"] = host_free_memory()
    for space, wanted in asks.items():
        free = free_of.get(space)
        total = sum(n for n, _ in wanted)
        if free is not None and total > free:
            wanted.sort(key=lambda a: -a[0])
            largest = "; ".join(f"{what}: {bytes_text(n)}" for n, what in wanted[:3])
            raise OutOfMemory(f"{space}: the plan needs {bytes_text(total)} of {space} memory and "
                              f"{bytes_text(free)} are free; the largest: {largest}")


def _plumbing(plan: Plan, bound: Bound) -> Plumbing:
    """What every run of `plan` needs, resolved now (see Plumbing)."""
    slots: dict[Tensor, InputSlot] = {}
    for t in plan.graph.inputs:
        feeder = bound.feeders.get(plan.homes[t].name)
        if feeder is None or t not in feeder.inputs:
            continue
        off = feeder.inputs[t]
        raw = feeder.host[off:off + t.nbytes]
        dst = None
        if not t.dtype.is_quant and t.is_contiguous():
            dst = raw.view(t.dtype.numpy).reshape(t.shape)
        slots[t] = InputSlot(dst, raw, bool(t.dtype.is_int))
    outputs: list[np.ndarray | None] = []
    for o in plan.graph.outputs:
        b = o.base
        feeder = bound.feeders.get(plan.homes[b].name)
        if feeder is None or b not in feeder.outputs:
            outputs.append(None)
            continue
        host_off = feeder.outputs[b][0]
        outputs.append(o.host_view(feeder.out_host[host_off:host_off + b.nbytes], o.view_offset))
    return Plumbing(tuple(plan.graph.inputs), slots, outputs, tuple(bound.feeders.values()))


def _make_feeder(plan: Plan, name: str, backend: StagingBackend) -> Feeder:
    """The feeder of device `name`: `plan`'s inputs there that have no buffer yet get one block
    (sub-buffers registered as their resident buffers), staged through one host buffer of its layout."""
    ins = [t for t in plan.graph.inputs if plan.homes[t].name == name]
    fresh = [t for t in ins if name not in _RESIDENT.get(t, {})]
    offsets: dict[Tensor, int] = {}
    size = 0
    for t in fresh:
        offsets[t] = size
        size += _aligned(t.nbytes)
    uploads: list[tuple[Any, int, int, int]] = []
    if fresh:
        block = backend.alloc(size, f"the inputs of a plan ({len(fresh)})")
        for t in fresh:
            sub = backend.sub(block, offsets[t], t.nbytes, t.describe())
            if t.data is not None:
                backend.write(sub, 0, t.data)
            _RESIDENT.setdefault(t, {})[name] = sub
        uploads.append((block, 0, 0, size))  # the whole block, padding included: one copy
    for t in ins:
        if t not in offsets:  # an input another plan bound first: its own buffer, its own copy
            offsets[t] = size
            uploads.append((_RESIDENT[t][name], 0, size, t.nbytes))
            size += _aligned(t.nbytes)
    return Feeder(backend, offsets, backend.staging(size), uploads)


def _feed_outputs(plan: Plan, bound: Bound, name: str, feeder: Feeder) -> None:
    """`plan`'s outputs homed on device `name` come back through the feeder's output staging buffer."""
    size = 0
    for o in plan.graph.outputs:
        b = o.base
        if plan.homes[b].name != name or b in feeder.outputs:
            continue
        buf, off = bound.where(b, plan.homes[b])
        feeder.outputs[b] = (size, buf, off)
        size += _aligned(b.nbytes)
    feeder.out_host = feeder.backend.staging(size)


def _resolver(bound: Bound, dev: Device) -> Callable[[Tensor], tuple[Any, int]]:
    def where(t: Tensor) -> tuple[Any, int]:
        buf, off = bound.where(t.base, dev)
        return buf, off + t.view_offset

    return where


def _bind_copy(bound: Bound, s: Step) -> Callable[[], None]:
    """A copy step's run: the destination backend's own copy (CopiesBetween), else through the host."""
    b = s.out
    src_be, dst_be = bound.backends[s.src_device.name], bound.backends[s.device.name]
    src = bound.where(b, s.src_device)
    dst = bound.where(b, s.device)
    n = b.nbytes
    if isinstance(dst_be, CopiesBetween):
        own = dst_be.copy_from(dst[0], dst[1], src_be, src[0], src[1], n)
        if own is not None:
            return own

    def copy() -> None:
        dst_be.write(dst[0], dst[1], src_be.read(src[0], src[1], n))

    return copy


def fill_slot(slot: InputSlot, t: Tensor, value: Any) -> bool:
    """Copy `value` into its staging slot when it is a numpy array of the input's shape that needs no
    conversion beyond an integer cast that keeps every value; False: the caller converts it, or refuses it
    naming the input (Plan._host_bytes)."""
    dst = slot.dst
    if dst is None or value.__class__ is not np.ndarray or value.shape != dst.shape:
        return False
    if value.dtype == dst.dtype:
        np.copyto(dst, value)
    elif slot.is_int and value.dtype.kind in "iu":
        if not np.can_cast(value.dtype, dst.dtype) and value.size:
            info = np.iinfo(dst.dtype)
            if value.min() < info.min or value.max() > info.max:
                return False
        np.copyto(dst, value, casting="unsafe")  # every value fits
    else:
        return False
    return True
