"""leaky_cuda: leaky_relu (and scale -> leaky_relu fused) on contiguous f32, a plugin written with the kit."""

from __future__ import annotations

from typing import Iterator

from opdispatch.hookspecs import Device, FusionRule, Kernel, PluginInfo, hookimpl

from . import bind, fusion, support


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("leaky_cuda", "0.1.0", description="leaky_relu on f32, scale -> leaky_relu fused")


@hookimpl
def kernels(device: Device) -> Iterator[Kernel]:
    if device.kind == "cuda":
        yield Kernel("leaky_relu", bind.bind_leaky, support.leaky, name="leaky_f32")


@hookimpl
def fusion_rules(device: Device) -> Iterator[FusionRule]:
    if device.kind == "cuda":
        yield FusionRule("scale_leaky_relu", ("scale", "leaky_relu"), bind=bind.bind_scale_leaky, check=fusion.check)
