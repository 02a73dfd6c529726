"""The cuda_misc plugin: elementwise, unary, glu, copies, rows, reductions, sorting; multi-add, softcap, top-k MoE fusions.

Its kernels arrive with the CUDA backend; until then it accepts nothing.
"""

from __future__ import annotations

from opdispatch.hookspecs import PRIORITY_BUILTIN, PluginInfo, hookimpl


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda_misc", "0.1.0", PRIORITY_BUILTIN, "elementwise, unary, glu, copies, rows, reductions, sorting; multi-add, softcap, top-k MoE fusions")
