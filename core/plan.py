"""Plan: the steps that compute a graph on a device, and running them.

A Plan is computed without touching the hardware (so it can be inspected and
tested on a device description; `explain()` says who runs what and why); its
launches are bound on the first run (bind.py). A run then only writes the
inputs, calls one runner per device segment (CUDA: a graph replay) and reads
the outputs.

A cached plan serves every graph of its structure (`for_graph`): its steps and
launches hold the first graph's tensors, so what it raises is reworded to name
the caller's graph (`_rename`), whose tensors it also takes as feeds.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Mapping

import attrs
import numpy as np

from .alloc import MemoryPlan
from .bind import Bound, bind_plan, fill_slot
from .dtypes import encodable, from_float
from .errors import FeedError, OpdispatchError, PlanKeyError
from .graph import Graph
from .hookspecs import Device
from .placement import Placement
from .sched import Step
from .tensor import Flag, Tensor, check_values, host_array

#: a quoted tensor name in a message ('name' (shape) dtype: Tensor.describe)
_QUOTED = re.compile(r"'([^'\n]*)'")


@attrs.define(eq=False)
class _Shared:
    """What a plan and its copies for equal graphs (`for_graph`) share: the binding, pending submits."""

    bound: Bound | None = None
    #: per feeder of the last submit: waits until the device has taken its uploaded inputs
    taken: list[Callable[[], None]] = attrs.field(factory=list)


@attrs.define(eq=False)
class Plan:
    """Steps to compute a graph on a device (or, with a `placement`, split by layers over several: `device`
    is the first); `explain()` says who runs what."""

    graph: Graph
    device: Device
    steps: list[Step]
    homes: dict[Tensor, Device]
    memory: dict[str, MemoryPlan]
    fusion: bool
    plugin_order: list[str]
    placement: Placement | None = None
    _shared: _Shared = attrs.field(factory=_Shared)
    #: tensors of an equal graph -> this plan's tensors (a cached plan reused)
    _alias: dict[Tensor, Tensor] = attrs.field(factory=dict)
    #: that equal graph, whose tensors errors name (None: the plan's own graph)
    _caller: Graph | None = None

    def for_graph(self, graph: Graph) -> Plan:
        """This plan, answering to the tensors of `graph` (structurally equal) and naming them in errors."""
        if graph is self.graph:
            return self
        mine = [*self.graph.leafs, *self.graph.nodes]
        theirs = [*graph.leafs, *graph.nodes]
        return attrs.evolve(self, alias=dict(zip(theirs, mine)), caller=graph)

    def _own(self, t: Any) -> Tensor:
        """The plan's tensor for `t`: a tensor of its graph or of the caller's, or a leaf's name there."""
        if isinstance(t, str):
            for leaf in (self._caller or self.graph).leafs:
                if leaf.name == t:
                    return self._alias.get(leaf, leaf)
            raise PlanKeyError(f'no input or state is named "{t}" in the graph')  # not quoted as tensors are
        if not isinstance(t, Tensor):
            raise FeedError(f"feeds are keyed by input tensors or their names, got {t!r} ({type(t).__name__})")
        return self._alias.get(t, t)

    def _rename(self, exc: OpdispatchError) -> None:
        """Reword `exc` in place to name the caller's tensors (`_in_caller_names`)."""
        if self._caller is not None and len(exc.args) == 1 and isinstance(exc.args[0], str):
            exc.args = (self._in_caller_names(exc.args[0]),)

    def _in_caller_names(self, text: str) -> str:
        """`text` with the quoted names of this plan's tensors replaced by the caller's graph's: a cached
        plan's steps and bound kernels describe the graph it was built for. A name of this plan's that
        stands for tensors the caller names differently is left as it was (ambiguous)."""
        if self._caller is None:
            return text
        names: dict[str, str | None] = {}
        for mine, theirs in zip([*self.graph.leafs, *self.graph.nodes], [*self._caller.leafs, *self._caller.nodes]):
            if names.setdefault(mine.name, theirs.name) != theirs.name:
                names[mine.name] = None  # ambiguous
        return _QUOTED.sub(lambda m: f"'{names.get(m.group(1)) or m.group(1)}'", text)

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
        where = self.device.name if self.placement is None else ", ".join(d.name for d in self.placement.devices)
        lines = [
            f"plan on {where}: {len(self.graph.nodes)} nodes -> {len(kernels)} launches, "
            f"{len(self.fusions)} fused groups, {len(copies)} copies; fusion {'on' if self.fusion else 'off'}; "
            f"arena peak {peak}",
            f"plugin order: {', '.join(self.plugin_order)}",
        ]
        if self.placement is not None:
            lines.insert(1, f"layer split: {self.placement.describe()}")
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
        return self._in_caller_names("\n".join(lines))

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
        (see `bind.Feeder`); other inputs (states fed here, devices that do not
        stage) are written by `write`. `copy=False` returns views of the
        plan's output staging buffer instead of copies: no copy on the host,
        but the next run of this plan overwrites them (a decode loop that
        samples from the logits before the next step can use that).
        """
        try:
            bound = self._queue(feeds, download=True)
            for backend in bound.backends.values():
                backend.synchronize()
            bound.checks.check()
            out = []
            for o, view in zip(self.graph.outputs, bound.plumbing.outputs):
                if view is None:
                    out.append(self._read(o))
                else:
                    out.append(np.array(view) if copy else view)
        except OpdispatchError as e:
            self._rename(e)
            raise
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
        not until the device has finished it. A bad index a kernel met is
        raised by the next `run`, `read` or `check`.
        """
        try:
            self._queue(feeds, download=False)
        except OpdispatchError as e:
            self._rename(e)
            raise

    def _queue(self, feeds: Mapping[Tensor | str, Any] | None, *, download: bool) -> Bound:
        """Check the feeds, write the inputs into the staging buffers, queue their upload, every step and
        (with `download`) the outputs' download; wait for nothing but an earlier submit's upload."""
        alias = self._alias
        given: dict[Tensor, Any] = {}
        if feeds is not None and feeds.__class__ is not dict and not isinstance(feeds, Mapping):
            raise FeedError(f"feeds must be a mapping of inputs (tensors or names) to values, got "
                            f"{type(feeds).__name__}")
        for k, v in (feeds or {}).items():
            given[alias.get(k, k) if k.__class__ is Tensor else self._own(k)] = v
        ready = self._shared.bound
        inputs = ready.plumbing.inputs if ready is not None else self.graph.inputs
        if len(given) < len(inputs) or any(t not in given for t in inputs):
            missing = [t.describe() for t in inputs if t not in given]
            raise PlanKeyError(f"no value for input {', '.join(missing)}")
        bound = ready if ready is not None else self._bind()
        pl = bound.plumbing
        slots = pl.slots
        shared = self._shared
        while shared.taken:  # the device has read the staging buffers a submit queued
            shared.taken.pop()()
        writes: list[tuple[Tensor, np.ndarray]] = []  # fed by Plan.write, once every feed has been checked
        for t, value in given.items():
            slot = slots.get(t)
            if slot is None:
                self._writable(t)
                writes.append((t, self._host_bytes(t, value)))
            elif not fill_slot(slot, t, value):
                raw = self._host_bytes(t, value)
                slot.raw[:raw.size] = raw
        for t, raw in writes:
            self._write_bytes(bound, t, raw)  # synchronous: done before anything below is queued
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
        try:
            t = self._own(t)
            self._writable(t)
            raw = self._host_bytes(t, value)
            self._write_bytes(self._bind(), t, raw)
        except OpdispatchError as e:
            self._rename(e)
            raise

    def _writable(self, t: Tensor) -> None:
        if not t.is_leaf or not t.flags & (Flag.INPUT | Flag.STATE) or t not in self.homes:
            raise PlanKeyError(f"{t.describe()} is not an input or state of this plan")

    def _write_bytes(self, bound: Bound, t: Tensor, raw: np.ndarray) -> None:
        dev = self.homes[t]
        buf, off = bound.where(t, dev)
        bound.backends[dev.name].write(buf, off, raw)

    def _host_bytes(self, t: Tensor, value: Any) -> np.ndarray:
        """`value` as the bytes `t` stores (flat uint8), its shape and numbers checked (FeedError)."""
        who = f"{'state' if t.flags & Flag.STATE else 'input'} {t.describe()}"
        arr = host_array(who, value, FeedError)
        raw_shape = t.array_layout()[0]
        if t.dtype.is_quant and arr.dtype == np.uint8 and tuple(arr.shape) == raw_shape:
            return arr.reshape(-1)  # raw blocks, as `read` returns them
        if not encodable(t.dtype):
            raise FeedError(f"{who}: opdispatch only dequantizes {t.dtype.name}, so it cannot round values to it; "
                            f"write its raw blocks (uint8 of shape {raw_shape})")
        check_values(who, t, arr, FeedError)
        if tuple(arr.shape) != t.shape:
            raise FeedError(f"{who}: got shape {tuple(arr.shape)}")
        if arr.dtype == t.dtype.numpy and not t.dtype.is_quant:
            host = arr  # already stored as t stores it: from_float would round-trip it through f32 unchanged
        elif t.dtype.is_int:
            host = arr.astype(t.dtype.numpy)
        else:
            host = from_float(t.dtype, arr)
        return np.ascontiguousarray(host).view(np.uint8).reshape(-1)

    def launch(self) -> None:
        """Run every step on the inputs as last written; no host copies of the
        outputs (device work may still be in flight: see `synchronize`)."""
        try:
            for runner in self._bind().runners:
                runner()
        except OpdispatchError as e:
            self._rename(e)
            raise

    def poison(self, byte: int = 0xFF) -> None:
        """Fill every arena with `byte` (0xFF: NaN in every float type), so that a
        test can prove each output element is written by the next run."""
        try:
            bound = self._bind()
        except OpdispatchError as e:
            self._rename(e)
            raise
        for name, arena in bound.arenas.items():
            bound.backends[name].fill(arena, byte)

    def synchronize(self) -> None:
        """Wait for every device of the plan to finish its work."""
        try:
            for backend in self._bind().backends.values():
                backend.synchronize()
        except OpdispatchError as e:
            self._rename(e)
            raise

    def check(self) -> None:
        """Wait for the devices, then raise DeviceIndexError if a kernel met an index outside its range
        since the last check (`run` and `read` check too); the plan stays usable."""
        self.synchronize()
        try:
            self._bind().checks.check()
        except OpdispatchError as e:
            self._rename(e)
            raise

    def read(self, t: Tensor | str) -> np.ndarray:
        """The current value of an output, input or state, as a host array."""
        try:
            return self._read(self._own(t))
        except OpdispatchError as e:
            self._rename(e)
            raise

    def _read(self, t: Tensor) -> np.ndarray:
        bound = self._bind()
        b = t.base
        dev = self.homes.get(b)
        if dev is None:
            raise PlanKeyError(f"{t.describe()} is not a tensor of this plan")
        buf, off = bound.where(b, dev)
        raw = bound.backends[dev.name].read(buf, off, b.nbytes)
        bound.checks.check(dev.name)  # the device the read waited for
        return np.array(t.host_view(raw, t.view_offset))

    def _bind(self) -> Bound:
        if self._shared.bound is None:
            self._shared.bound = bind_plan(self)
        return self._shared.bound


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"
