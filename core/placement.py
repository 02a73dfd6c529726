"""Layer split: which device runs each node, and holds each leaf, of a graph compiled over several devices.

A model tags the params and states of each of its layers with the layer's index (`Tensor.layer`: the
Llama builder tags a layer's weights and its KV cache). Placement then works on the graph alone:

1. Each node gets a layer: the layer of the tagged leafs it reads (or writes in place: set_rows into a
   KV cache); else the latest layer among its node sources. Walking back from the outputs, a node that
   reads no tagged leaf and feeds a single user of a later layer is computed in that user's layer
   (the rms_norm opening a layer goes with the layer's weights, so only the residual stream crosses).
   Nodes with no layer yet (the token embedding) belong to the first layer.
2. Each layer costs the bytes of its params and states; an untagged param or state (the embedding, the
   LM head, sampling state) costs in the layer of its first reader.
3. The layers, in order, are cut into contiguous ranges, one per device, balancing the cost by the
   devices' free memory (their descriptions' `free_memory`) or by given proportions (`split`): a layer
   goes to the device whose share of the cumulated cost holds the layer's midpoint. A device whose
   params and states would exceed its free memory raises OutOfMemory naming the devices and bytes.
4. A node runs on its layer's device; a tagged leaf lives on its layer's device, an untagged one (an
   input, the embedding) on the device of its first reader. The scheduler copies values to the
   devices that read them (core/sched.py).
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import attrs

from .backends.base import bytes_text
from .errors import OutOfMemory, PlacementError
from .graph import Graph
from .hookspecs import Device
from .tensor import Flag, Tensor


@attrs.frozen
class LayerRange:
    """The layers one device holds (consecutive in the graph's order of layers) and the bytes of the params
    and states placed with them; `free`: the device's free memory as its description says (None: unknown)."""

    device: Device
    layers: tuple[int, ...]
    nbytes: int
    free: int | None

    def describe(self) -> str:
        if not self.layers:
            what = "no layers"
        elif len(self.layers) == 1:
            what = f"layer {self.layers[0]}"
        else:
            what = f"layers {self.layers[0]}-{self.layers[-1]}"
        return f"{what} on {self.device.name} ({self.nbytes / 2**20:.2f} MiB of params and states)"


@attrs.define(eq=False)
class Placement:
    """A layer split of a graph: the ranges, the device of every node and the home of every leaf."""

    ranges: tuple[LayerRange, ...]
    nodes: dict[Tensor, Device]
    homes: dict[Tensor, Device]

    @property
    def devices(self) -> tuple[Device, ...]:
        return tuple(r.device for r in self.ranges)

    def describe(self) -> str:
        return "; ".join(r.describe() for r in self.ranges)


def place(graph: Graph, devices: Sequence[Device], split: Sequence[float] | None = None) -> Placement:
    """The layer split of `graph` over `devices` (see the module docstring); `split`: one proportion per
    device (default: their free memory, else equal shares)."""
    if len({d.name for d in devices}) != len(devices) or not devices:
        raise PlacementError(f"layer split: needs distinct devices, got {', '.join(d.name for d in devices)}")
    layer_of = node_layers(graph)
    first_reader: dict[Tensor, Tensor] = {}
    for n in graph.nodes:
        for s in (*n.srcs, n):
            if s is not None and s.base.is_leaf:
                first_reader.setdefault(s.base, n)
    order = sorted({t.layer for t in graph.leafs if t.layer is not None})
    if not order:
        order = [0]  # no tagged leafs: one layer holding every node
    index = {layer: i for i, layer in enumerate(order)}

    def leaf_layer(t: Tensor) -> int:
        if t.layer is not None:
            return t.layer
        reader = first_reader.get(t)
        return layer_of[reader] if reader is not None else order[0]

    costs = [0] * len(order)
    for t in graph.leafs:
        if t.flags & (Flag.PARAM | Flag.STATE):
            costs[index[leaf_layer(t)]] += t.nbytes
    ranges = split_layers(order, costs, devices, split)
    device_of = {layer: r.device for r in ranges for layer in r.layers}
    nodes = {n: device_of[layer] for n, layer in layer_of.items()}
    homes = {t: device_of[leaf_layer(t)] for t in graph.leafs}
    return Placement(ranges, nodes, homes)


def node_layers(graph: Graph) -> dict[Tensor, int]:
    """The layer each node of `graph` belongs to (steps 1 of the module docstring)."""
    layer: dict[Tensor, int | None] = {}
    pinned: set[Tensor] = set()
    for n in graph.nodes:
        tags = [s.base.layer for s in (*n.srcs, n) if s is not None and s.base.is_leaf and s.base.layer is not None]
        if tags:
            layer[n] = max(tags)
            pinned.add(n)
            continue
        known = [layer[s] for s in n.srcs if s is not None and not s.is_leaf and layer[s] is not None]
        layer[n] = max(known) if known else None
    for n in reversed(graph.nodes):  # users come after their sources: a chain of single users follows its end
        if n in pinned:
            continue
        users = set(graph.users.get(n, ()))
        if len(users) == 1:
            u = layer[users.pop()]
            if u is not None and (layer[n] is None or u > layer[n]):
                layer[n] = u
    tagged = [t.layer for t in graph.leafs if t.layer is not None]
    first = min(tagged) if tagged else 0
    return {n: first if l is None else l for n, l in layer.items()}


def split_layers(layers: Sequence[int], costs: Sequence[int], devices: Sequence[Device],
                 split: Sequence[float] | None = None) -> tuple[LayerRange, ...]:
    """Cut `layers` (in order, `costs[i]` bytes each) into contiguous ranges, one per device in order, balanced by
    `split` or the devices' free memory (else equal shares); OutOfMemory if a device's range exceeds its free
    memory."""
    shares = _shares(devices, split)
    total = sum(costs)
    weights = list(costs) if total else [1] * len(costs)  # nothing to weigh: split the layer count
    whole = sum(weights)
    bounds = [whole * sum(shares[:j + 1]) / sum(shares) for j in range(len(devices))]
    owner: list[int] = []
    done, j = 0.0, 0
    for w in weights:
        while j < len(devices) - 1 and done + w / 2 > bounds[j]:
            j += 1
        owner.append(j)
        done += w
    ranges = []
    for j, dev in enumerate(devices):
        mine = [i for i, o in enumerate(owner) if o == j]
        free = dev.props.get("free_memory")
        ranges.append(LayerRange(dev, tuple(layers[i] for i in mine), sum(costs[i] for i in mine),
                                 int(free) if free is not None else None))
    over = [r for r in ranges if r.free is not None and r.nbytes > r.free]
    if over:
        have = ", ".join(f"{r.device.name} {bytes_text(r.free)}" if r.free is not None else f"{r.device.name} unknown"
                         for r in ranges)
        detail = "; ".join(f"{r.describe()}: {r.free} bytes free" for r in over)
        raise OutOfMemory(f"layer split over {', '.join(d.name for d in devices)}: the params and states need "
                          f"{bytes_text(total)} in all, free: {have}; too little memory on {detail}")
    return tuple(ranges)


def _shares(devices: Sequence[Device], split: Sequence[float] | None) -> list[float]:
    """Each device's share of the layers: `split` as given, else the free memory of every device when all
    descriptions give it, else equal."""
    if split is not None:
        shares = list(split)
        if len(shares) != len(devices) or not all(map(_proportion, shares)) or not sum(shares) > 0:
            raise PlacementError(f"layer split: split must give one proportion >= 0 per device "
                                 f"({', '.join(d.name for d in devices)}), not all 0; got {split!r}")
        return [float(x) for x in shares]
    free = [d.props.get("free_memory") for d in devices]
    if all(isinstance(f, int) and f > 0 for f in free):
        return [float(f) for f in free]
    return [1.0] * len(devices)


def _proportion(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
