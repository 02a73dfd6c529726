"""The hooks every CUDA op plugin implements alike, made once from its records.

A built-in CUDA op plugin runs nodes on CUDA devices only, and its kernels' reductions assume
32-lane warps: `cuda_op_hooks` gives it `plugin_info`, `supports_op`, `kernels` and
`fusion_rules` with those two rules applied here, so its `__init__.py` only names its records.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

from ...hookspecs import Device, FusionRule, Kernel, PluginInfo, hookimpl
from ...tensor import Tensor
from .devices import warp32_gate

Gate = Callable[[Device, Tensor], "bool | str | None"]


def warp32_supports_op(device: Device, node: Tensor) -> bool | str | None:
    """The default plugin-wide gate: on a CUDA device, 32-lane warps."""
    return warp32_gate(device) if device.kind == "cuda" else None


class CudaOpHooks(NamedTuple):
    plugin_info: Callable[[], PluginInfo]
    supports_op: Callable[[Device, Tensor], bool | str | None]
    kernels: Callable[[Device], list[Kernel]]
    fusion_rules: Callable[[Device], list[FusionRule]]


def cuda_op_hooks(info: PluginInfo, kernels: Callable[[], Iterable[Kernel]],
                  fusion_rules: Callable[[], Iterable[FusionRule]] = tuple,
                  gate: Gate = warp32_supports_op) -> CudaOpHooks:
    """The four hook implementations of a CUDA op plugin: `info`; `gate` (a plugin-wide
    `supports_op`, by default `warp32_supports_op`); `kernels()` and `fusion_rules()` on CUDA
    devices, nothing elsewhere. Unpack them into the plugin module's namespace:

        plugin_info, supports_op, kernels, fusion_rules = cuda_op_hooks(PluginInfo(...), lambda: KERNELS)
    """

    def plugin_info() -> PluginInfo:
        return info

    def supports_op(device: Device, node: Tensor) -> bool | str | None:
        return gate(device, node)

    def kernels_on(device: Device) -> list[Kernel]:
        return list(kernels()) if device.kind == "cuda" else []

    def fusion_rules_on(device: Device) -> list[FusionRule]:
        return list(fusion_rules()) if device.kind == "cuda" else []

    return CudaOpHooks(*(hookimpl(fn) for fn in (plugin_info, supports_op, kernels_on, fusion_rules_on)))
