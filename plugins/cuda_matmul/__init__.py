"""The cuda_matmul plugin: mul_mat, mul_mat_id, out_prod; quantized mat-vec and GEMM (mmq, mmq_id); bias/GLU fusions.

The hooks only: support.py picks each node's path (its name shows in `Plan.explain()`), specs/
computes the launches from shapes, strides and addresses, bind.py turns them into pre-bound
launches and fusion.py holds the fusion rules' checks. The paths, their kernels and their tuning
are described in docs/cuda_matmul.md.
"""

from __future__ import annotations

from opdispatch.backends.cuda.devices import warp32_gate
from opdispatch.backends.cuda.hooks import cuda_op_hooks
from opdispatch.hookspecs import PRIORITY_BUILTIN, Device, FusionRule, Kernel, PluginInfo
from opdispatch.tensor import Tensor

from . import bind, fusion, support

KERNELS: tuple[Kernel, ...] = tuple(Kernel(op, launch, support.takes(path), name=path)
                                    for op, path, launch in bind.PATHS)
#: the rules whose check, bind or extra outputs differ from the others'
_SPECIAL = {fusion.SHARE: dict(bind=bind.bind_fused_share, check=fusion.check_share, outputs=(1,)),
            fusion.PAIR: dict(bind=bind.bind_fused, check=fusion.check_pair, outputs=(2,))}
FUSION_RULES: tuple[FusionRule, ...] = tuple(
    FusionRule(name, pattern, **_SPECIAL.get(name, dict(bind=bind.bind_fused, check=fusion.check)))
    for name, pattern in fusion.PATTERNS)


def _gate(device: Device, node: Tensor) -> bool | str | None:
    """Plugin-wide: 32-lane warps, then the matrix products' shared conditions (said once)."""
    if device.kind != "cuda" or node.op not in support.MATMUL_OPS:
        return None
    return warp32_gate(device) or support.gate(node)


plugin_info, supports_op, kernels, fusion_rules = cuda_op_hooks(
    PluginInfo("cuda_matmul", "0.1.0", PRIORITY_BUILTIN,
               "mul_mat, mul_mat_id, out_prod; quantized mat-vec; bias/GLU fusions"),
    lambda: KERNELS, lambda: FUSION_RULES, gate=_gate)
