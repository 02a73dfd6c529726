"""LlamaConfig (a decoder's shape and storage dtypes), its translation from a transformers config.json, the presets.

RoPE: "neox" pairs dims (i, i + d/2), HF's rotate_half, for HF weights;
"normal" pairs (2i, 2i+1), for GGUF llama weights, whose Q/K rows llama.cpp's
converter permuted so that the normal pairs are HF's pairs.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import attrs

from ...dtypes import DTYPES
from ...dtypes import dtype as as_dtype
from ...quants import FORMATS

#: what cfg.dtype may name: every float type and block format of the dtype table. Params given to
#: LlamaModel keep their own types (a GGUF file mixes them); float arrays are converted to cfg.dtype.
WEIGHT_DTYPES = tuple(name for name, t in DTYPES.items() if t.is_float or t.is_quant)
#: the weight dtypes float arrays can be converted to: floats, and block formats opdispatch can quantize to
CONVERTIBLE_DTYPES = tuple(name for name in WEIGHT_DTYPES if name not in FORMATS or FORMATS[name].encode is not None)
CACHE_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
ROPE_MODES = ("neox", "normal")
#: the attention window grows in steps of this many positions (or up to max_ctx): a plan (and CUDA graph) a
#: window, and the decode attention reads the whole window (the masked keys past the last token too)
WINDOW_STEP = 128
#: LlamaConfig.from_hf caps the context (the KV cache is allocated whole) unless max_ctx is given
HF_MAX_CTX = 4096


def _factors(v: Sequence[float] | None) -> tuple[float, ...] | None:
    return None if v is None else tuple(float(x) for x in v)


@attrs.frozen
class LlamaConfig:
    """Shape of a Llama decoder, and the dtypes its weights and KV cache are stored in.

    dtype: what LlamaModel converts float weight arrays to (norms and the
    router stay f32). Weights given as params keep their own types, mixed or
    not: for a loaded file (load_gguf) dtype names the commonest storage type
    of its layer matrices, what `describe` reports.

    rope_mode: "neox" (HF weights) or "normal" (GGUF llama weights, Q/K rows
    permuted by llama.cpp's converter). rope_freq_scale: linear RoPE scaling
    (1 / factor). rope_freq_factors: head_dim/2 divisors of the frequencies
    (Llama 3's rope scaling; ggml's rope_freqs). experts: experts per MoE
    layer (0: a dense SwiGLU MLP); experts_used: how many each token takes
    (k); norm_topk: renormalize the k routing weights to sum to 1 (Mixtral
    does; Qwen-MoE says so in norm_topk_prob). With experts, ffn is each
    expert's hidden size.
    """

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    max_ctx: int = 2048
    dtype: str = attrs.field(default="f32", validator=attrs.validators.in_(WEIGHT_DTYPES))
    cache_dtype: str = attrs.field(default="f16", validator=attrs.validators.in_(CACHE_DTYPES))
    rope_mode: str = attrs.field(default="neox", validator=attrs.validators.in_(ROPE_MODES))
    rope_freq_scale: float = 1.0
    rope_freq_factors: tuple[float, ...] | None = attrs.field(default=None, converter=_factors)
    experts: int = 0
    experts_used: int = 0
    norm_topk: bool = True

    def __attrs_post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"llama: hidden {self.hidden} must split into {self.heads} heads of even size, "
                             f"and heads must be a multiple of kv_heads {self.kv_heads}")
        for what, dt, k in (("weights", self.dtype, math.gcd(self.hidden, self.ffn)),
                            ("cache", self.cache_dtype, self.head_dim)):
            block = as_dtype(dt).block_size
            if k % block:
                raise ValueError(f"llama: {what} dtype {dt} needs rows that are multiples of {block}, got {k}")
        if self.experts < 0 or (self.experts and not 1 <= self.experts_used <= self.experts) or (
                not self.experts and self.experts_used):
            raise ValueError(f"llama: experts_used {self.experts_used} must be in 1..experts ({self.experts}), "
                             "or both 0 for a dense MLP")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"llama: rope_freq_factors has {len(self.rope_freq_factors)} values, expected "
                             f"head_dim/2 = {self.head_dim // 2}")
        if not self.rope_freq_scale > 0:
            raise ValueError(f"llama: rope_freq_scale must be positive, got {self.rope_freq_scale}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def n_params(self) -> int:
        mlp = 3 * self.hidden * self.ffn * max(self.experts, 1) + self.experts * self.hidden
        per_layer = 2 * self.hidden * (self.hidden + self.kv_dim) + mlp + 2 * self.hidden
        return 2 * self.vocab * self.hidden + self.layers * per_layer + self.hidden

    def describe(self) -> str:
        moe = (f" x {self.experts} experts ({self.experts_used} used{', renormalized' if self.norm_topk else ''})"
               if self.experts else "")
        rope = f"rope {self.rope_mode} base {self.rope_base:g}"
        if self.rope_freq_scale != 1.0:
            rope += f" scale {self.rope_freq_scale:g}"
        if self.rope_freq_factors is not None:
            rope += " with freq factors"
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads ({self.kv_heads} kv, dim "
                f"{self.head_dim}), ffn {self.ffn}{moe}, vocab {self.vocab}, {rope}, max_ctx {self.max_ctx}; "
                f"{self.n_params() / 1e6:.1f}M params in {self.dtype}, cache {self.cache_dtype}")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> LlamaConfig:
        """A config from a transformers config.json (LlamaConfig, MistralConfig or MixtralConfig keys).

        Keys missing from `config` take that class's default. RoPE comes from
        rope_theta and rope_scaling (transformers 4) or from rope_parameters
        (transformers 5: rope_theta and the scaling keys in one dict, which
        wins over the other two). max_ctx is
        max_position_embeddings capped at HF_MAX_CTX (the KV cache is
        allocated whole); `overrides` (max_ctx, dtype, cache_dtype, ...) win.
        Architectures or options this builder does not run (biases, other
        activations, a head_dim other than hidden/heads, YaRN or dynamic
        RoPE scaling, a sliding window shorter than the context) raise
        ValueError rather than build a different model.
        """
        c = dict(config)
        kind = c.get("model_type", "llama")
        if kind not in _HF_DEFAULTS:
            raise ValueError(f"llama: HF model_type {kind!r} is not one this builder runs "
                             f"({', '.join(_HF_DEFAULTS)})")
        c = {**_HF_DEFAULTS[kind], **{k: v for k, v in c.items() if v is not None}}
        rope = c.get("rope_parameters")
        if isinstance(rope, Mapping):
            if any(isinstance(v, Mapping) for v in rope.values()):
                raise ValueError(f"llama: rope_parameters per layer type ({', '.join(rope)}) are not supported")
            c["rope_theta"] = rope.get("rope_theta", c["rope_theta"])
            c["rope_scaling"] = rope
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size") if k not in c]
        if missing:
            raise ValueError(f"llama: HF config lacks {', '.join(missing)}")
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        kw: dict[str, Any] = dict(
            vocab=int(c["vocab_size"]), hidden=hidden, layers=int(c["num_hidden_layers"]), heads=heads,
            kv_heads=int(c.get("num_key_value_heads", heads)), ffn=int(c["intermediate_size"]),
            rope_base=float(c["rope_theta"]), rms_eps=float(c["rms_norm_eps"]),
            max_ctx=min(int(c["max_position_embeddings"]), HF_MAX_CTX))
        experts = int(c.get("num_local_experts", 0))
        if experts:
            kw.update(experts=experts, experts_used=int(c["num_experts_per_tok"]),
                      norm_topk=bool(c.get("norm_topk_prob", True)))
        kw.update(_hf_rope_scaling(c.get("rope_scaling"), hidden // heads, kw["rope_base"]))
        kw.update(overrides)
        window = c.get("sliding_window")
        unsupported = [
            (c.get("hidden_act", "silu") != "silu", f"hidden_act {c.get('hidden_act')!r} (only silu)"),
            (bool(c.get("attention_bias")), "attention_bias"),
            (bool(c.get("mlp_bias")), "mlp_bias"),
            (int(c.get("head_dim") or hidden // heads) != hidden // heads,
             f"head_dim {c.get('head_dim')} other than hidden_size / num_attention_heads"),
            (window is not None and int(window) < kw["max_ctx"],
             f"sliding_window {window} shorter than max_ctx {kw['max_ctx']}"),
        ]
        bad = [why for cond, why in unsupported if cond]
        if bad:
            raise ValueError(f"llama: HF config needs what this builder does not run: {'; '.join(bad)}")
        return cls(**kw)


#: transformers' class defaults for the keys from_hf reads (config.json may omit a key at its default)
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "num_key_value_heads": 8, "sliding_window": 4096},
    "mixtral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
}


def _hf_rope_scaling(scaling: Mapping[str, Any] | None, head_dim: int, base: float) -> dict[str, Any]:
    """LlamaConfig fields for HF's rope_scaling: none, "linear" or "llama3"."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return {}
    if kind == "linear":
        return {"rope_freq_scale": 1.0 / float(scaling["factor"])}
    if kind == "llama3":
        # llama.cpp's rope_freqs (convert_hf_to_gguf.py), the inverse of HF's _compute_llama3_parameters.
        factor, old = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        factors = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi * base ** (i / head_dim)
            if wavelen < old / hi:
                factors.append(1.0)
            elif wavelen > old / lo:
                factors.append(factor)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                factors.append(1.0 / ((1 - smooth) / factor + smooth))
        return {"rope_freq_factors": tuple(factors)}
    raise ValueError(f"llama: rope_scaling {kind!r} is not supported (default, linear, llama3)")


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_ctx=128),
    "tiny-moe": LlamaConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=64, max_ctx=128,
                            experts=4, experts_used=2),
    # Llama-3.2-1B's shape with Llama 2's vocabulary and rope base; bf16 as the decode target says.
    "1b": LlamaConfig(vocab=32000, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, max_ctx=2048,
                      dtype="bf16"),
    # Llama-3-8B's shape (8.03B params: its vocabulary and rope base), bf16: the multi-GPU decode target's model.
    "8b": LlamaConfig(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, rope_base=500000.0,
                      max_ctx=2048, dtype="bf16"),
}


def window_for(cfg: LlamaConfig, n_end: int) -> int:
    """Cache positions attention reads when the last token sits at n_end - 1: a multiple of WINDOW_STEP, or
    max_ctx."""
    return min(cfg.max_ctx, -(-n_end // WINDOW_STEP) * WINDOW_STEP)
