"""The CUDA backend plugin: brings the GPUs as devices and ggml's offload rule."""

from __future__ import annotations

from ...hookspecs import PRIORITY_BUILTIN, PluginInfo, hookimpl
from ..base import Device
from .devices import discover


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda", "0.1.0", PRIORITY_BUILTIN, "CUDA devices through CuPy")


@hookimpl
def devices() -> list[Device]:
    return list(discover()[0])
