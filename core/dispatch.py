"""compile(): fusion, kernel selection, device split and memory plan -> Plan.

A Plan is computed without touching the hardware (so it can be inspected and
tested on a device description); its launches are bound on the first run:
buffers allocated, weights uploaded, every kernel's arguments fixed. A run
then only writes the inputs, calls one runner per device segment (CUDA:
a graph replay) and reads the outputs.

The inputs of a plan on a device are packed into one block there, so that
`Plan.run` uploads them all with one asynchronous copy from one staging
buffer (pinned on CUDA), and the outputs come back by asynchronous copies
into another; the run waits once, at its end (see `_Feeder`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs
import numpy as np

from .alloc import MemoryPlan
from .backends.base import Backend, Device
from .dtypes import from_float
from .graph import Graph
from .manager import PluginManager, manager
from .sched import Scheduler, Step, offload_min_batch
from .tensor import Flag, Tensor, to_numpy

#: Ops whose kernels must be correct when the output aliases source 0 (same
#: layout): the memory plan may then reuse that source's bytes (ggml's rule).
INPLACE_OPS = frozenset({
    "add", "sub", "mul", "div", "scale", "clamp", "sqr", "sqrt", "log", "sin", "cos", "leaky_relu",
    "abs", "sgn", "neg", "step", "tanh", "elu", "relu", "sigmoid", "gelu", "gelu_erf", "gelu_quick",
    "silu", "hardswish", "hardsigmoid", "exp", "expm1", "softplus", "floor", "ceil", "round", "trunc",
    "norm", "rms_norm", "l2_norm", "group_norm",
})


#: plans kept per plugin manager (each holds its arenas once bound)
PLAN_CACHE_SIZE = 64


def fusion_from_env() -> bool:
    return os.environ.get("OPDISPATCH_DISABLE_FUSION", "") in ("", "0")


def resolve_device(device: str | Device | None, mgr: PluginManager) -> Device:
    """A Device from a name ('cpu', 'cuda0', 'cuda' = the first of that kind) or None (the best)."""
    if isinstance(device, Device):
        return device
    devices = mgr.devices()
    if device is None:
        gpus = [d for d in devices if d.kind == "cuda"]
        return gpus[0] if gpus else _by_name(devices, "cpu")
    for d in devices:
        if d.name == device:
            return d
    of_kind = [d for d in devices if d.kind == device]
    if of_kind:
        return of_kind[0]
    raise ValueError(f"unknown device '{device}' (known: {', '.join(d.name for d in devices)})")


def _by_name(devices: Sequence[Device], name: str) -> Device:
    for d in devices:
        if d.name == name:
            return d
    raise ValueError(f"no '{name}' device: is the cpu plugin installed? (known: {', '.join(d.name for d in devices)})")


def compile(  # noqa: A001 - the natural name
    outputs: Graph | Tensor | Sequence[Tensor],
    device: str | Device | None = None,
    *,
    prefer: Sequence[str] = (),
    exclude: Iterable[str] = (),
    fusion: bool | None = None,
    host_params: Iterable[Tensor] = (),
    plugins: PluginManager | None = None,
) -> Plan:
    """Plan `outputs` for `device` (default: the first GPU, else the CPU).

    `prefer`/`exclude` reorder the plugins (see manager.py); `fusion=False`
    (or OPDISPATCH_DISABLE_FUSION=1) turns fusion off; `host_params` are
    weights that stay in host memory (run on the CPU unless offloaded).
    Plans are cached in the plugin manager by the graph's structural key and
    these options (registering a plugin clears the cache).
    """
    graph = outputs if isinstance(outputs, Graph) else Graph.build(outputs)
    mgr = plugins or manager()
    dev = resolve_device(device, mgr)
    fusion = fusion_from_env() if fusion is None else fusion
    order = mgr.order(prefer, exclude)
    host = frozenset(host_params)
    # The key holds `dev` itself so that its id stays unique while cached, and the switches read at bind.
    key = (graph.key(), dev, id(dev), fusion, tuple(p.name for p in order), tuple(sorted(t.uid for t in host)),
           offload_min_batch(), os.environ.get("OPDISPATCH_DISABLE_CUDA_GRAPHS", ""),
           os.environ.get("OPDISPATCH_PDL", ""))
    cached = mgr.plans.get(key)
    if cached is not None:
        mgr.plans.move_to_end(key)
        return cached.for_graph(graph)
    fallback = dev if dev.kind == "cpu" else _by_name(mgr.devices(), "cpu")
    sched = Scheduler(mgr, order, dev, fallback, fusion, host)
    steps = sched.schedule(graph)
    memory = plan_memory(graph, steps, sched.homes)
    plan = Plan(graph, dev, steps, sched.homes, memory, fusion, [p.name for p in order])
    mgr.plans[key] = plan
    while len(mgr.plans) > PLAN_CACHE_SIZE:  # a sweep must not hold every plan's buffers
        mgr.plans.popitem(last=False)
    return plan


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
    (An op of INPLACE_OPS, same layout, no other source viewing those bytes.)"""
    out, dev = step.out, step.device.name
    src0 = out.srcs[0] if out.srcs else None
    return (out.op in INPLACE_OPS and out.base is out and src0 is not None and src0.base is src0
            and (src0, dev) in mem.by_key and last.get((src0, dev)) == i and not graph.is_output(src0)
            and not any(s is not None and s.base is src0 for s in out.srcs[1:])
            and src0.nbytes == out.nbytes and src0.strides == out.strides and src0.dtype == out.dtype)


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
class _Feeder:
    """The transfers of `Plan.run` on one device whose backend stages (`staging`, `upload`, `download`,
    `sub`, `mark`).

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

    backend: Any
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
class _Bound:
    """What binding made: buffers, and one runner per segment of the plan."""

    backends: dict[str, Backend]
    arenas: dict[str, Any]
    persistent: dict[tuple[Tensor, str], Any]
    runners: list[Callable[[], None]]
    #: device name -> its feeder (devices whose backends stage transfers)
    feeders: dict[str, _Feeder] = attrs.field(factory=dict)
    #: what Plan.run needs on every run, computed once at the end of binding (`_Plumbing`)
    plumbing: _Plumbing | None = None


@attrs.define(eq=False)
class _Plumbing:
    """Per-run work of Plan.run resolved once at bind time, so a run does no per-leaf Python work:
    the plan's inputs; per input fed through a staging buffer, a typed view of its bytes there
    (`_Slot`); per output, where its value comes from; the feeders to drive."""

    inputs: tuple[Tensor, ...]
    slots: dict[Tensor, _Slot]
    #: per graph output: (its view of an output staging buffer, or None: read through Plan.read)
    outputs: list[np.ndarray | None]
    feeders: tuple[_Feeder, ...]


@attrs.define(eq=False)
class _Slot:
    """An input's bytes in its feeder's staging buffer, as an array of the input's shape and numpy dtype
    (None for block formats: those go through Plan._host_bytes)."""

    dst: np.ndarray | None
    raw: np.ndarray  # the same bytes, flat uint8
    is_int: bool


@attrs.define(eq=False)
class _Shared:
    bound: _Bound | None = None
    #: per feeder of the last submit: waits until the device has taken its uploaded inputs
    taken: list[Callable[[], None]] = attrs.field(factory=list)


@attrs.define(eq=False)
class Plan:
    """Steps to compute a graph on a device; `explain()` says who runs what."""

    graph: Graph
    device: Device
    steps: list[Step]
    homes: dict[Tensor, Device]
    memory: dict[str, MemoryPlan]
    fusion: bool
    plugin_order: list[str]
    _shared: _Shared = attrs.field(factory=_Shared)
    #: tensors of an equal graph -> this plan's tensors (a cached plan reused)
    _alias: dict[Tensor, Tensor] = attrs.field(factory=dict)

    def for_graph(self, graph: Graph) -> Plan:
        """This plan, answering to the tensors of `graph` (structurally equal)."""
        if graph is self.graph:
            return self
        mine = [*self.graph.leafs, *self.graph.nodes]
        theirs = [*graph.leafs, *graph.nodes]
        return attrs.evolve(self, alias=dict(zip(theirs, mine)))

    def _own(self, t: Tensor | str) -> Tensor:
        if isinstance(t, str):
            for leaf in self.graph.leafs:
                if leaf.name == t:
                    return leaf
            raise KeyError(f"no leaf named '{t}' in the graph")
        return self._alias.get(t, t)

    # -- inspection -----------------------------------------------------------------
    @property
    def fusions(self) -> list[Step]:
        return [s for s in self.steps if s.kind == "fused"]

    def peak_bytes(self) -> dict[str, int]:
        return {name: mem.peak for name, mem in self.memory.items()}

    def explain(self) -> str:
        """Per node: the plugin that took it, who declined before (and why), fusions, copies."""
        kernels = [s for s in self.steps if s.kind in ("kernel", "fused")]
        copies = [s for s in self.steps if s.kind == "copy"]
        peak = ", ".join(f"{n} {_mib(b)}" for n, b in self.peak_bytes().items()) or "none"
        lines = [
            f"plan on {self.device.name}: {len(self.graph.nodes)} nodes -> {len(kernels)} launches, "
            f"{len(self.fusions)} fused groups, {len(copies)} copies; fusion {'on' if self.fusion else 'off'}; "
            f"arena peak {peak}",
            f"plugin order: {', '.join(self.plugin_order)}",
        ]
        for i, s in enumerate(self.steps):
            if s.kind == "view":
                lines.append(f"  {i:4d}  {s.describe():50s} view (no kernel)")
                continue
            if s.kind == "copy":
                lines.append(f"  {i:4d}  copy {s.out.describe():45s} {s.kernel}" + (f" ({s.note})" if s.note else ""))
                continue
            who = f"{s.plugin}:{s.kernel}" if s.kind == "kernel" else f"{s.plugin} [fused {s.kernel}]"
            if s.writes:
                who += " (also writes " + ", ".join(f"'{t.name}'" for t in s.writes) + ")"
            line = f"  {i:4d}  {s.describe():50s} {who} on {s.device.name}"
            if s.note:
                line += f" ({s.note})"
            reasons = [f"{p} ({r})" for p, r in s.declined if r]
            silent = len(s.declined) - len(reasons)
            if reasons or silent:
                line += "  declined: " + "; ".join(reasons + ([f"{silent} without a kernel"] if silent else []))
            if s.unfused:
                line += "  not fused: " + "; ".join(f"{rule} ({why})" for rule, why in s.unfused)
            lines.append(line)
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        """Counts for a one-line report: launches per plugin, fusions by rule, peak bytes."""
        per_plugin: dict[str, int] = {}
        fused: dict[str, int] = {}
        for s in self.steps:
            if s.kind in ("kernel", "fused"):
                per_plugin[s.plugin] = per_plugin.get(s.plugin, 0) + 1
            if s.kind == "fused":
                fused[s.kernel] = fused.get(s.kernel, 0) + 1
        return {"nodes": len(self.graph.nodes), "launches": sum(per_plugin.values()), "plugins": per_plugin,
                "fusions": fused, "copies": sum(s.kind == "copy" for s in self.steps), "peak": self.peak_bytes()}

    # -- running ---------------------------------------------------------------------
    def run(self, feeds: Mapping[Tensor | str, Any] | None = None, *, copy: bool = True) -> list[np.ndarray]:
        """Write the inputs, run every step, return the outputs as host arrays
        (block formats as raw uint8 rows).

        On a device whose backend stages transfers (CUDA, the host), the
        inputs go up in one asynchronous copy from a staging buffer, the
        outputs come back asynchronously, and the run waits once at its end
        (see `_Feeder`); other inputs (states fed here, devices that do not
        stage) are written by `write`. `copy=False` returns views of the
        plan's output staging buffer instead of copies: no copy on the host,
        but the next run of this plan overwrites them (a decode loop that
        samples from the logits before the next step can use that).
        """
        bound = self._queue(feeds, download=True)
        for backend in bound.backends.values():
            backend.synchronize()
        out = []
        for o, view in zip(self.graph.outputs, bound.plumbing.outputs):
            if view is None:
                out.append(self.read(o))
            else:
                out.append(np.array(view) if copy else view)
        return out

    def submit(self, feeds: Mapping[Tensor | str, Any] | None = None) -> None:
        """Queue a run and return without waiting for it: the inputs go up and
        every step is queued as in `run`, but no output comes back (read
        outputs and states with `read`, which waits for the device).

        For loops whose steps feed each other on the device (a greedy decode:
        each step's token is the previous step's argmax, kept in a state), so
        the host prepares step i + 1 while the device runs step i. The next
        `submit` or `run` of this plan first waits, on the host, until the
        device has taken this one's inputs (the staging buffer is then free),
        not until the device has finished it.
        """
        self._queue(feeds, download=False)

    def _queue(self, feeds: Mapping[Tensor | str, Any] | None, *, download: bool) -> _Bound:
        """Write the inputs into the staging buffers, queue their upload, every step and (with
        `download`) the outputs' download; wait for nothing but an earlier submit's upload."""
        alias = self._alias
        given: dict[Tensor, Any] = {}
        for k, v in (feeds or {}).items():
            given[self._own(k) if k.__class__ is str else alias.get(k, k)] = v
        ready = self._shared.bound
        inputs = ready.plumbing.inputs if ready is not None else self.graph.inputs
        if len(given) < len(inputs) or any(t not in given for t in inputs):
            missing = [t.describe() for t in inputs if t not in given]
            raise KeyError(f"no value for input {', '.join(missing)}")
        bound = ready if ready is not None else self._bind()
        pl = bound.plumbing
        slots = pl.slots
        shared = self._shared
        while shared.taken:  # the device has read the staging buffers a submit queued
            shared.taken.pop()()
        for t, value in given.items():
            slot = slots.get(t)
            if slot is None:
                self.write(t, value)  # synchronous: done before anything below is queued
            elif not _fill_slot(slot, t, value):
                raw = self._host_bytes(t, value)
                slot.raw[:raw.size] = raw
        try:
            for feeder in pl.feeders:
                feeder.upload()  # queued on the device's stream, ahead of the launches
                if not download:
                    shared.taken.append(feeder.backend.mark())
            for runner in bound.runners:
                runner()
            if download:
                for feeder in pl.feeders:
                    feeder.download()  # queued behind the launches
        except BaseException:
            # The staging buffers may be in use by queued copies: wait (ignoring a second error) before
            # the next run may rewrite them, then report the first error.
            shared.taken.clear()
            with contextlib.suppress(Exception):
                self.synchronize()
            raise
        return bound

    def write(self, t: Tensor | str, value: Any) -> None:
        """Set an input (or overwrite a state) from a host array or DLPack object
        (block formats: float values, quantized here, or the raw rows `read` gives).
        Synchronous: `value` may change once it returns."""
        t = self._own(t)
        if not t.is_leaf or not t.flags & (Flag.INPUT | Flag.STATE):
            raise KeyError(f"{t.describe()} is not an input or state of this plan")
        host = self._host_bytes(t, value)
        bound = self._bind()
        dev = self.homes[t]
        buf, off = self._where(bound, t, dev)
        bound.backends[dev.name].write(buf, off, host)

    @staticmethod
    def _host_bytes(t: Tensor, value: Any) -> np.ndarray:
        """`value` as the bytes `t` stores (flat uint8), its shape checked."""
        arr = to_numpy(value)
        raw_shape = t.array_layout()[0]
        if t.dtype.is_quant and arr.dtype == np.uint8 and tuple(arr.shape) == raw_shape:
            host = arr  # raw blocks, as `read` returns them
        elif tuple(arr.shape) != t.shape:
            raise ValueError(f"input {t.describe()}: got shape {tuple(arr.shape)}")
        elif t.dtype.is_int:
            host = arr.astype(t.dtype.numpy, copy=False)
        elif not t.dtype.is_quant and arr.dtype == t.dtype.numpy:
            host = arr  # already stored as t stores it: from_float would round-trip it through f32 unchanged
        else:
            host = from_float(t.dtype, arr)
        return np.ascontiguousarray(host).view(np.uint8).reshape(-1)

    def launch(self) -> None:
        """Run every step on the inputs as last written; no host copies of the
        outputs (device work may still be in flight: see `synchronize`)."""
        for runner in self._bind().runners:
            runner()

    def poison(self, byte: int = 0xFF) -> None:
        """Fill every arena with `byte` (0xFF: NaN in every float type), so that a
        test can prove each output element is written by the next run."""
        bound = self._bind()
        for name, arena in bound.arenas.items():
            bound.backends[name].fill(arena, byte)

    def synchronize(self) -> None:
        """Wait for every device of the plan to finish its work."""
        for backend in self._bind().backends.values():
            backend.synchronize()

    def read(self, t: Tensor | str) -> np.ndarray:
        """The current value of an output, input or state, as a host array."""
        t = self._own(t)
        bound = self._bind()
        b = t.base
        dev = self.homes[b]
        buf, off = self._where(bound, b, dev)
        raw = bound.backends[dev.name].read(buf, off, b.nbytes)
        return np.array(t.host_view(raw, t.view_offset))

    def _where(self, bound: _Bound, b: Tensor, dev: Device) -> tuple[Any, int]:
        """(buffer, byte offset) of base `b` on `dev`."""
        key = (b, dev.name)
        if key in bound.persistent:
            return bound.persistent[key], 0
        mem = self.memory.get(dev.name)
        if mem is not None and key in mem.by_key:
            return bound.arenas[dev.name], mem.offset(key)
        home = self.homes.get(b)
        if dev.host_memory and home is not None and home.host_memory and home is not dev:
            return self._where(bound, b, home)
        raise RuntimeError(f"internal: {b.describe()} has no storage on {dev.name}")

    def _bind(self) -> _Bound:
        if self._shared.bound is None:
            self._shared.bound = self._make_bound()
        return self._shared.bound

    def _make_bound(self) -> _Bound:
        backends: dict[str, Backend] = {}
        for s in self.steps:
            for dev in (s.device, s.src_device):
                if dev is not None and dev.name not in backends:
                    if dev.backend_factory is None:
                        raise RuntimeError(f"device {dev.name} is a description only: it can plan, not run")
                    backends[dev.name] = dev.backend_factory(dev)
        for leaf in self.graph.leafs:
            dev = self.homes[leaf]
            if dev.name not in backends:
                backends[dev.name] = dev.backend_factory(dev)
        arenas = {name: backends[name].alloc(mem.peak, f"the arena of {name}") for name, mem in self.memory.items()}
        persistent: dict[tuple[Tensor, str], Any] = {}
        bound = _Bound(backends, arenas, persistent, [])
        for name, backend in backends.items():
            if all(callable(getattr(backend, m, None)) for m in ("staging", "upload", "download", "sub", "mark")):
                bound.feeders[name] = self._make_feeder(name, backend)
        for leaf in self.graph.leafs:
            dev = self.homes[leaf]
            persistent[(leaf, dev.name)] = resident(leaf, dev, backends[dev.name])
        segment: list[tuple[str, Any]] = []
        seg_dev: Device | None = None

        def flush() -> None:
            nonlocal segment, seg_dev
            if segment:
                bound.runners.append(backends[seg_dev.name].executor(segment))
            segment, seg_dev = [], None

        for s in self.steps:
            if s.kind == "view":
                continue
            if s.kind == "copy":
                flush()
                if s.note == "bind":  # a param: its buffer on this device is filled from its data
                    bound.persistent[(s.out, s.device.name)] = resident(s.out, s.device, backends[s.device.name])
                else:
                    bound.runners.append(self._bind_copy(bound, s))
                continue
            if seg_dev is not None and seg_dev is not s.device:
                flush()
            seg_dev = s.device
            dev = s.device
            ctx = backends[dev.name].bind_context(self._resolver(bound, dev))
            launch = s.bind(ctx, s.nodes[0]) if s.kind == "kernel" else s.bind(ctx, s.nodes)
            segment.append((f"{s.describe()} by {s.plugin}:{s.kernel}", launch))
        flush()
        for name, feeder in bound.feeders.items():
            self._feed_outputs(bound, name, feeder)
        bound.plumbing = self._plumbing(bound)
        return bound

    def _plumbing(self, bound: _Bound) -> _Plumbing:
        """What every run of this plan needs, resolved now (see _Plumbing)."""
        slots: dict[Tensor, _Slot] = {}
        for t in self.graph.inputs:
            feeder = bound.feeders.get(self.homes[t].name)
            if feeder is None or t not in feeder.inputs:
                continue
            off = feeder.inputs[t]
            raw = feeder.host[off:off + t.nbytes]
            dst = None
            if not t.dtype.is_quant and t.is_contiguous():
                dst = raw.view(t.dtype.numpy).reshape(t.shape)
            slots[t] = _Slot(dst, raw, bool(t.dtype.is_int))
        outputs: list[np.ndarray | None] = []
        for o in self.graph.outputs:
            b = o.base
            feeder = bound.feeders.get(self.homes[b].name)
            if feeder is None or b not in feeder.outputs:
                outputs.append(None)
                continue
            host_off = feeder.outputs[b][0]
            outputs.append(o.host_view(feeder.out_host[host_off:host_off + b.nbytes], o.view_offset))
        return _Plumbing(tuple(self.graph.inputs), slots, outputs, tuple(bound.feeders.values()))

    def _make_feeder(self, name: str, backend: Any) -> _Feeder:
        """The feeder of device `name`: this plan's inputs there that have no buffer yet get one block
        (sub-buffers registered as their resident buffers), staged through one host buffer of its layout."""
        ins = [t for t in self.graph.inputs if self.homes[t].name == name]
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
        return _Feeder(backend, offsets, backend.staging(size), uploads)

    def _feed_outputs(self, bound: _Bound, name: str, feeder: _Feeder) -> None:
        """The outputs homed on device `name` come back through the feeder's output staging buffer."""
        size = 0
        for o in self.graph.outputs:
            b = o.base
            if self.homes[b].name != name or b in feeder.outputs:
                continue
            buf, off = self._where(bound, b, self.homes[b])
            feeder.outputs[b] = (size, buf, off)
            size += _aligned(b.nbytes)
        feeder.out_host = feeder.backend.staging(size)

    def _resolver(self, bound: _Bound, dev: Device) -> Callable[[Tensor], tuple[Any, int]]:
        def where(t: Tensor) -> tuple[Any, int]:
            buf, off = self._where(bound, t.base, dev)
            return buf, off + t.view_offset

        return where

    def _bind_copy(self, bound: _Bound, s: Step) -> Callable[[], None]:
        b = s.out
        src_be, dst_be = bound.backends[s.src_device.name], bound.backends[s.device.name]
        src = self._where(bound, b, s.src_device)
        dst = self._where(bound, b, s.device)
        n = b.nbytes

        def copy() -> None:
            dst_be.write(dst[0], dst[1], src_be.read(src[0], src[1], n))

        return copy


def _fill_slot(slot: _Slot, t: Tensor, value: Any) -> bool:
    """Copy `value` into its staging slot when it is a numpy array of the input's shape that needs no
    conversion beyond Plan._host_bytes' integer cast; False: the caller converts it (_host_bytes)."""
    dst = slot.dst
    if dst is None or value.__class__ is not np.ndarray or value.shape != dst.shape:
        return False
    if value.dtype == dst.dtype:
        np.copyto(dst, value)
    elif slot.is_int:
        np.copyto(dst, value, casting="unsafe")  # _host_bytes' astype
    else:
        return False
    return True


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"
