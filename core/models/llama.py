"""A Llama decoder as one opdispatch graph per step, and greedy generation.

The graph follows llama.cpp's: embedding by get_rows, per layer RMSNorm ->
q/k/v projections -> neox RoPE (HF's rotate_half) -> K and V written into the
cache with set_rows -> flash_attn_ext over a fixed window of the cache with a
causal f16 mask -> output projection -> residual -> RMSNorm -> SwiGLU MLP ->
residual; final norm and LM head. Everything that changes from one decode
step to the next is an input (token, position, cache row, mask), so a decode
step's graph, plan and CUDA graph stay the same for 256 tokens at a time.

KV cache layout: per layer one state of shape (max_ctx, kv_heads * head_dim)
for K and one for V, a row per token position (llama.cpp's layout). A step
writes its rows straight from the projection/RoPE output (a free reshape, the
rope -> view -> set_rows pattern ggml fuses), and attention reads the window
as a strided view (1, kv_heads, window, head_dim) that costs nothing.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import attrs
import numpy as np

from .. import ops
from ..backends.base import Device
from ..dispatch import Plan, compile, resolve_device
from ..dtypes import dtype as as_dtype
from ..manager import manager
from ..tensor import Tensor, input, param, state  # noqa: A004

__all__ = ["LlamaConfig", "PRESETS", "random_weights", "LlamaModel", "StepInputs", "Generator", "Generation",
           "generate", "window_for"]

WEIGHT_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
CACHE_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
#: the attention window grows in steps of this many positions (or up to max_ctx)
WINDOW_STEP = 256


@attrs.frozen
class LlamaConfig:
    """Shape of a Llama decoder, and the dtypes its weights and KV cache are stored in."""

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

    def __attrs_post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"llama: hidden {self.hidden} must split into {self.heads} heads of even size, "
                             f"and heads must be a multiple of kv_heads {self.kv_heads}")
        for what, dt, k in (("weights", self.dtype, math.gcd(self.hidden, self.ffn)),
                            ("cache", self.cache_dtype, self.head_dim)):
            block = as_dtype(dt).block_size
            if k % block:
                raise ValueError(f"llama: {what} dtype {dt} needs rows that are multiples of {block}, got {k}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def n_params(self) -> int:
        per_layer = 2 * self.hidden * (self.hidden + self.kv_dim) + 3 * self.hidden * self.ffn + 2 * self.hidden
        return 2 * self.vocab * self.hidden + self.layers * per_layer + self.hidden

    def describe(self) -> str:
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads ({self.kv_heads} kv, dim "
                f"{self.head_dim}), ffn {self.ffn}, vocab {self.vocab}, max_ctx {self.max_ctx}; "
                f"{self.n_params() / 1e6:.1f}M params in {self.dtype}, cache {self.cache_dtype}")


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_ctx=128),
    # Llama-3.2-1B's shape with Llama 2's vocabulary and rope base; bf16 as the decode target says.
    "1b": LlamaConfig(vocab=32000, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, max_ctx=2048,
                      dtype="bf16"),
}


def random_weights(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """HF Llama names, (out, in) matrices like torch.nn.Linear, float32.

    Linear weights have std 1/sqrt(in): HF's initializer_range 0.02 at hidden
    2048, and O(1) activations in a tiny model, so its attention is far from
    uniform and tests see RoPE and the mask. Embeddings have std 1; norm
    weights are near 1 but not 1, so a dropped norm weight shows. Values are
    uniform with that std rather than normal: 4x faster to draw, which a
    1B-parameter model notices.
    """
    rng = np.random.default_rng(seed)

    def draw(shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        x = rng.random(shape, dtype=np.float32)
        x -= np.float32(0.5)
        x *= np.float32(2 * math.sqrt(3) * std)  # uniform on [-sqrt(3), sqrt(3)) * std
        x += np.float32(mean)
        return x

    def linear(out: int, inp: int) -> np.ndarray:
        return draw((out, inp), inp ** -0.5)

    def norm() -> np.ndarray:
        return draw((cfg.hidden,), 0.1, mean=1.0)

    h, kv = cfg.hidden, cfg.kv_dim
    w = {"model.embed_tokens.weight": draw((cfg.vocab, h), 1.0)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = linear(h, h)
        w[p + "self_attn.k_proj.weight"] = linear(kv, h)
        w[p + "self_attn.v_proj.weight"] = linear(kv, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, h)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = linear(cfg.ffn, h)
        w[p + "mlp.up_proj.weight"] = linear(cfg.ffn, h)
        w[p + "mlp.down_proj.weight"] = linear(h, cfg.ffn)
    w["model.norm.weight"] = norm()
    w["lm_head.weight"] = linear(cfg.vocab, h)
    return w


def window_for(cfg: LlamaConfig, n_end: int) -> int:
    """Cache positions attention reads when the last token sits at n_end - 1: a multiple of 256, or max_ctx."""
    return min(cfg.max_ctx, -(-n_end // WINDOW_STEP) * WINDOW_STEP)


@attrs.frozen
class StepInputs:
    """The inputs of one step's graph; `feeds` fills them for tokens at positions n_past.."""

    tokens: Tensor  # i32 (n,)
    pos: Tensor  # i32 (n,)
    kv_idx: Tensor  # i64 (n,): cache rows written
    mask: Tensor  # f16 (1, 1, n, window): 0 up to each token's position, -inf beyond

    def feeds(self, token_ids: Sequence[int], n_past: int) -> dict[Tensor, np.ndarray]:
        n, window = self.tokens.shape[0], self.mask.shape[-1]
        if len(token_ids) != n:
            raise ValueError(f"llama step built for {n} tokens, got {len(token_ids)}")
        positions = np.arange(n_past, n_past + n)
        causal = np.arange(window)[None, :] <= positions[:, None]
        return {
            self.tokens: np.asarray(token_ids, np.int32),
            self.pos: positions.astype(np.int32),
            self.kv_idx: positions.astype(np.int64),
            self.mask: np.where(causal, 0.0, -np.inf).astype(np.float16)[None, None],
        }


