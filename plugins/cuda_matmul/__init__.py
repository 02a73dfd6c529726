"""The cuda_matmul plugin: mul_mat, mul_mat_id, out_prod; quantized mat-vec; bias/GLU fusions.

Its kernels arrive with the CUDA backend; until then it accepts nothing.
"""

from __future__ import annotations

from opdispatch.hookspecs import PRIORITY_BUILTIN, PluginInfo, hookimpl


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda_matmul", "0.1.0", PRIORITY_BUILTIN, "mul_mat, mul_mat_id, out_prod; quantized mat-vec; bias/GLU fusions")
