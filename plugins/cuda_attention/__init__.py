"""The cuda_attention plugin: soft_max, rope, flash_attn_ext (split-K decode, tensor-core prefill) on CUDA,
rope -> view -> set_rows fused, and the decode step's q/k/v rope and KV-cache writes in one launch, or inside
the decode attention kernel that reads them. Hook implementations only: support.py (what the kernels
accept), fusion.py (the fusion rules' checks), specs/ (kernel instances, arguments, launch geometry),
bind.py (specs to launches); how the kernels work: docs/cuda_attention.md."""

from __future__ import annotations

from opdispatch.backends.cuda.hooks import cuda_op_hooks
from opdispatch.hookspecs import PRIORITY_BUILTIN, FusionRule, Kernel, PluginInfo

from . import bind, fusion, support

KERNELS: tuple[Kernel, ...] = (
    Kernel("soft_max", bind.bind_soft_max, support.soft_max, name="soft_max_f32"),
    Kernel("rope", bind.bind_rope, support.rope, name="rope"),
    Kernel("flash_attn_ext", bind.bind_flash_attn_ext, support.flash_attn_ext, name="flash_attn_ext"),
)

#: the decode step's q rotation and K/V writes with the attention after them (fusion.ATTN_PATTERN), asked
#: first; without the attention (fusion.QKV_PATTERN); both run k's and v's own nodes between theirs first
#: (fusion.QKV_HOIST: stacked or separate projections fuse alike); rope -> view or reshape -> set_rows: the
#: K-cache write of a decoder layer
FUSION_RULES: tuple[FusionRule, ...] = (
    FusionRule("rope_qkv_flash_attn_ext", fusion.ATTN_PATTERN, bind=bind.bind_qkv_flash_attn_ext,
               check=fusion.check_attn, outputs=fusion.ATTN_OUTPUTS, hoist=fusion.QKV_HOIST),
    FusionRule("rope_qkv_set_rows", fusion.QKV_PATTERN, bind=bind.bind_rope_qkv_set_rows,
               check=fusion.check_qkv, outputs=fusion.QKV_OUTPUTS, hoist=fusion.QKV_HOIST),
    FusionRule("rope_set_rows", ("rope", {"view", "reshape"}, "set_rows"), bind=bind.bind_rope_set_rows,
               check=fusion.check),
)

plugin_info, supports_op, kernels, fusion_rules = cuda_op_hooks(
    PluginInfo("cuda_attention", "0.1.0", PRIORITY_BUILTIN,
               "soft_max, rope, flash_attn_ext (split-K decode, tensor-core prefill); rope+set_rows and q/k/v "
               "rope+cache-write fusions"),
    lambda: KERNELS, lambda: FUSION_RULES)
