"""The cuda_attention plugin: soft_max, rope, flash_attn_ext; rope+set_rows fusion.

Its kernels arrive with the CUDA backend; until then it accepts nothing.
"""

from __future__ import annotations

from opdispatch.hookspecs import PRIORITY_BUILTIN, PluginInfo, hookimpl


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda_attention", "0.1.0", PRIORITY_BUILTIN, "soft_max, rope, flash_attn_ext; rope+set_rows fusion")
