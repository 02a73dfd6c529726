"""A Llama decoder as one opdispatch graph per step, and generation (greedy, top-k, top-p).

The graph follows llama.cpp's: embedding by get_rows, per layer RMSNorm ->
q/k/v projections -> RoPE -> K and V written into the cache with set_rows ->
flash_attn_ext over a fixed window of the cache with a causal f16 mask ->
output projection -> residual -> RMSNorm -> SwiGLU MLP (or a mixture of
experts) -> residual; final norm and LM head. Everything that changes from
one decode step to the next is an input (token, position, cache row, mask),
so a decode step's graph, plan and CUDA graph stay the same for 256 tokens at
a time.

RoPE: "neox" pairs dims (i, i + d/2), HF's rotate_half, for HF weights;
"normal" pairs (2i, 2i+1), for GGUF llama weights, whose Q/K rows llama.cpp's
converter permuted so that the normal pairs are HF's pairs. Linear scaling
(freq_scale) and Llama 3's per-frequency factors (rope_freq_factors) apply.

Mixture of experts (Mixtral, Qwen-MoE): router logits -> soft_max -> top_k ->
the selected probabilities gathered with get_rows (optionally renormalized:
sum_rows, div) -> the experts' SwiGLU through mul_mat_id -> weighted (mul) and
summed over the k experts by a chain of adds, as llama.cpp's build_moe_ffn.

KV cache layout: per layer one state of shape (max_ctx, kv_heads * head_dim)
for K and one for V, a row per token position (llama.cpp's layout). A step
writes its rows straight from the projection/RoPE output (a free reshape, the
rope -> view -> set_rows pattern ggml fuses), and attention reads the window
as a strided view (1, kv_heads, window, head_dim) that costs nothing.
"""

from __future__ import annotations

import functools
import math
import re
import time
from typing import Any, Mapping, Sequence, TextIO

import attrs
import numpy as np

from .. import ops
from ..compiler import compile
from ..dtypes import dtype as as_dtype
from ..hookspecs import Device
from ..manager import manager
from ..plan import Plan
from ..tensor import Flag, Tensor, input, param, state  # noqa: A004

__all__ = ["LlamaConfig", "PRESETS", "MOE_ALIASES", "weight_shapes", "random_weights", "LlamaModel", "StepInputs",
           "Sampler", "SAMPLING", "Progress", "Generator", "Generation", "BatchGeneration", "generate", "window_for"]

WEIGHT_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
CACHE_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
ROPE_MODES = ("neox", "normal")
#: the attention window grows in steps of this many positions (or up to max_ctx)
WINDOW_STEP = 256
#: LlamaConfig.from_hf caps the context (the KV cache is allocated whole) unless max_ctx is given
HF_MAX_CTX = 4096


def _factors(v: Sequence[float] | None) -> tuple[float, ...] | None:
    return None if v is None else tuple(float(x) for x in v)


@attrs.frozen
class LlamaConfig:
    """Shape of a Llama decoder, and the dtypes its weights and KV cache are stored in.

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
}

#: A MoE layer's weights (after "model.layers.{i}.") are stacked on a leading expert axis under the
#: names gguf's tensor map gives llama.cpp's ffn_gate_inp/ffn_{gate,up,down}_exps (weights.load_gguf's):
#: mlp.gate (E, hidden), mlp.experts.gate_proj / up_proj (E, ffn, hidden), mlp.experts.down_proj (E, hidden, ffn).
#: What may stand for each, in LlamaModel's weights: HF Mixtral's names, then HF Qwen2-MoE's ({e}: one per expert).
MOE_ALIASES: dict[str, tuple[str, ...]] = {
    "mlp.gate": ("block_sparse_moe.gate",),
    "mlp.experts.gate_proj": ("block_sparse_moe.experts.{e}.w1", "mlp.experts.{e}.gate_proj"),
    "mlp.experts.up_proj": ("block_sparse_moe.experts.{e}.w3", "mlp.experts.{e}.up_proj"),
    "mlp.experts.down_proj": ("block_sparse_moe.experts.{e}.w2", "mlp.experts.{e}.down_proj"),
}
_LAYER_NAME = re.compile(r"(model\.layers\.\d+\.)(.+)\.weight")


def weight_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The weights LlamaModel takes, HF names -> numpy shapes ((out, in) for matrices).

    Expert weights appear stacked (see MOE_ALIASES); LlamaModel also takes
    them per expert under HF Mixtral's or Qwen2-MoE's names. "lm_head.weight" may be left out (tied to the
    embedding), and "rope_freqs.weight" (GGUF's name, head_dim/2 f32) may be
    given in place of cfg.rope_freq_factors.
    """
    h, kv, f, e = cfg.hidden, cfg.kv_dim, cfg.ffn, cfg.experts
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab, h)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (h, h),
                   p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                   p + "self_attn.o_proj.weight": (h, h), p + "post_attention_layernorm.weight": (h,)}
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
        m = _LAYER_NAME.fullmatch(name)
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


