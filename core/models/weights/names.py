"""GGUF tensor names <-> the HF Llama names LlamaModel takes."""

from __future__ import annotations

import re

#: GGUF tensor names outside the layers -> HF names.
GGUF_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when tied: LlamaModel then uses the embedding
    "rope_freqs.weight": "rope_freqs.weight",  # Llama 3 rope scaling: head_dim/2 frequency divisors (f32)
}

#: Per layer: GGUF ``blk.{i}.<key>.weight`` -> HF ``model.layers.{i}.<value>.weight``.
#:
#: MoE (Mixtral / Qwen2-MoE style, llama.cpp's stacked layout): the router and
#: the experts' matrices stacked on a leading expert axis, under the "merged"
#: names gguf's own tensor_mapping lists for qwen2moe/olmoe, so its
#: TensorNameMap maps them straight back:
#:   mlp.gate.weight                (experts, hidden)         router logits = x @ W.T
#:   mlp.experts.gate_proj.weight   (experts, ffn, hidden)
#:   mlp.experts.up_proj.weight     (experts, ffn, hidden)
#:   mlp.experts.down_proj.weight   (experts, hidden, ffn)
#: (transformers' Mixtral state dict names experts one by one,
#: ``block_sparse_moe.experts.{e}.w1/w3/w2``; stacking those is the model
#: builder's job, `load_state_dict` keeps names as given.)
GGUF_LAYER_TO_HF: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}

_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def gguf_name_to_hf(name: str) -> str | None:
    """The HF name of a GGUF tensor name, or None when `GGUF_TO_HF` / `GGUF_LAYER_TO_HF` have none."""
    if name in GGUF_TO_HF:
        return GGUF_TO_HF[name]
    m = _BLK.fullmatch(name)
    if m and m.group(2) in GGUF_LAYER_TO_HF:
        return f"model.layers.{m.group(1)}.{GGUF_LAYER_TO_HF[m.group(2)]}.weight"
    return None


_HF_TO_GGUF = {hf: g for g, hf in GGUF_TO_HF.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")
_HF_LAYER_TO_GGUF = {hf: g for g, hf in GGUF_LAYER_TO_HF.items()}


def hf_name_to_gguf(name: str) -> str | None:
    """The GGUF name of an HF Llama weight name (the inverse of `gguf_name_to_hf`), or None."""
    if name in _HF_TO_GGUF:
        return _HF_TO_GGUF[name]
    m = _HF_LAYER.fullmatch(name)
    if m and m.group(2) in _HF_LAYER_TO_GGUF:
        return f"blk.{m.group(1)}.{_HF_LAYER_TO_GGUF[m.group(2)]}.weight"
    return None
