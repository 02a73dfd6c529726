"""The cuda_attention plugin: soft_max, rope, flash_attn_ext (split-K decode, tensor-core prefill) on CUDA,
rope -> view -> set_rows fused, and the decode step's q/k/v rope and KV-cache writes in one launch, or inside
the decode attention kernel that reads them. Hook implementations only: support.py (what the kernels
accept), fusion.py (the fusion rules' checks), specs/ (kernel instances, arguments, launch geometry),
bind.py (specs to launches); how the kernels work: docs/cuda_attention.md."""

from __future__ import annotations

from typing import Iterator

from opdispatch.backends.cuda.devices import warp32_gate
from opdispatch.hookspecs import PRIORITY_BUILTIN, Device, FusionRule, Kernel, PluginInfo, hookimpl
from opdispatch.tensor import Tensor

from . import bind, fusion, support


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda_attention", "0.1.0", PRIORITY_BUILTIN,
                      "soft_max, rope, flash_attn_ext (split-K decode, tensor-core prefill); rope+set_rows and q/k/v "
                      "rope+cache-write fusions")


@hookimpl
def supports_op(device: Device, node: Tensor) -> bool | str | None:
    """Plugin-wide gate: the kernels assume 32-lane warps."""
    return warp32_gate(device)


@hookimpl
def kernels(device: Device) -> Iterator[Kernel]:
    if device.kind != "cuda":
        return
    yield Kernel("soft_max", bind.bind_soft_max, support.soft_max, name="soft_max_f32")
    yield Kernel("rope", bind.bind_rope, support.rope, name="rope")
    yield Kernel("flash_attn_ext", bind.bind_flash_attn_ext, support.flash_attn_ext, name="flash_attn_ext")


@hookimpl
def fusion_rules(device: Device) -> Iterator[FusionRule]:
    """The decode step's q rotation and K/V writes with the attention after them (fusion.ATTN_PATTERN), asked
    first; without the attention (fusion.QKV_PATTERN); rope -> view (or reshape) -> set_rows: the K-cache
    write of a decoder layer."""
    if device.kind != "cuda":
        return
    yield FusionRule("rope_qkv_flash_attn_ext", fusion.ATTN_PATTERN, bind=bind.bind_qkv_flash_attn_ext,
                     check=fusion.check_attn, outputs=fusion.ATTN_OUTPUTS)
    yield FusionRule("rope_qkv_set_rows", fusion.QKV_PATTERN, bind=bind.bind_rope_qkv_set_rows,
                     check=fusion.check_qkv, outputs=fusion.QKV_OUTPUTS)
    for view in ("view", "reshape"):
        yield FusionRule(f"rope_{view}_set_rows", ("rope", view, "set_rows"), bind=bind.bind_rope_set_rows,
                         check=fusion.check)
