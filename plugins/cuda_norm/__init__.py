"""The cuda_norm plugin: norm, rms_norm, l2_norm, group_norm; rms_norm+mul(+add) fusion.

Its kernels arrive with the CUDA backend; until then it accepts nothing.
"""

from __future__ import annotations

from opdispatch.hookspecs import PRIORITY_BUILTIN, PluginInfo, hookimpl


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda_norm", "0.1.0", PRIORITY_BUILTIN, "norm, rms_norm, l2_norm, group_norm; rms_norm+mul(+add) fusion")