def window_for(cfg: LlamaConfig, n_end: int) -> int:
    """Cache positions attention reads when the last token sits at n_end - 1: a multiple of 256, or max_ctx."""
    return min(cfg.max_ctx, -(-n_end // WINDOW_STEP) * WINDOW_STEP)


@attrs.frozen
class StepInputs:
    """The inputs of one step's graph: `batch` sequences of n tokens each, sequence b in cache region
    first_seq + b (rows (first_seq + b) * max_ctx ..); `feeds` / `feeds_batch` fill them."""

    tokens: Tensor | None  # i32 (B * n,): sequence b's tokens at b * n ..; None: greedy steps read next_tokens
    pos: Tensor  # i32 (B * n,)
    kv_idx: Tensor  # i64 (B * n,): cache rows written, (first_seq + b) * max_ctx + position
    mask: Tensor  # f16 (B, 1, n, window): per sequence, 0 up to each token's position, -inf beyond
    first_seq: int = 0
    max_ctx: int = 0  # cache rows per sequence

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    def feeds(self, token_ids: Sequence[int], n_past: int) -> dict[Tensor, np.ndarray]:
        """One sequence (batch 1): token_ids at positions n_past.."""
        return self.feeds_batch([token_ids], [n_past])

    def feeds_batch(self, token_ids: Sequence[Sequence[int]] | None,
                    n_past: Sequence[int]) -> dict[Tensor, np.ndarray]:
        """Sequence b's tokens token_ids[b] (each of the step's n) at positions n_past[b]..
        (token_ids None for a greedy step, whose tokens are on the device).

        Fresh arrays every call (a caller may keep them); the mask rows are cut from a precomputed
        staircase (`_mask_rows`), so a decode step's inputs cost a few small numpy calls.
        """
        b_, n, window = self._dims
        if (token_ids is None) != (self.tokens is None):
            raise ValueError("llama step: token ids are given for a greedy step (or missing for another)")
        if len(n_past) != b_ or (token_ids is not None and (len(token_ids) != b_
                                                            or any(len(t) != n for t in token_ids))):
            got = "no" if token_ids is None else [len(t) for t in token_ids]
            raise ValueError(f"llama step built for {b_} sequence(s) of {n} tokens, got "
                             f"{got} tokens at {len(n_past)} position(s)")
        # Python ints: a decode step has B positions, and numpy's per-call cost dominates at that size
        positions = [int(p) for p in n_past] if n == 1 else [int(p) + i for p in n_past for i in range(n)]
        lo, hi = min(positions), max(positions)
        if lo < 0 or hi >= window:
            raise ValueError(f"llama step: positions {lo}..{hi} outside its window of {window}")
        pos = np.array(positions, np.int32)
        # mask row of a token at position p: staircase row window - 1 - p (0 up to p, -inf beyond)
        if len(positions) == 1:
            mask = self._mask_rows[window - 1 - lo].reshape(1, 1, 1, window).copy()
        else:
            mask = self._mask_rows[(window - 1) - pos].reshape(b_, 1, n, window)
        feeds = {
            self.pos: pos,
            self.kv_idx: np.array([r + p for r, p in zip(self._row_base, positions)], np.int64),
            self.mask: mask,
        }
        if self.tokens is not None:
            feeds[self.tokens] = np.array(token_ids, np.int32).reshape(-1)
        return feeds

    @property
    def _dims(self) -> tuple[int, int, int]:
        return self.mask.shape[0], self.mask.shape[2], self.mask.shape[-1]

    @functools.cached_property
    def _row_base(self) -> list[int]:
        """Cache row of position 0 of each of the step's B * n rows: (first_seq + b) * max_ctx."""
        b_, n, _ = self._dims
        return [(self.first_seq + b) * self.max_ctx for b in range(b_) for _ in range(n)]

    @functools.cached_property
    def _mask_rows(self) -> np.ndarray:
        """(window, window) f16: row r is 0 for columns <= window - 1 - r, -inf beyond (read-only)."""
        window = self.mask.shape[-1]
        stair = np.full(2 * window - 1, -np.inf, np.float16)
        stair[:window] = 0
        rows = np.lib.stride_tricks.sliding_window_view(stair, window)  # row r = stair[r:r + window]
        return rows


@attrs.define(eq=False)
class _Layer:
    attn_norm: Tensor
    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor
    ffn_norm: Tensor
    w_gate: Tensor  # (ffn, hidden), or (experts, ffn, hidden) stacked
    w_up: Tensor
    w_down: Tensor
    router: Tensor | None  # (experts, hidden); None for a dense MLP
    k_cache: Tensor
    v_cache: Tensor
    #: wq, wk, wv stacked row-wise, (hidden + 2 kv_dim, hidden): one mat-vec a layer; None where they
    #: cannot be stacked (different dtypes, no data), and the graph uses the three
    wqkv: Tensor | None = None


#: names a checkpoint may carry that the graph does not need
_UNUSED = ("rotary_emb.inv_freq",)


class LlamaModel:
    """Weights as params and the KV cache as states.

    `weights` maps HF names (see weight_shapes) to float arrays, converted to
    cfg.dtype (norm weights and the MoE router stay f32, as llama.cpp keeps
    them), or to opdispatch params (e.g. GGUF blocks from a loader), used as
    they are. Expert weights come stacked or one per expert (MOE_ALIASES).
    Without "lm_head.weight" the LM head is the embedding (tied).
    A missing weight, a wrong shape or a weight the model would not use
    raises ValueError naming it.

    The KV cache holds max_seqs sequences: per layer a K and a V state of
    (max_seqs * max_ctx, kv_dim) rows, sequence s in rows s * max_ctx .. .

    stack_qkv: each layer's q_proj, k_proj and v_proj are also stacked row-wise
    into one (hidden + 2 kv_dim, hidden) param (float weights concatenated,
    block formats by their bytes: rows are independent), so a step runs one
    projection a layer instead of three and q, k, v are free views of its
    output; where the three differ in dtype they stay apart. On by default:
    two launches fewer a layer, and one larger mat-vec runs closer to the
    bandwidth than three small ones. The graph reads only the stack.
    """

    def __init__(self, cfg: LlamaConfig, weights: Mapping[str, np.ndarray | Tensor], *, max_seqs: int = 1,
                 stack_qkv: bool = True) -> None:
        if max_seqs < 1:
            raise ValueError(f"llama: max_seqs must be >= 1, got {max_seqs}")
        self.cfg = cfg
        self.max_seqs = max_seqs
        self.stack_qkv = stack_qkv
        given = dict(weights)
        self.params: dict[str, Tensor] = {}
        missing = []
        for name, shape in weight_shapes(cfg).items():
            t = self._take(given, name, shape)
            if t is not None:
                self.params[name] = t
            elif name != "lm_head.weight":
                missing.append(name)
        rope_freqs = given.pop("rope_freqs.weight", None)
        unused = [n for n in given if not n.endswith(_UNUSED)]
        if missing or unused:
            raise ValueError("llama: " + "; ".join(
                f"{what} ({len(names)}): {', '.join(names[:6])}{', ...' if len(names) > 6 else ''}"
                for what, names in (("missing weights", missing), ("weights this model does not use", unused))
                if names))
        if rope_freqs is None and cfg.rope_freq_factors is not None:
            rope_freqs = np.asarray(cfg.rope_freq_factors, np.float32)
        self.rope_freqs = None if rope_freqs is None else self._param("rope_freqs.weight", rope_freqs,
                                                                       (cfg.head_dim // 2,))
        self.layers = [self._layer(i) for i in range(cfg.layers)]
        self.embed = self.params["model.embed_tokens.weight"]
        self.norm = self.params["model.norm.weight"]
        self.lm_head = self.params.get("lm_head.weight", self.embed)
        # Greedy decode on the device (build(greedy=True)): each sequence's next token, which the next
        # step embeds; the same as f32 (set_rows writes f32 rows); and every token picked, in the row of
        # the position it follows (the KV-cache row numbering), for the host to read once at the end.
        self.next_tokens = state("sample.next", (max_seqs,), "i32")
        self.next_f32 = state("sample.next_f32", (max_seqs, 1), "f32")
        self.token_log = state("sample.log", (max_seqs * cfg.max_ctx, 1), "f32")

    def _take(self, given: dict[str, Any], name: str, shape: tuple[int, ...]) -> Tensor | None:
        """The weight `name` from `given` (popped), under its own name or an alias of MOE_ALIASES; None if absent."""
        if name in given:
            return self._param(name, given.pop(name), shape)
        m = _LAYER_NAME.fullmatch(name)
        for alias in MOE_ALIASES.get(m.group(2), ()) if m else ():
            parts = [f"{m.group(1)}{alias.format(e=e)}.weight" for e in range(shape[0] if "{e}" in alias else 1)]
            if all(p in given for p in parts):
                if "{e}" not in alias:
                    return self._param(name, given.pop(parts[0]), shape)
                return self._stack(name, [given.pop(p) for p in parts], shape)
        return None

    def _param(self, name: str, w: np.ndarray | Tensor, shape: tuple[int, ...]) -> Tensor:
        """A param as it is, or a float array in cfg.dtype (norms and the router in f32); its shape checked."""
        if isinstance(w, Tensor) and not w.flags & Flag.PARAM:
            raise ValueError(f"llama: weight {name} is {w.describe()}, not a param")
        w = w if isinstance(w, Tensor) else np.asarray(w)
        if w.shape != shape:
            raise ValueError(f"llama: weight {name} has shape {w.shape}, expected {shape}")
        if isinstance(w, Tensor):
            return w
        keep_f32 = w.ndim == 1 or name.endswith(".mlp.gate.weight")
        return param(name, w, "f32" if keep_f32 else self.cfg.dtype)

    def _stack(self, name: str, parts: list[np.ndarray | Tensor], shape: tuple[int, ...]) -> Tensor:
        """Experts given one by one -> one (E, out, in) param: float arrays stacked, params' blocks concatenated."""
        if not any(isinstance(p, Tensor) for p in parts):
            return self._param(name, np.stack([np.asarray(p) for p in parts]), shape)
        first = parts[0]
        if not all(isinstance(p, Tensor) and p.flags & Flag.PARAM and p.data is not None and p.is_contiguous()
                   and p.dtype == first.dtype and p.shape == shape[1:] for p in parts):
            raise ValueError(f"llama: the experts of {name} must all be float arrays, or contiguous params of one "
                             f"dtype and shape {shape[1:]}")
        return param(name, np.concatenate([p.data for p in parts]), first.dtype, shape=shape)

    def _layer(self, i: int) -> _Layer:
        cfg, p = self.cfg, f"model.layers.{i}."
        w = {name[len(p):-len(".weight")]: t for name, t in self.params.items() if name.startswith(p)}
        mlp = ([w["mlp.experts.gate_proj"], w["mlp.experts.up_proj"], w["mlp.experts.down_proj"], w["mlp.gate"]]
               if cfg.experts else [w["mlp.gate_proj"], w["mlp.up_proj"], w["mlp.down_proj"], None])
        wq, wk, wv = w["self_attn.q_proj"], w["self_attn.k_proj"], w["self_attn.v_proj"]
        return _Layer(w["input_layernorm"], wq, wk, wv, w["self_attn.o_proj"], w["post_attention_layernorm"], *mlp,
                      state(f"cache.k.{i}", (self.max_seqs * cfg.max_ctx, cfg.kv_dim), cfg.cache_dtype),
                      state(f"cache.v.{i}", (self.max_seqs * cfg.max_ctx, cfg.kv_dim), cfg.cache_dtype),
                      _stack_rows(f"{p}self_attn.qkv_proj.weight", (wq, wk, wv)) if self.stack_qkv else None)

    @property
    def states(self) -> list[Tensor]:
        return [c for layer in self.layers for c in (layer.k_cache, layer.v_cache)]

    def build(self, n_tokens: int, n_past: int, *, batch: int = 1, first_seq: int = 0,
              logits: str = "all", greedy: bool = False) -> tuple[list[Tensor], StepInputs]:
        """The graph of one step: `batch` sequences (cache regions first_seq ..) of n_tokens tokens each,
        the furthest of them starting at position n_past -> [logits f32 (batch * n_tokens, vocab)],
        sequence b's rows at b * n_tokens ..; logits="last": (batch, vocab), each sequence's last token.

        Decode of several sequences (n_tokens 1) is one graph: their rows go through the projections and
        the MLP together, each writes its K/V rows into its own cache region (set_rows at rows from
        StepInputs.kv_idx), and flash_attn_ext reads the regions through its batch axis (q (B, heads, n,
        head_dim), K/V views (B, kv_heads, window, head_dim) of the cache, a stride of max_ctx rows
        between sequences) with a mask per sequence (B, 1, n, window): flash_attn_ext takes a mask with a
        batch axis (broadcast by modulo, OPS.md), so sequences at different positions share the step.
        The window (cache positions read) is window_for(n_past + n_tokens), the same for all of them.

        greedy (decode only, n_tokens 1): the step picks each sequence's next token on the device: it
        embeds the tokens in `next_tokens` (no token input: StepInputs.tokens is None), and instead of the
        logits it returns [next_tokens, token_log] updated: argmax of each sequence's logits (ties: the
        last index, ggml's argmax) into next_tokens and into token_log at its kv_idx row. Steps chained
        this way need no host work between them but the next positions (Plan.submit).
        """
        cfg = self.cfg
        n, hd, b_ = n_tokens, cfg.head_dim, batch
        if n < 1 or n_past < 0 or n_past + n > cfg.max_ctx:
            raise ValueError(f"llama: {n} tokens after {n_past} do not fit max_ctx {cfg.max_ctx}")
        if b_ < 1 or first_seq < 0 or first_seq + b_ > self.max_seqs:
            raise ValueError(f"llama: sequences {first_seq}..{first_seq + b_ - 1} do not fit the cache of "
                             f"max_seqs {self.max_seqs}")
        if logits not in ("all", "last"):
            raise ValueError(f"llama: logits must be 'all' or 'last', got {logits!r}")
        if greedy and n != 1:
            raise ValueError(f"llama: greedy steps decode one token per sequence, got {n}")
        window = window_for(cfg, n_past + n)
        rows = b_ * n
        next_tokens = self.next_tokens.view((b_,), (4,), 4 * first_seq)
        inp = StepInputs(None if greedy else input("tokens", (rows,), "i32"), input("pos", (rows,), "i32"),
                         input("kv_idx", (rows,), "i64"), input("kq_mask", (b_, 1, n, window), "f16"),
                         first_seq, cfg.max_ctx)
        x = ops.get_rows(self.embed, next_tokens if greedy else inp.tokens)  # (B * n, hidden)
        for layer in self.layers:
            h = ops.mul(ops.rms_norm(x, cfg.rms_eps), layer.attn_norm)
            # RoPE sees the B * n rows as one run of tokens (a position each), then q splits by sequence.
            if layer.wqkv is not None:  # one projection; q, k, v are column ranges of its rows (free views)
                qkv = ops.mul_mat(layer.wqkv, h)  # (B * n, hidden + 2 kv_dim)
                rs, es = qkv.strides
                q = qkv.view((1, rows, cfg.heads, hd), (rows * rs, rs, hd * es, es))
                k = qkv.view((1, rows, cfg.kv_heads, hd), (rows * rs, rs, hd * es, es), cfg.hidden * es)
                v = qkv.view((rows, cfg.kv_dim), (rs, es), (cfg.hidden + cfg.kv_dim) * es)
            else:
                q = ops.mul_mat(layer.wq, h).reshape(1, rows, cfg.heads, hd)
                k = ops.mul_mat(layer.wk, h).reshape(1, rows, cfg.kv_heads, hd)
                v = ops.mul_mat(layer.wv, h)  # (B * n, kv_dim)
            q, k = self._rope(q, inp.pos), self._rope(k, inp.pos)
            # Read the cache through set_rows' result: the write is ordered before the read.
            keys = self._window(ops.set_rows(layer.k_cache, k.reshape(rows, cfg.kv_dim), inp.kv_idx), window,
                                b_, first_seq)
            values = self._window(ops.set_rows(layer.v_cache, v, inp.kv_idx), window, b_, first_seq)
            q = q.reshape(b_, n, cfg.heads, hd).permute(0, 2, 1, 3)  # (B, heads, n, hd)
            attn = ops.flash_attn_ext(q, keys, values, inp.mask, scale=hd ** -0.5)  # (B, n, heads, hd)
            x = ops.add(x, ops.mul_mat(layer.wo, attn.reshape(rows, cfg.hidden)))
            h = ops.mul(ops.rms_norm(x, cfg.rms_eps), layer.ffn_norm)
            if layer.router is None:
                gated = ops.glu_split(ops.mul_mat(layer.w_gate, h), ops.mul_mat(layer.w_up, h), "swiglu")
                x = ops.add(x, ops.mul_mat(layer.w_down, gated))
            else:
                x = self._moe(layer, h, x)
        if logits == "last" and n > 1:  # each sequence's last row, a strided view: the LM head reads B rows
            x = x.view((b_, cfg.hidden), (n * x.strides[0], x.strides[1]), (n - 1) * x.strides[0])
        out = ops.mul_mat(self.lm_head, ops.mul(ops.rms_norm(x, cfg.rms_eps), self.norm))
        if not greedy:
            return [out], inp
        picked = ops.argmax(out)  # (B,) i32
        as_f32 = ops.cpy(picked, self.next_f32.view((b_, 1), (4, 4), 4 * first_seq))
        return [ops.cpy(picked, next_tokens), ops.set_rows(self.token_log, as_f32, inp.kv_idx)], inp

    def _moe(self, layer: _Layer, h: Tensor, residual: Tensor) -> Tensor:
        """residual + the mixture of experts on h (n, hidden), as llama.cpp's build_moe_ffn.

        Execution order is Graph.build's depth-first walk, sources in order.
        The routing weights are the first source of the node that weights the
        experts, so the whole router runs before the experts, its nodes
        consecutive as ggml's top-k MoE fusion matches them: soft_max,
        reshape, top_k, get_rows[, reshape, sum_rows, div]. That needs them
        broadcast over the hidden axis as mul's first operand (a stride-0
        view, free). The experts' mul_mat_id read top_k's ids from outside
        the group: the fused rule declares them an extra output (ggml's fused
        kernel writes them too). The k weighted experts are summed by a chain of adds
        ending with the residual: with k = 2 all its adds are consecutive
        (multi-add fusion); with k > 2 each expert's view comes between two
        adds, as no order hint (ggml_build_forward_expand) exists here.
        """
        cfg = self.cfg
        n, e, k, hidden = h.shape[0], cfg.experts, cfg.experts_used, cfg.hidden
        probs = ops.soft_max(ops.mul_mat(layer.router, h))  # (n, E)
        ids = ops.top_k(probs, k)  # (n, k) i32
        weights = ops.get_rows(probs.reshape(n, e, 1), ids)  # (n, k, 1): the selected probabilities
        if cfg.norm_topk:
            flat = weights.reshape(n, k)
            weights = ops.div(flat, ops.sum_rows(flat))  # (n, k)
        spread = weights.view((n, k, hidden), (weights.strides[0], weights.strides[1], 0))
        x = h.reshape(n, 1, hidden)
        gated = ops.glu_split(ops.mul_mat_id(layer.w_gate, x, ids), ops.mul_mat_id(layer.w_up, x, ids), "swiglu")
        weighted = ops.mul(spread, ops.mul_mat_id(layer.w_down, gated, ids))  # (n, k, hidden)
        row = weighted.strides[0]
        per_expert = [weighted.view((n, hidden), (row, weighted.strides[2]), j * weighted.strides[1])
                      for j in range(k)]
        out = per_expert[0]
        for t in per_expert[1:]:
            out = ops.add(out, t)
        return ops.add(out, residual)

    def _rope(self, x: Tensor, pos: Tensor) -> Tensor:
        cfg = self.cfg
        return ops.rope(x, pos, cfg.head_dim, cfg.rope_mode, freq_base=cfg.rope_base,
                        freq_scale=cfg.rope_freq_scale, freq_factors=self.rope_freqs)

    def _window(self, cache: Tensor, window: int, batch: int = 1, first_seq: int = 0) -> Tensor:
        """The first `window` rows of sequences first_seq.. as (batch, kv_heads, window, head_dim), a strided
        view of the cache (max_ctx rows between sequences)."""
        row = cache.strides[0]
        head = cache.dtype.row_bytes(self.cfg.head_dim)
        region = self.cfg.max_ctx * row
        shape = (batch, self.cfg.kv_heads, window, self.cfg.head_dim)
        return cache.view(shape, (region, head, row, cache.dtype.block_bytes), first_seq * region)


def _stack_rows(name: str, parts: Sequence[Tensor]) -> Tensor | None:
    """Params of one dtype and row length stacked along their rows into one param (their stored bytes
    concatenated: rows are independent in every format, blocks included); None where that cannot be."""
    first = parts[0]
    if not all(p.flags & Flag.PARAM and p.data is not None and p.ndim == 2 and p.is_contiguous()
               and p.dtype == first.dtype and p.shape[1] == first.shape[1] for p in parts):
        return None
    shape = (sum(p.shape[0] for p in parts), first.shape[1])
    return param(name, np.concatenate([np.asarray(p.data).reshape(-1) for p in parts]), first.dtype, shape=shape)


# -- sampling and progress ------------------------------------------------------------

SAMPLING = ("greedy", "top-k", "top-p")


@attrs.define
class Sampler:
    """Picks each next token from a row of logits, on the host, with a seeded numpy RNG.

    greedy: the argmax (the first of equal maxima here; Generator.generate
    picks greedy decode tokens on the device instead, where ggml's argmax
    takes the last of equal maxima). top-k: the top_k largest
    logits, drawn by softmax(logits / temperature) over them (top_k = 1 is
    greedy). top-p (nucleus): softmax(logits / temperature), then the most
    probable tokens until their probability reaches top_p (at least one
    token), renormalized. Only the parameters of `method` are checked and
    used. `reset` restarts the RNG from `seed`; Generator.generate
    does at the start of every sequence, so a seed repeats a generation.
    """

    method: str = attrs.field(default="greedy", validator=attrs.validators.in_(SAMPLING))
    top_k: int = 40
    top_p: float = 0.9
    temperature: float = 1.0
    seed: int = 0
    _rng: np.random.Generator = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        bad = [why for uses, ok, why in (
            ("top-k", self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}"),
            ("top-p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top-k top-p", self.temperature > 0,
             f"temperature must be > 0 (greedy is its own method), got {self.temperature}"),
        ) if self.method in uses.split() and not ok]
        if bad:
            raise ValueError("sampler: " + "; ".join(bad))
        self.reset()

    def reset(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        """Picks the argmax (Generator.generate then picks on the device)."""
        return self.method == "greedy" or (self.method == "top-k" and self.top_k == 1)

    def describe(self) -> str:
        if self.method == "greedy":
            return "greedy"
        cut = f"k {self.top_k}" if self.method == "top-k" else f"p {self.top_p:g}"
        return f"{self.method} ({cut}, temperature {self.temperature:g}, seed {self.seed})"

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, their probabilities summing to 1) that the next draw picks from, most probable first.

        Whole-vocabulary work stays in the logits' own float type (f32 from a
        model: a few hundred microseconds for 32000 tokens) and sorts only a
        top-m that holds the candidates; their probabilities are float64.
        """
        z = np.asarray(logits).reshape(-1)
        if z.dtype not in (np.float32, np.float64):
            z = z.astype(np.float64)
        if self.greedy:
            return np.array([int(np.argmax(z))]), np.ones(1)
        if self.method == "top-k":
            ids = _largest(z, self.top_k)
        else:
            w = np.exp((z - z.max()) / z.dtype.type(self.temperature))
            total = w.sum(dtype=np.float64)
            m = 64
            while True:  # the nucleus is a prefix of the sorted order: find a top-m that holds it
                ids = _largest(z, m)
                if m >= z.size or w[ids].sum(dtype=np.float64) >= self.top_p * total:
                    break
                m *= 8
        x = z[ids].astype(np.float64) / self.temperature
        q = np.exp(x - x[0])  # ids[0] holds the largest logit
        if self.method == "top-p":
            q /= total
            before = np.cumsum(q) - q  # probability of the tokens ranked above each
            ids, q = ids[before < self.top_p], q[before < self.top_p]
        return ids, q / q.sum()

    def __call__(self, logits: np.ndarray) -> int:
        ids, p = self.candidates(logits)
        if ids.size == 1:
            return int(ids[0])
        c = np.cumsum(p)
        return int(ids[min(int(np.searchsorted(c, self._rng.random() * c[-1], side="right")), ids.size - 1)])


def _largest(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties: lower index first; at the k-th value, any)."""
    idx = np.argpartition(x, x.size - k)[x.size - k:] if k < x.size else np.arange(x.size)
    return idx[np.lexsort((idx, -x[idx]))]


class Progress:
    """Tokens generated so far: a bar redrawn with \\r on a terminal, else one summary line at the end."""

    def __init__(self, stream: TextIO | None, total: int, every_s: float = 0.1) -> None:
        self.stream, self.total, self.every_s = stream, total, every_s
        self.tty = stream is not None and hasattr(stream, "isatty") and stream.isatty()
        self.t0 = time.perf_counter()
        self.shown = -math.inf

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if self.tty and (now - self.shown >= self.every_s or done == self.total):
            self.shown = now
            width = 30
            bar = "#" * (width * done // self.total) + "-" * (width - width * done // self.total)
            self.stream.write(f"\r{bar} {done}/{self.total} tokens, {self._rate(done, now):.1f} tokens/s")
            self.stream.flush()

    def close(self, done: int) -> None:
        if self.stream is None:
            return
        now = time.perf_counter()
        if self.tty:
            self.update(done)
            self.stream.write("\n")
        else:
            self.stream.write(f"generated {done}/{self.total} tokens in {now - self.t0:.3f} s, "
                              f"{self._rate(done, now):.1f} tokens/s (wall clock, with prefill and sampling)\n")
        self.stream.flush()

    def _rate(self, done: int, now: float) -> float:
        return done / (now - self.t0) if now > self.t0 else math.nan


@attrs.frozen(kw_only=True)
class _Timing:
    """Where a generation's time went (first runs, which bind, are left out; so is sampling)."""

    compile_s: float
    prefill_s: float
    decode_s: float
    decode_steps: int
    prefill_plan: Plan
    decode_plan: Plan | None
    sampling: str


@attrs.frozen(kw_only=True)
class Generation(_Timing):
    """What Generator.generate made: the prompt, its new tokens, and the timing."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def prefill_tps(self) -> float:
        return len(self.prompt) / self.prefill_s if self.prefill_s > 0 else math.nan

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else math.nan


@attrs.frozen(kw_only=True)
class BatchGeneration(_Timing):
    """What Generator.generate_batch made: per sequence its prompt and new tokens, and the shared timing."""

    prompts: tuple[tuple[int, ...], ...]
    tokens: tuple[tuple[int, ...], ...]

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens per second (padding not counted)."""
        return sum(map(len, self.prompts)) / self.prefill_s if self.prefill_s > 0 else math.nan

    @property
    def decode_tps(self) -> float:
        """Tokens per second over all sequences: a step makes one per sequence."""
        return len(self.tokens) * self.decode_steps / self.decode_s if self.decode_s > 0 else math.nan


class Generator:
    """Runs a LlamaModel on one device: one compiled plan per step shape, and each sequence's cache position.

    `batch` sequences (at most the model's max_seqs) can step together:
    sequence b lives in cache region b. `forward` and `generate` run
    sequence 0 alone (one-sequence plans); `forward_batch` and
    `generate_batch` run all `batch` of them in one graph per step.
    Each plan is compiled once (per token count, attention window and
    batch). The first run of a plan binds it (buffers, weight upload,
    kernels) and is repeated untimed: a step rerun with the same inputs
    rewrites the same cache rows with the same values.
    """

    def __init__(self, model: LlamaModel, device: str | Device | None = None, *, fusion: bool | None = None,
                 batch: int = 1) -> None:
        if not 1 <= batch <= model.max_seqs:
            raise ValueError(f"llama: batch {batch} must be in 1..max_seqs of the model ({model.max_seqs}): "
                             "LlamaModel(..., max_seqs=N) sizes the KV cache")
        self.model = model
        self.device = manager().device(device)
        self.fusion = fusion
        self.batch = batch
        #: cache positions filled, per sequence
        self.lengths = [0] * batch
        self.compile_s = 0.0
        self.last_run_s = 0.0
        self._steps: dict[tuple[int, int, int, str], tuple[Plan, StepInputs]] = {}
        self._bound: set[Plan] = set()
        self._last: Plan | None = None

    @property
    def n_past(self) -> int:
        """Sequence 0's position (the one `forward` and `generate` use)."""
        return self.lengths[0]

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.lengths[0] = value

    def reset(self) -> None:
        """Start new sequences (the cache rows past a position are masked, not cleared)."""
        self.lengths = [0] * self.batch

    def step(self, n_tokens: int, n_past: int, *, batch: int = 1, logits: str = "all",
             greedy: bool = False) -> tuple[Plan, StepInputs]:
        """The compiled plan for `batch` sequences (0..) of n_tokens tokens, the furthest at n_past
        (compiled on first use); greedy: LlamaModel.build's greedy decode step."""
        key = (n_tokens, window_for(self.model.cfg, n_past + n_tokens), batch, "all" if n_tokens == 1 else logits,
               greedy)
        if key not in self._steps:
            t0 = time.perf_counter()
            outputs, inp = self.model.build(n_tokens, n_past, batch=batch, logits=key[3], greedy=greedy)
            self._steps[key] = (compile(outputs, self.device, fusion=self.fusion), inp)
            self.compile_s += time.perf_counter() - t0
        return self._steps[key]

    def decode_greedy(self, first: Sequence[int], n_steps: int, progress: Progress | None = None) -> list[list[int]]:
        """n_steps greedy decode steps of sequences 0..len(first) - 1 from their current positions,
        sequence b starting from token first[b]: each step's tokens are the previous step's argmax,
        picked on the device (LlamaModel.build(greedy=True)), and the steps are queued without waiting
        (Plan.submit), so the host prepares step i + 1 while the device runs step i. Returns each
        sequence's n_steps new tokens, read once at the end; advances each sequence by n_steps.
        """
        model, batch = self.model, len(first)
        vocab = model.cfg.vocab
        if not 1 <= batch <= self.batch or any(not 0 <= t < vocab for t in first):
            raise ValueError(f"decode_greedy: needs 1..{self.batch} first tokens in [0, {vocab}), got {list(first)}")
        start = self.lengths[:batch]
        if max(start) + n_steps > model.cfg.max_ctx:
            raise ValueError(f"decode_greedy: {n_steps} steps after position {max(start)} do not fit max_ctx "
                             f"{model.cfg.max_ctx}")
        plan: Plan | None = None
        t0 = time.perf_counter()
        compile_before = self.compile_s
        # Compiling a step's plan (a new attention window) and binding it (buffers, kernels loaded, graph
        # captured: done by its first write) are not decoding: left out of last_run_s.
        bind_s = 0.0
        for i in range(n_steps):
            nxt, inp = self.step(1, max(self.lengths[:batch]), batch=batch, greedy=True)
            if nxt is not plan:
                tokens = first if plan is None else self._read_next(plan, batch)
                plan = nxt
                b0 = time.perf_counter()
                bound = plan in self._bound
                self._write_next(plan, tokens)
                if not bound:  # binding runs the step: the same token at the same position, then the token again
                    self._bind(plan, inp.feeds_batch(None, self.lengths[:batch]))
                    self._write_next(plan, tokens)
                    bind_s += time.perf_counter() - b0
            plan.submit(inp.feeds_batch(None, self.lengths[:batch]))
            for b in range(batch):
                self.lengths[b] += 1
            if progress is not None:
                progress.update((i + 1) * batch)
        self._last = plan
        if plan is None:
            return [[] for _ in first]
        log = plan.read(model.token_log).reshape(-1)
        self.last_run_s = time.perf_counter() - t0 - bind_s - (self.compile_s - compile_before)
        rows = [b * model.cfg.max_ctx + start[b] for b in range(batch)]
        return [[int(log[r + i]) for i in range(n_steps)] for r in rows]

    def _bind(self, plan: Plan, feeds: Mapping[Tensor, Any]) -> None:
        """Run a step's plan twice on `feeds`, outside any timing: the first run binds it (kernels
        loaded, launches direct), the second captures its CUDA graph (graphs.GraphRunner); both
        write the same cache rows the timed run then writes again."""
        for _ in range(2):
            plan.run(feeds)
        self._bound.add(plan)

    def _write_next(self, plan: Plan, tokens: Sequence[int]) -> None:
        """Sequences 0..len(tokens) - 1's next tokens into the model's next_tokens state."""
        values = np.zeros(self.model.max_seqs, np.int32)
        values[:len(tokens)] = tokens
        plan.write(self.model.next_tokens, values)

    def _read_next(self, plan: Plan, batch: int) -> list[int]:
        return [int(t) for t in plan.read(self.model.next_tokens)[:batch]]

    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits f32 (len(token_ids), vocab) for tokens of sequence 0 at its next positions; advances it."""
        return self._run([token_ids], batch=1)

    def forward_batch(self, token_ids: Sequence[Sequence[int]], *, last: bool = False) -> np.ndarray:
        """Every sequence's next tokens in one step: logits f32 (batch, n, vocab), n the longest of
        token_ids; with `last`, (batch, vocab): each sequence's last token only (the LM head runs on
        those alone when all have the same length). Advances each sequence by its own tokens.

        Sequences may get different numbers of tokens: shorter ones are padded, the padding written to
        cache rows past the sequence's end, which are masked until its next tokens overwrite them; their
        logits rows past its length are padding.
        """
        if len(token_ids) != self.batch:
            raise ValueError(f"llama: forward_batch needs tokens for each of the {self.batch} sequences, "
                             f"got {len(token_ids)}")
        return self._forward_seqs(token_ids, last=last)

    def _forward_seqs(self, token_ids: Sequence[Sequence[int]], *, last: bool) -> np.ndarray:
        """forward_batch for sequences 0..len(token_ids) - 1."""
        batch, lens = len(token_ids), [len(t) for t in token_ids]
        if min(lens) < 1:
            raise ValueError("llama: forward_batch needs at least one token per sequence")
        n = max(lens)
        padded = [list(t) + [0] * (n - len(t)) for t in token_ids]
        same = min(lens) == n
        out = self._run(padded, batch=batch, logits="last" if last and same else "all", advance=lens)
        if not last:
            return out.reshape(batch, n, -1)
        if same:
            return out
        return out.reshape(batch, n, -1)[np.arange(batch), np.array(lens) - 1]

    def _run(self, token_ids: Sequence[Sequence[int]], *, batch: int, logits: str = "all",
             advance: Sequence[int] | None = None, copy: bool = True) -> np.ndarray:
        """One step of sequences 0..batch-1 (token_ids[b] each, all of one length); advances sequence b
        by advance[b] (default: its token count). copy=False: the logits are a view that the next run of
        the same plan overwrites (see Plan.run)."""
        vocab = self.model.cfg.vocab
        bad = [t for ids in token_ids for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"llama: token ids {bad[:5]} outside the vocabulary of {vocab}")
        n = len(token_ids[0])
        n_past = self.lengths[:batch]
        plan, inp = self.step(n, max(n_past), batch=batch, logits=logits)
        feeds = inp.feeds_batch(token_ids, n_past)
        self._last = plan
        if plan not in self._bound:
            self._bind(plan, feeds)
        t0 = time.perf_counter()
        (out,) = plan.run(feeds, copy=copy)
        self.last_run_s = time.perf_counter() - t0
        for b in range(batch):
            self.lengths[b] += n if advance is None else advance[b]
        return out

    def generate(self, prompt_ids: Sequence[int], n_new: int, sampler: Sampler | None = None, *,
                 progress: TextIO | None = None) -> Generation:
        """Continue `prompt_ids` (as sequence 0) by n_new tokens: prefill, then one decode step per token.

        `sampler` (default greedy) picks each token from the last logits on
        the host, starting from its seed, so a seed repeats the tokens.
        `progress`: a stream for a progress bar (a terminal) or a summary line.
        """
        if not prompt_ids or n_new < 1:
            raise ValueError("generate: needs a non-empty prompt and n_new >= 1")
        (tokens,), timing = self._generate([prompt_ids], n_new, sampler, progress)
        return Generation(prompt=tuple(int(t) for t in prompt_ids), tokens=tokens, **timing)

    def generate_batch(self, prompts: Sequence[Sequence[int]], n_new: int, sampler: Sampler | None = None, *,
                       progress: TextIO | None = None) -> BatchGeneration:
        """Continue each of `batch` prompts by n_new tokens: one prefill step for all (padded to the longest
        prompt, see forward_batch), then decode steps that make one token per sequence each.

        Each sequence samples with its own copy of `sampler` (at its seed), so sequence b gets the
        tokens `generate(prompts[b], n_new, sampler)` would.
        """
        if len(prompts) != self.batch or not all(prompts) or n_new < 1:
            raise ValueError(f"generate_batch: needs {self.batch} non-empty prompts and n_new >= 1")
        tokens, timing = self._generate(prompts, n_new, sampler, progress)
        return BatchGeneration(prompts=tuple(tuple(int(t) for t in p) for p in prompts), tokens=tokens, **timing)

    def _generate(self, prompts: Sequence[Sequence[int]], n_new: int, sampler: Sampler | None,
                  progress: TextIO | None) -> tuple[tuple[tuple[int, ...], ...], dict[str, Any]]:
        """generate_batch for sequences 0..len(prompts) - 1: their new tokens, and _Timing's fields."""
        batch = len(prompts)
        sampler = sampler if sampler is not None else Sampler()
        samplers = [attrs.evolve(sampler) for _ in prompts]  # each starts at the seed
        self.reset()
        compile_before = self.compile_s
        lens = [len(p) for p in prompts]
        # The prompts' last logits only (the LM head on their last rows) when they are of one length.
        prefill_plan = self.step(max(lens), 0, batch=batch, logits="last" if min(lens) == max(lens) else "all")[0]
        if n_new > 1:
            self.step(1, max(lens), batch=batch, greedy=sampler.greedy)
        bar = Progress(progress, n_new * batch)
        last = self._forward_seqs(prompts, last=True)  # (batch, vocab)
        prefill_s = self.last_run_s
        tokens = [[s(row)] for s, row in zip(samplers, last)]
        bar.update(batch)
        decode_s = 0.0
        if sampler.greedy:
            if n_new > 1:
                for t, more in zip(tokens, self.decode_greedy([t[0] for t in tokens], n_new - 1, bar)):
                    t.extend(more)
                decode_s = self.last_run_s
        else:
            for _ in range(n_new - 1):
                # A view, sampled before its plan runs again.
                logits = self._run([t[-1:] for t in tokens], batch=batch, copy=False)  # (batch, vocab)
                decode_s += self.last_run_s
                for t, s, row in zip(tokens, samplers, logits):
                    t.append(s(row))
                bar.update(len(tokens[0]) * batch)
        bar.close(len(tokens[0]) * batch)
        timing = dict(compile_s=self.compile_s - compile_before, prefill_s=prefill_s, decode_s=decode_s,
                      decode_steps=n_new - 1, prefill_plan=prefill_plan,
                      decode_plan=self._last if n_new > 1 else None, sampling=sampler.describe())
        return tuple(tuple(int(x) for x in t) for t in tokens), timing


def generate(model: LlamaModel, prompt_ids: Sequence[int], n_new: int, device: str | Device | None = None,
             *, fusion: bool | None = None, sampler: Sampler | None = None,
             progress: TextIO | None = None) -> Generation:
    """Generation on `device` (default: the best available); greedy unless a sampler is given."""
    return Generator(model, device, fusion=fusion).generate(prompt_ids, n_new, sampler, progress=progress)
