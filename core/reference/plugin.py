"""The CPU plugin: the CPU device and a kernel for every op from the reference.

Registered through the ``opdispatch`` entry point like any plugin, with the
lowest priority: it runs what no other plugin takes.
"""

from __future__ import annotations

from typing import Iterator

from ..backends.base import BindContext
from ..backends.cpu import HostBackend
from ..hookspecs import PRIORITY_REFERENCE, Device, Kernel, Launch, PluginInfo, hookimpl
from ..tensor import Tensor
from . import REFERENCE

CPU = Device("cpu", "cpu", "numpy reference", backend_factory=HostBackend, host_memory=True)


def bind(ctx: BindContext, node: Tensor) -> Launch:
    fn = REFERENCE[node.op]
    out = ctx.array(node)
    srcs = [ctx.array(s) if s is not None else None for s in node.srcs]
    return lambda: fn(node, out, *srcs)


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cpu", "reference", PRIORITY_REFERENCE, "numpy reference kernels for every op")


@hookimpl
def devices() -> list[Device]:
    return [CPU]


@hookimpl
def kernels(device: Device) -> Iterator[Kernel]:
    if device.kind == "cpu":
        for op in REFERENCE:
            yield Kernel(op, bind, name="numpy")