#: a layer's weights, in _Layer's field order (HF names after "model.layers.{i}." and before ".weight")
_LAYER_WEIGHTS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@attrs.define(eq=False)
class _Layer:
    attn_norm: Tensor
    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor
    ffn_norm: Tensor
    w_gate: Tensor
    w_up: Tensor
    w_down: Tensor
    k_cache: Tensor
    v_cache: Tensor


class LlamaModel:
    """Weights as params in cfg.dtype (norm weights stay f32, as in llama.cpp) and the KV cache as states."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, np.ndarray]) -> None:
        self.cfg = cfg
        self.params = {name: param(name, w, "f32" if w.ndim == 1 else cfg.dtype) for name, w in weights.items()}
        self.layers = [
            _Layer(*(self.params[f"model.layers.{i}.{name}.weight"] for name in _LAYER_WEIGHTS),
                   state(f"cache.k.{i}", (cfg.max_ctx, cfg.kv_dim), cfg.cache_dtype),
                   state(f"cache.v.{i}", (cfg.max_ctx, cfg.kv_dim), cfg.cache_dtype))
            for i in range(cfg.layers)
        ]
        self.embed = self.params["model.embed_tokens.weight"]
        self.norm = self.params["model.norm.weight"]
        self.lm_head = self.params["lm_head.weight"]

    @property
    def states(self) -> list[Tensor]:
        return [c for layer in self.layers for c in (layer.k_cache, layer.v_cache)]

    def build(self, n_tokens: int, n_past: int) -> tuple[list[Tensor], StepInputs]:
        """The graph of one step: n_tokens tokens at positions n_past.. -> [logits f32 (n_tokens, vocab)]."""
        cfg = self.cfg
        n, hd = n_tokens, cfg.head_dim
        if n < 1 or n_past < 0 or n_past + n > cfg.max_ctx:
            raise ValueError(f"llama: {n} tokens after {n_past} do not fit max_ctx {cfg.max_ctx}")
        window = window_for(cfg, n_past + n)
        inp = StepInputs(input("tokens", (n,), "i32"), input("pos", (n,), "i32"),
                         input("kv_idx", (n,), "i64"), input("kq_mask", (1, 1, n, window), "f16"))
        x = ops.get_rows(self.embed, inp.tokens)  # (n, hidden)
        for layer in self.layers:
            h = ops.mul(ops.rms_norm(x, cfg.rms_eps), layer.attn_norm)
            q = self._rope(ops.mul_mat(layer.wq, h).reshape(1, n, cfg.heads, hd), inp.pos)
            k = self._rope(ops.mul_mat(layer.wk, h).reshape(1, n, cfg.kv_heads, hd), inp.pos)
            v = ops.mul_mat(layer.wv, h)  # (n, kv_dim)
            # Read the cache through set_rows' result: the write is ordered before the read.
            keys = self._window(ops.set_rows(layer.k_cache, k.reshape(n, cfg.kv_dim), inp.kv_idx), window)
            values = self._window(ops.set_rows(layer.v_cache, v, inp.kv_idx), window)
            attn = ops.flash_attn_ext(q.permute(0, 2, 1, 3), keys, values, inp.mask, scale=hd ** -0.5)
            x = ops.add(x, ops.mul_mat(layer.wo, attn.reshape(n, cfg.hidden)))
            h = ops.mul(ops.rms_norm(x, cfg.rms_eps), layer.ffn_norm)
            gated = ops.glu_split(ops.mul_mat(layer.w_gate, h), ops.mul_mat(layer.w_up, h), "swiglu")
            x = ops.add(x, ops.mul_mat(layer.w_down, gated))
        logits = ops.mul_mat(self.lm_head, ops.mul(ops.rms_norm(x, cfg.rms_eps), self.norm))
        return [logits], inp

    def _rope(self, x: Tensor, pos: Tensor) -> Tensor:
        return ops.rope(x, pos, self.cfg.head_dim, "neox", freq_base=self.cfg.rope_base)

    def _window(self, cache: Tensor, window: int) -> Tensor:
        """The first `window` rows of a cache as (1, kv_heads, window, head_dim), a strided view."""
        row = cache.strides[0]
        head = cache.dtype.row_bytes(self.cfg.head_dim)
        shape = (1, self.cfg.kv_heads, window, self.cfg.head_dim)
        return cache.view(shape, (window * row, head, row, cache.dtype.block_bytes))


@attrs.frozen
class Generation:
    """Tokens generated greedily and where the time went (first runs, which bind, are left out)."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    compile_s: float
    prefill_s: float
    decode_s: float
    decode_steps: int
    prefill_plan: Plan
    decode_plan: Plan | None

    @property
    def prefill_tps(self) -> float:
        return len(self.prompt) / self.prefill_s if self.prefill_s > 0 else math.nan

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else math.nan


