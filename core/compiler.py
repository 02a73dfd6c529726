"""compile(): fusion, kernel selection, device split and memory plan -> Plan, and the plan cache.

Plans are cached per plugin manager by the graph's structural key and the
compile options, so a decode loop that rebuilds its graph every step gets the
same (already bound) plan back. The cache belongs to dispatch; it keeps the
manager's `generation` and drops every plan once plugins change.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable, Sequence

import attrs

from .alloc import plan_memory
from .errors import OpError, PlacementError
from .graph import Graph
from .hookspecs import Device
from .manager import PluginManager, manager
from .placement import place
from .plan import Plan
from .sched import Scheduler
from .tensor import Tensor

if TYPE_CHECKING:
    from .group import GroupPlan

#: plans kept per plugin manager (each holds its arenas once bound)
PLAN_CACHE_SIZE = 64


def fusion_from_env() -> bool:
    return os.environ.get("OPDISPATCH_DISABLE_FUSION", "") in ("", "0")


@attrs.define(eq=False)
class PlanCache:
    """One manager's compiled plans by key, least recently used first."""

    generation: int
    plans: OrderedDict[tuple, Plan] = attrs.field(factory=OrderedDict)


_CACHES: weakref.WeakKeyDictionary[PluginManager, PlanCache] = weakref.WeakKeyDictionary()


def plan_cache(mgr: PluginManager) -> PlanCache:
    """`mgr`'s plan cache, emptied if its plugins changed since the cache was filled."""
    cache = _CACHES.get(mgr)
    if cache is None or cache.generation != mgr.generation:
        cache = _CACHES[mgr] = PlanCache(mgr.generation)
    return cache


def compile(  # noqa: A001 - the natural name
    outputs: Graph | Tensor | Sequence[Tensor],
    device: str | Device | None = None,
    *,
    devices: Sequence[str | Device] | None = None,
    split: Sequence[float] | str | None = None,
    prefer: Sequence[str] = (),
    exclude: Iterable[str] = (),
    fusion: bool | None = None,
    host_params: Iterable[Tensor] = (),
    plugins: PluginManager | None = None,
) -> Plan | GroupPlan:
    """Plan `outputs` for `device` (default: the first GPU, else the CPU), or split by layers over
    `devices` (core/placement.py: contiguous layers per device, balanced by the devices' free memory or
    by the proportions `split`, one per device; split="layer" is the same without proportions; the plan's
    device is the first).

    split="tensor": a tensor split (docs/multi-device.md): `outputs` holds one graph per device, rank r's
    on devices[r] (each an output list or a Graph: the model's split rule built them, e.g. LlamaModel's
    ranks from models.llama.split.tensor_split), each planned as on one device; a GroupPlan runs them
    together.

    `prefer`/`exclude` reorder the plugins (see manager.py); `fusion=False`
    (or OPDISPATCH_DISABLE_FUSION=1) turns fusion off; `host_params` are
    weights that stay in host memory (run on the CPU unless offloaded).
    Plans are cached by the graph's structural key and these options
    (registering a plugin empties the cache).
    """
    mgr = plugins or manager()
    if devices is not None and device is not None:
        raise PlacementError(f"compile: give device ({device}) or devices, not both")
    devs = tuple(mgr.device(d) for d in devices) if devices else (mgr.device(device),)
    if isinstance(split, str):
        if split not in ("layer", "tensor"):
            raise PlacementError(f"compile: split must be 'layer', 'tensor' or proportions, got {split!r}")
        if len(devs) < 2:
            raise PlacementError(f"compile: split={split!r} needs devices=[...] of two devices or more")
        if split == "tensor":
            return _compile_ranks(outputs, devs, prefer=prefer, exclude=exclude, fusion=fusion,
                                  host_params=host_params, plugins=mgr)
        split = None
    graph = outputs if isinstance(outputs, Graph) else Graph.build(outputs)
    dev = devs[0]
    if split is not None and len(devs) < 2:
        raise PlacementError(f"compile: split {split!r} gives proportions for a layer split: it needs devices=[...] "
                             "of two devices or more")
    fusion = fusion_from_env() if fusion is None else fusion
    order = mgr.order(prefer, exclude)
    given = tuple(host_params)
    if not all(isinstance(t, Tensor) for t in given):
        raise OpError(f"compile: host_params must be tensors (params), got {given!r}")
    host = frozenset(given)
    # The key holds `dev` itself so that its id stays unique while cached, and the OPDISPATCH_ switches,
    # which plugins may read when asked (the offload threshold) and backends when binding (CUDA graphs, PDL).
    switches = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("OPDISPATCH_")))
    key = (graph.key(), dev, id(dev), fusion, tuple(p.name for p in order), tuple(sorted(t.uid for t in host)),
           switches)
    if len(devs) > 1:  # what the placement depends on: the devices, the proportions, the leafs' layers
        key += (devs, tuple(map(id, devs)), None if split is None else tuple(split),
                tuple(t.layer for t in graph.leafs))
    cache = plan_cache(mgr).plans
    cached = cache.get(key)
    if cached is not None:
        cache.move_to_end(key)
        return cached.for_graph(graph)
    placement = place(graph, devs, split) if len(devs) > 1 else None
    fallback = dev if dev.kind == "cpu" and placement is None else mgr.cpu()
    sched = Scheduler(mgr, order, dev, fallback, fusion, host, placement)
    steps = sched.schedule(graph)
    memory = plan_memory(graph, steps, sched.homes)
    plan = Plan(graph, dev, steps, sched.homes, memory, fusion, [p.name for p in order], placement)
    cache[key] = plan
    while len(cache) > PLAN_CACHE_SIZE:  # a sweep must not hold every plan's buffers
        cache.popitem(last=False)
    return plan


def _compile_ranks(outputs: Sequence[Graph | Sequence[Tensor]], devices: tuple[Device, ...], **options) -> GroupPlan:
    """A tensor split: rank r's graph `outputs[r]` planned for devices[r], as on one device."""
    from .group import GroupPlan

    if isinstance(outputs, (Graph, Tensor)) or len(outputs) != len(devices) or not all(
            isinstance(o, Graph) or (isinstance(o, Sequence) and all(isinstance(t, Tensor) for t in o))
            for o in outputs):
        raise PlacementError(f"compile: split='tensor' needs one graph per device ({len(devices)}: "
                             f"{', '.join(d.name for d in devices)}), each a Graph or a list of output tensors")
    if len({d.name for d in devices}) != len(devices):
        raise PlacementError(f"tensor split: needs distinct devices, got {', '.join(d.name for d in devices)}")
    return GroupPlan.of(tuple(compile(o, d, **options) for o, d in zip(outputs, devices)))
