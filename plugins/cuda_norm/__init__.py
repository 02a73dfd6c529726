"""The cuda_norm plugin: norm, rms_norm, l2_norm, group_norm on f32; rms_norm/norm -> mul (-> add) fused.

Hooks only; the predicates are in support.py, the fusion checks in fusion.py, the kernel instances
and launch specs in specs.py, the binds in bind.py, the CUDA C++ in kernels/norm.cu.
"""

from __future__ import annotations

from typing import Iterator

from opdispatch.backends.cuda.devices import warp32_gate
from opdispatch.hookspecs import PRIORITY_BUILTIN, Device, FusionRule, Kernel, PluginInfo, hookimpl
from opdispatch.tensor import Tensor

from . import bind, fusion, support


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda_norm", "0.1.0", PRIORITY_BUILTIN,
                      "norm, rms_norm, l2_norm, group_norm; rms_norm/norm + mul (+ add) fusion")


@hookimpl
def supports_op(device: Device, node: Tensor) -> bool | str | None:
    """Plugin-wide gate: the kernels assume 32-lane warps."""
    return warp32_gate(device)


@hookimpl
def kernels(device: Device) -> Iterator[Kernel]:
    if device.kind != "cuda":
        return
    for op in ("norm", "rms_norm", "l2_norm"):
        yield Kernel(op, bind.bind_row_norm, support.row_norm, name=f"{op}_f32")
    yield Kernel("group_norm", bind.bind_group_norm, support.group_norm, name="group_norm_f32")


@hookimpl
def fusion_rules(device: Device) -> Iterator[FusionRule]:
    """The longer group first: dispatch takes the first rule whose check passes."""
    if device.kind != "cuda":
        return
    for op in ("rms_norm", "norm"):
        yield FusionRule(f"{op}_mul_add", (op, "mul", "add"), bind=bind.bind_fused, check=fusion.check)
        yield FusionRule(f"{op}_mul", (op, "mul"), bind=bind.bind_fused, check=fusion.check)