class Generator:
    """Runs a LlamaModel on one device: one compiled plan per step shape, and the cache position.

    Each plan is compiled once (per token count and attention window). The
    first run of a plan binds it (buffers, weight upload, kernels) and is
    repeated untimed: a step rerun with the same inputs rewrites the same
    cache rows with the same values.
    """

    def __init__(self, model: LlamaModel, device: str | Device | None = None, *, fusion: bool | None = None) -> None:
        self.model = model
        self.device = resolve_device(device, manager())
        self.fusion = fusion
        self.n_past = 0
        self.compile_s = 0.0
        self.last_run_s = 0.0
        self._steps: dict[tuple[int, int], tuple[Plan, StepInputs]] = {}
        self._bound: set[Plan] = set()
        self._last: Plan | None = None

    def reset(self) -> None:
        """Start a new sequence (the cache rows past a position are masked, not cleared)."""
        self.n_past = 0

    def step(self, n_tokens: int, n_past: int) -> tuple[Plan, StepInputs]:
        """The compiled plan for n_tokens tokens at n_past (compiled on first use)."""
        key = (n_tokens, window_for(self.model.cfg, n_past + n_tokens))
        if key not in self._steps:
            t0 = time.perf_counter()
            outputs, inp = self.model.build(n_tokens, n_past)
            self._steps[key] = (compile(outputs, self.device, fusion=self.fusion), inp)
            self.compile_s += time.perf_counter() - t0
        return self._steps[key]

    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits f32 (len(token_ids), vocab) for tokens at the next positions; advances the cache."""
        bad = [t for t in token_ids if not 0 <= t < self.model.cfg.vocab]
        if bad:
            raise ValueError(f"llama: token ids {bad[:5]} outside the vocabulary of {self.model.cfg.vocab}")
        plan, inp = self.step(len(token_ids), self.n_past)
        feeds = inp.feeds(token_ids, self.n_past)
        self._last = plan
        if plan not in self._bound:
            plan.run(feeds)
            self._bound.add(plan)
        t0 = time.perf_counter()
        (logits,) = plan.run(feeds)
        self.last_run_s = time.perf_counter() - t0
        self.n_past += len(token_ids)
        return logits

    def generate(self, prompt_ids: Sequence[int], n_new: int) -> Generation:
        """Greedy continuation of `prompt_ids` by n_new tokens (argmax on the host)."""
        if not prompt_ids or n_new < 1:
            raise ValueError("generate: needs a non-empty prompt and n_new >= 1")
        self.reset()
        compile_before = self.compile_s
        self.step(len(prompt_ids), 0)
        if n_new > 1:
            self.step(1, len(prompt_ids))
        logits = self.forward(prompt_ids)
        prefill_s = self.last_run_s
        tokens = [int(np.argmax(logits[-1]))]
        decode_s = 0.0
        for _ in range(n_new - 1):
            logits = self.forward(tokens[-1:])
            decode_s += self.last_run_s
            tokens.append(int(np.argmax(logits[-1])))
        prefill_plan = self.step(len(prompt_ids), 0)[0]
        decode_plan = self._last if n_new > 1 else None
        return Generation(tuple(int(t) for t in prompt_ids), tuple(tokens), self.compile_s - compile_before,
                          prefill_s, decode_s, n_new - 1, prefill_plan, decode_plan)


def generate(model: LlamaModel, prompt_ids: Sequence[int], n_new: int, device: str | Device | None = None,
             *, fusion: bool | None = None) -> Generation:
    """Greedy generation on `device` (default: the best available)."""
    return Generator(model, device, fusion=fusion).generate(prompt_ids, n_new)
