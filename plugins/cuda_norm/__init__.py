"""The cuda_norm plugin: norm, rms_norm, l2_norm, group_norm on f32; rms_norm/norm -> mul (-> add) fused.

Hooks only; the predicates are in support.py, the fusion checks in fusion.py, the kernel instances
and launch specs in specs.py, the binds in bind.py, the CUDA C++ in kernels/norm.cu.
"""

from __future__ import annotations

from opdispatch.backends.cuda.hooks import cuda_op_hooks
from opdispatch.hookspecs import PRIORITY_BUILTIN, FusionRule, Kernel, PluginInfo

from . import bind, fusion, support

KERNELS: tuple[Kernel, ...] = (
    *(Kernel(op, bind.bind_row_norm, support.row_norm, name=f"{op}_f32") for op in ("norm", "rms_norm", "l2_norm")),
    Kernel("group_norm", bind.bind_group_norm, support.group_norm, name="group_norm_f32"),
)

#: the longer group first: dispatch takes the first rule whose check passes
FUSION_RULES: tuple[FusionRule, ...] = tuple(
    FusionRule(f"{op}{name}", (op, *tail), bind=bind.bind_fused, check=fusion.check)
    for op in ("rms_norm", "norm") for name, tail in (("_mul_add", ("mul", "add")), ("_mul", ("mul",))))

plugin_info, supports_op, kernels, fusion_rules = cuda_op_hooks(
    PluginInfo("cuda_norm", "0.1.0", PRIORITY_BUILTIN,
               "norm, rms_norm, l2_norm, group_norm; rms_norm/norm + mul (+ add) fusion"),
    lambda: KERNELS, lambda: FUSION_RULES)
