"""The weights a LlamaModel takes: HF names and shapes, the names that may stand for MoE weights, random values."""

from __future__ import annotations

import math
import re

import numpy as np

from .config import LlamaConfig

#: A MoE layer's weights (after "model.layers.{i}.") are stacked on a leading expert axis under the
#: names gguf's tensor map gives llama.cpp's ffn_gate_inp/ffn_{gate,up,down}_exps (weights.gguf.load_gguf's):
#: mlp.gate (E, hidden), mlp.experts.gate_proj / up_proj (E, ffn, hidden), mlp.experts.down_proj (E, hidden, ffn).
#: What may stand for each, in LlamaModel's weights: HF Mixtral's names, then HF Qwen2-MoE's ({e}: one per expert).
MOE_ALIASES: dict[str, tuple[str, ...]] = {
    "mlp.gate": ("block_sparse_moe.gate",),
    "mlp.experts.gate_proj": ("block_sparse_moe.experts.{e}.w1", "mlp.experts.{e}.gate_proj"),
    "mlp.experts.up_proj": ("block_sparse_moe.experts.{e}.w3", "mlp.experts.{e}.up_proj"),
    "mlp.experts.down_proj": ("block_sparse_moe.experts.{e}.w2", "mlp.experts.{e}.down_proj"),
}
LAYER_NAME = re.compile(r"(model\.layers\.\d+\.)(.+)\.weight")


def weight_shapes(cfg: LlamaConfig, parts: int = 1) -> dict[str, tuple[int, ...]]:
    """The weights LlamaModel takes, HF names -> numpy shapes ((out, in) for matrices).

    Expert weights appear stacked (see MOE_ALIASES); LlamaModel also takes
    them per expert under HF Mixtral's or Qwen2-MoE's names. "lm_head.weight" may be left out (tied to the
    embedding), and "rope_freqs.weight" (GGUF's name, head_dim/2 f32) may be
    given in place of cfg.rope_freq_factors.

    parts: the shapes of one rank's shards in a tensor split over `parts` devices (its 1/parts of the
    heads, KV heads and ffn features; core/models/llama/split.py): q/k/v and gate/up keep 1/parts of their
    rows, o_proj and down_proj 1/parts of their columns.
    """
    h, kv, f, e = cfg.hidden, cfg.kv_dim // parts, cfg.ffn // parts, cfg.experts
    q = h // parts
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab, h)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                   p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                   p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,)}
        if e:
            shapes |= {p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_proj.weight": (e, f, h),
                       p + "mlp.experts.up_proj.weight": (e, f, h), p + "mlp.experts.down_proj.weight": (e, h, f)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)}
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (cfg.vocab, h)}
    return shapes


def random_weights(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """HF Llama (or Mixtral, with experts) names, (out, in) matrices like torch.nn.Linear, float32.

    Linear weights have std 1/sqrt(in): HF's initializer_range 0.02 at hidden
    2048, and O(1) activations in a tiny model, so its attention is far from
    uniform and tests see RoPE and the mask (and the router's choices are far
    from ties). Embeddings have std 1; norm weights are near 1 but not 1, so a
    dropped norm weight shows. Values are uniform with that std rather than
    normal: 4x faster to draw, which a 1B-parameter model notices. MoE
    weights come under HF Mixtral's names (block_sparse_moe.gate, and
    block_sparse_moe.experts.{e}.w1/w2/w3 one expert at a time).
    """
    rng = np.random.default_rng(seed)

    def draw(shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        x = rng.random(shape, dtype=np.float32)
        x -= np.float32(0.5)
        x *= np.float32(2 * math.sqrt(3) * std)  # uniform on [-sqrt(3), sqrt(3)) * std
        x += np.float32(mean)
        return x

    w = {}
    for name, shape in weight_shapes(cfg).items():
        m = LAYER_NAME.fullmatch(name)
        mixtral = MOE_ALIASES[m.group(2)][0] if m and m.group(2) in MOE_ALIASES else None
        if name == "model.embed_tokens.weight":
            w[name] = draw(shape, 1.0)
        elif len(shape) == 1:
            w[name] = draw(shape, 0.1, mean=1.0)
        elif mixtral is None:
            w[name] = draw(shape, shape[1] ** -0.5)
        elif len(shape) == 2:  # the router
            w[f"{m.group(1)}{mixtral}.weight"] = draw(shape, shape[1] ** -0.5)
        else:
            for e in range(shape[0]):
                w[f"{m.group(1)}{mixtral.format(e=e)}.weight"] = draw(shape[1:], shape[2] ** -0.5)
    return w
