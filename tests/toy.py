"""A toy device and plugins for testing dispatch without a GPU.

The toy device computes in host memory but is not the CPU: nodes it cannot
run fall back to the CPU reference, with copies, as a GPU's would.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from opdispatch.backends.cpu import HostBackend
from opdispatch.hookspecs import Device, FusionRule, Kernel, PluginInfo, hookimpl
from opdispatch.manager import PluginManager
from opdispatch.reference import load, store
from opdispatch.reference import plugin as cpu_plugin


def toy_device(name: str = "toy0", host_memory: bool = False) -> Device:
    """A device computing in numpy buffers of its own (not shared with the CPU)."""
    return Device(name, "toy", "toy device", backend_factory=HostBackend, host_memory=host_memory)


TOY = toy_device()


def _binary(fn):  # noqa: ANN001, ANN202 - tiny test kernel factory
    def bind(ctx, node):  # noqa: ANN001, ANN202
        out, a, b = ctx.array(node), ctx.array(node.srcs[0]), ctx.array(node.srcs[1])
        return lambda: store(out, fn(load(a, node.srcs[0]), load(b, node.srcs[1])), node)

    return bind


def same_shape_f32(device: Device, node) -> bool | str:  # noqa: ANN001
    if node.dtype.name != "f32":
        return "f32 only"
    if node.srcs[1].shape != node.shape:
        return "no broadcasting"
    return True


class ToyPlugin:
    """Runs add and mul on the toy device, and fuses add -> mul."""

    def __init__(self, name: str = "toy", priority: int = 200, device: Device = TOY, offset: float = 0.0) -> None:
        self.name, self.priority, self.device, self.offset = name, priority, device, offset
        self.fused_runs = 0

    @hookimpl
    def plugin_info(self) -> PluginInfo:
        return PluginInfo(self.name, "1.0", self.priority)

    @hookimpl
    def devices(self) -> list[Device]:
        return [self.device]

    @hookimpl
    def kernels(self, device: Device) -> Iterator[Kernel]:
        if device.kind == "toy":
            yield Kernel("add", _binary(lambda a, b: a + b + self.offset), same_shape_f32, "toy_add")
            yield Kernel("mul", _binary(np.multiply), same_shape_f32, "toy_mul")

    @hookimpl
    def fusion_rules(self, device: Device) -> Iterator[FusionRule]:
        if device.kind == "toy":
            yield FusionRule("add_mul", ("add", "mul"), bind=self._bind_add_mul, check=self._check_add_mul)

    def _check_add_mul(self, device, nodes, graph) -> bool | str:  # noqa: ANN001
        add, mul = nodes
        if mul.srcs[0] is not add:
            return "mul must read the add as its first source"
        return all(same_shape_f32(device, n) is True for n in nodes) or "shapes differ"

    def _bind_add_mul(self, ctx, nodes):  # noqa: ANN001, ANN202
        add, mul = nodes
        out = ctx.array(mul)
        a, b, c = (ctx.array(t) for t in (add.srcs[0], add.srcs[1], mul.srcs[1]))

        def launch() -> None:
            self.fused_runs += 1
            store(out, (load(a, "f32") + load(b, "f32")) * load(c, "f32"), mul)

        return launch


def manager_with(*plugins: object, strict: bool = False) -> PluginManager:
    """A private manager holding the CPU reference plugin and `plugins`."""
    mgr = PluginManager(strict=strict)
    mgr.register(cpu_plugin, "cpu")
    for p in plugins:
        mgr.register(p, getattr(p, "name", None))
    return mgr
