"""leaky_cuda: leaky_relu (and scale -> leaky_relu fused) on contiguous f32, a plugin written with the kit."""

from __future__ import annotations

from opdispatch.backends.cuda.hooks import cuda_op_hooks
from opdispatch.hookspecs import FusionRule, Kernel, PluginInfo

from . import bind, fusion, support

KERNELS = (Kernel("leaky_relu", bind.bind_leaky, support.leaky, name="leaky_f32"),)
FUSION_RULES = (FusionRule("scale_leaky_relu", ("scale", "leaky_relu"), bind=bind.bind_scale_leaky,
                           check=fusion.check),)

# the four hooks, on CUDA devices only, with the 32-lane-warp gate (see hooks.py)
plugin_info, supports_op, kernels, fusion_rules = cuda_op_hooks(
    PluginInfo("leaky_cuda", "0.1.0", description="leaky_relu on f32, scale -> leaky_relu fused"),
    lambda: KERNELS, lambda: FUSION_RULES)
