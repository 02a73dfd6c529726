"""Multi-device split: each node on its device (the plan's, or its layer's in a layer split), else the CPU,
with copies between.

After ggml's scheduler: a node no plugin accepts on its device runs on
the CPU reference; a node reading weights that stay in host memory runs on
the CPU unless a plugin's `offload_op` says it is worth copying them over.
A layer split (core/placement.py) gives each node its device and each leaf
its home. Copies are inserted where a value is read on a device that does
not hold its current version, and an in-place write (set_rows into a KV
cache) made away from the buffer's home is copied back; in a layer split,
each copy is then moved up to just after the step that made its value, so
that a device's launches are not cut into several segments by the copies
of inputs they read later.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import attrs

from .errors import DispatchError, PluginError
from .fusion import can_fuse, gather, index_by_first_op
from .graph import Graph
from .hookspecs import Device, FusionRule, Kernel
from .manager import Plugin, PluginManager, PluginWarning
from .placement import Placement
from .tensor import VIEW_OPS, Flag, Tensor


@attrs.define(eq=False)
class Step:
    """One entry of a plan: a kernel launch, a fused group, a view or a copy."""

    kind: str  # "kernel" | "fused" | "view" | "copy"
    nodes: tuple[Tensor, ...]
    device: Device
    plugin: str = ""
    kernel: str = ""  # kernel label, fusion rule name, or copy direction
    bind: Callable | None = None
    declined: tuple[tuple[str, str], ...] = ()  # (plugin, reason), in the order asked
    note: str = ""  # why it is not where the plan's device would put it
    src_device: Device | None = None  # copies: from where
    #: fusion rules whose pattern matched here but which declined (before the one that fused, if any):
    #: (rule, reason)
    unfused: tuple[tuple[str, str], ...] = ()
    #: fused groups: the nodes besides the last whose outputs the kernel also writes
    writes: tuple[Tensor, ...] = ()

    @property
    def written(self) -> tuple[Tensor, ...]:
        """Every tensor this step writes: the extra outputs of a fused group, then `out`."""
        return (*self.writes, self.out)

    @property
    def out(self) -> Tensor:
        return self.nodes[-1]

    def describe(self) -> str:
        n = self.out
        what = "+".join(x.op or "?" for x in self.nodes) if self.kind != "copy" else "copy"
        return f"{what} {n.describe()}"


def select(mgr: PluginManager, plugins: Sequence[Plugin], device: Device, node: Tensor
           ) -> tuple[Plugin | None, Kernel | None, list[tuple[str, str]]]:
    """The first plugin, in order, that accepts `node` on `device`, and who declined before it."""
    declined: list[tuple[str, str]] = []
    for plugin in plugins:
        kernel, reason = mgr.supports(plugin, device, node)
        if kernel is not None:
            return plugin, kernel, declined
        declined.append((plugin.name, reason))
    return None, None, declined


@attrs.define(eq=False)
class Scheduler:
    """Turns a graph into steps on `device` (or, with a `placement`, each node's device), and `fallback`,
    with copies inserted."""

    mgr: PluginManager
    plugins: list[Plugin]
    device: Device
    fallback: Device
    fusion: bool = True
    host_params: frozenset[Tensor] = frozenset()
    placement: Placement | None = None
    #: after `schedule`: the device holding each base's own buffer (leafs: their home)
    homes: dict[Tensor, Device] = attrs.field(factory=dict)
    _sources: list[Device] = attrs.field(factory=list, init=False)

    def home(self, t: Tensor) -> Device:
        """Where a leaf's buffer lives."""
        if t in self.host_params:
            return self.fallback
        return self.device if self.placement is None else self.placement.homes[t]

    def device_of(self, node: Tensor) -> Device:
        """The device a node is placed on (its kernel may still fall back to the CPU)."""
        return self.device if self.placement is None else self.placement.nodes[node]

    def schedule(self, graph: Graph) -> list[Step]:
        steps = self._insert_copies(graph, self._assign(graph))
        return steps if self.placement is None else hoist_copies(steps)

    # -- devices and kernels ------------------------------------------------------
    def _assign(self, graph: Graph) -> list[Step]:
        rules: dict[str, dict] = {}  # per device name: its fusion rules by first op
        order = list(graph.nodes)  # execution order; a fusion that hoists nodes moves them ahead of its group
        steps: list[Step] = []
        placed: dict[Tensor, Device] = {}
        #: fused groups waiting for the nodes hoisted ahead of them, innermost last: (where the group
        #: now starts in `order`, its step); the hoisted nodes fuse only among themselves
        waiting: list[tuple[int, Step]] = []
        i = 0
        while i < len(order):
            if waiting and waiting[-1][0] == i:
                fused = waiting.pop()[1]
                steps.append(fused)
                placed.update((n, fused.device) for n in fused.nodes)
                i += len(fused.nodes)
                continue
            node = order[i]
            if node.op in VIEW_OPS:
                dev = placed[node.base] if node.base in placed else self.home(node.base)
                steps.append(Step("view", (node,), dev, kernel="view"))
                placed[node] = dev
                i += 1
                continue
            dev = self.device_of(node)
            if dev.name not in rules:
                rules[dev.name] = index_by_first_op(self.mgr.fusion_rules(self.plugins, dev) if self.fusion else [])
            end = waiting[-1][0] if waiting else len(order)
            fused, hoisted, unfused = self._fuse(graph, order, i, end, rules[dev.name].get(node.op, ()), dev)
            if fused is not None:
                fused.unfused = tuple(unfused)  # longer rules tried first and declined: explain() says why
                if hoisted:
                    span = len(fused.nodes) + len(hoisted)
                    order[i:i + span] = [*hoisted, *fused.nodes]
                    waiting.append((i + len(hoisted), fused))
                    continue
                steps.append(fused)
                placed.update((n, dev) for n in fused.nodes)
                i += len(fused.nodes)
                continue
            step = self._place(node, dev)
            step.unfused = tuple(unfused)
            steps.append(step)
            placed[node] = step.device
            i += 1
        return steps

    def _fuse(self, graph: Graph, order: Sequence[Tensor], i: int, end: int,
              rules: Sequence[tuple[Plugin, FusionRule]], device: Device
              ) -> tuple[Step | None, list[Tensor], list[tuple[str, str]]]:
        """The first of `rules` (those starting with node i's op, in plugin order) that fuses nodes
        from order[i] (before order[end]) on `device`, the nodes it hoists ahead of the group; and the
        (rule, reason) of those whose pattern matched but declined."""
        declined: list[tuple[str, str]] = []
        for plugin, rule in rules:
            gathered = gather(order, i, rule.pattern, rule.hoist, end)
            if gathered is None:
                continue
            group, hoisted = tuple(gathered[0]), gathered[1]
            if not can_fuse(graph, group, rule.pattern, rule.outputs):
                declined.append((rule.name, "an intermediate result is read outside the group"))
                continue
            writes = tuple(group[j] for j in rule.outputs)
            if any(w.op in VIEW_OPS for w in writes):  # in-place results (set_rows) are written, views are not
                declined.append((rule.name, "an extra output is a view"))
                continue
            if any(s in self.host_params for n in group for s in n.srcs):
                declined.append((rule.name, "reads weights kept on the host"))
                continue
            if self.placement is not None and any(self.placement.nodes[n] is not device for n in group):
                declined.append((rule.name, "its nodes are placed on different devices"))
                continue
            try:
                answer = rule.check(device, group, graph)
            except Exception as exc:  # noqa: BLE001 - a broken rule must not break dispatch
                self._warn_rule(plugin, rule.name, exc)
                declined.append((rule.name, f"check raised {type(exc).__name__}"))
                continue
            if answer is True:
                step = Step("fused", group, device, plugin.name, rule.name, rule.bind, writes=writes)
                return step, hoisted, declined
            declined.append((rule.name, answer if isinstance(answer, str) and answer else "check declined"))
        return None, [], declined

    def _warn_rule(self, plugin: Plugin, rule: str, exc: Exception) -> None:
        msg = f"plugin '{plugin.name}' raised in the check of fusion rule {rule}: {type(exc).__name__}: {exc}"
        if self.mgr.strict:
            raise PluginError(msg) from exc
        warnings.warn(f"opdispatch: {msg}", PluginWarning, stacklevel=4)

    def _place(self, node: Tensor, device: Device) -> Step:
        """The step running `node` on `device`, else on the fallback (`device` itself if it is a CPU)."""
        note = ""
        declined: list[tuple[str, str]] = []
        fallback = device if device.kind == "cpu" else self.fallback
        if device is not fallback:
            host_weights = [s for s in node.srcs if s is not None and s in self.host_params]
            offload = True
            if host_weights:
                answer, who = self.mgr.first_result(self.plugins, "offload_op", device=device, node=node)
                if isinstance(answer, str) or not answer:  # a reason, False, or no plugin has an opinion
                    offload = False
                    why = answer or (f"{who.name} keeps it on the host" if who else "no plugin offloads it")
                    note = f"weights on host, {why}"
            if offload:
                plugin, kernel, declined = select(self.mgr, self.plugins, device, node)
                if kernel is not None:
                    return Step("kernel", (node,), device, plugin.name, kernel.label, kernel.bind,
                                tuple(declined), "offloaded" if host_weights else "")
                note = f"no plugin accepts it on {device.name}"
        plugin, kernel, more = select(self.mgr, self.plugins, fallback, node)
        if kernel is None:
            asked = "; ".join(f"{p}: {r or 'no kernel'}" for p, r in declined + more)
            raise DispatchError(f"no plugin runs {node.op} {node.describe()} on "
                                f"{device.name} or {fallback.name} ({asked})")
        return Step("kernel", (node,), fallback, plugin.name, kernel.label, kernel.bind,
                    tuple(declined + more), note)

    # -- copies ----------------------------------------------------------------------
    def _insert_copies(self, graph: Graph, steps: list[Step]) -> list[Step]:
        """Copy each value to where it is read when that device lacks its current version.

        `version[b]` counts writes to base `b`; `held[(b, dev)]` is the version
        a device holds. Params never change, so their copies are made once at
        bind time (`note="bind"`).
        """
        version: dict[Tensor, int] = {}
        held: dict[tuple[Tensor, str], int] = {}
        home = self.homes
        for leaf in graph.leafs:
            home[leaf] = self.home(leaf)
            version[leaf] = 0
            held[(leaf, home[leaf].name)] = 0
        # where a current version may be copied from, in a fixed order
        self._sources = list({d.name: d for d in (self.device, self.fallback, *home.values(),
                                                  *(s.device for s in steps))}.values())
        out: list[Step] = []
        for step in steps:
            if step.kind == "view":
                out.append(step)
                continue
            inside = set(step.nodes)
            reads = {s.base for n in step.nodes for s in n.srcs if s is not None and s not in inside}
            for b in sorted(reads, key=lambda t: t.uid):
                self._ensure(b, step.device, version, held, home, out)
            for t in step.written:  # written in place: the buffer must be on this device first
                if t.base is not t:
                    self._ensure(t.base, step.device, version, held, home, out)
            out.append(step)
            for t in step.written:
                self._record_write(t, step, version, held, home, out)
        return out

    def _record_write(self, t: Tensor, step: Step, version: dict, held: dict, home: dict, out: list[Step]) -> None:
        """`step` wrote `t`: a new buffer at home on its device, or a new version of the
        buffer it aliases, copied back home when that is a leaf elsewhere (a KV cache)."""
        b = t.base
        if b is t:
            home[b] = step.device
            version[b] = 0
        else:
            version[b] += 1
        held[(b, step.device.name)] = version[b]
        if home[b] is not step.device and b.is_leaf:
            out.append(Step("copy", (b,), home[b], kernel=f"{step.device.name}->{home[b].name}",
                            src_device=step.device, note="write-back"))
            held[(b, home[b].name)] = version[b]

    def _ensure(self, b: Tensor, dev: Device, version: dict, held: dict, home: dict, out: list[Step]) -> None:
        if held.get((b, dev.name)) == version[b] or (dev.host_memory and home[b].host_memory):
            return
        src = home[b] if held.get((b, home[b].name)) == version[b] else next(
            d for d in self._sources if held.get((b, d.name)) == version[b])
        note = "bind" if b.flags & Flag.PARAM else ""
        out.append(Step("copy", (b,), dev, kernel=f"{src.name}->{dev.name}", src_device=src, note=note))
        held[(b, dev.name)] = version[b]


def hoist_copies(steps: list[Step]) -> list[Step]:
    """`steps` with each per-run copy moved up to just after the last step that writes the value it copies
    (or to the start): an input read on the second device of a layer split is then copied before the
    device's launches begin, which stay one segment (one CUDA graph). A copy made at bind time (a param's)
    or a write-back stays where it is. Safe: no step between the two places writes the value, and none
    reads it on the copy's device (that step would have needed the copy first)."""
    out: list[Step] = []
    for step in steps:
        j = len(out)
        if step.kind == "copy" and not step.note:
            b = step.out
            while j and (out[j - 1].kind == "view" or not any(t.base is b for t in out[j - 1].written)):
                j -= 1
        out.insert(j, step)
    return out
