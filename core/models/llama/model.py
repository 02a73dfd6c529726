"""LlamaModel: the weights as params, the KV cache as states, and the graph of one step.

Everything that changes from one decode step to the next is an input (token,
position, cache row, mask), so a decode step's graph, plan and CUDA graph stay
the same for 256 tokens at a time. The graph, step by step: docs/models.md.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from ... import ops
from ...shard import Shard
from ...tensor import Flag, Tensor, input, param, state  # noqa: A004
from .config import CONVERTIBLE_DTYPES, LlamaConfig, window_for
from .inputs import StepInputs
from .names import LAYER_NAME, MOE_ALIASES, weight_shapes


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
    #: where wqkv is None, wq and wk stacked (hidden + kv_dim, hidden) if they can be (a Q4_K_M file's q4_K q and
    #: k beside a q6_K v): two products a layer instead of three
    wqk: Tensor | None = None


#: names a checkpoint may carry that the graph does not need
_UNUSED = ("rotary_emb.inv_freq",)


class LlamaModel:
    """Weights as params and the KV cache as states.

    `weights` maps HF names (see weight_shapes) to float arrays, converted to
    cfg.dtype (norm weights and the MoE router stay f32, as llama.cpp keeps
    them), or to opdispatch params (e.g. GGUF blocks from a loader), used as
    they are: each matrix in its own type, as a Q4_K_M file mixes q4_K and
    q6_K. Expert weights come stacked or one per expert (MOE_ALIASES).
    Without "lm_head.weight" the LM head is the embedding (tied).
    A missing weight, a wrong shape or a weight the model would not use
    raises ValueError naming it.

    The KV cache holds max_seqs sequences: per layer a K and a V state of
    (max_seqs * max_ctx, kv_dim) rows, sequence s in rows s * max_ctx .. .

    stack_qkv: each layer's q_proj, k_proj and v_proj are also stacked row-wise
    into one (hidden + 2 kv_dim, hidden) param (float weights concatenated,
    block formats by their bytes: rows are independent), so a step runs one
    projection a layer instead of three and q, k, v are free views of its
    output; where v's dtype differs, q and k alone are stacked, and where
    q's and k's differ the three stay apart. On by default: two launches
    fewer a layer, and one larger mat-vec runs closer to the bandwidth than
    three small ones. The graph reads only the stacks.

    shard: this model is one rank of a tensor split (core/models/llama/split.py makes the ranks' models):
    `weights` are the rank's shards (weight_shapes(cfg, shard.size)): its heads, KV heads and ffn
    features, 1/size of each; its KV cache holds its KV heads; the output projections' partial sums meet
    in all_reduce_sum nodes.
    """

    def __init__(self, cfg: LlamaConfig, weights: Mapping[str, np.ndarray | Tensor], *, max_seqs: int = 1,
                 stack_qkv: bool = True, shard: Shard | None = None) -> None:
        if max_seqs < 1:
            raise ValueError(f"llama: max_seqs must be >= 1, got {max_seqs}")
        self.cfg = cfg
        self.max_seqs = max_seqs
        self.stack_qkv = stack_qkv
        self.shard = shard
        parts = 1 if shard is None else shard.size
        #: what this model holds of the heads, KV heads and ffn features (all of them unless a shard)
        self.heads = cfg.heads if shard is None else shard.part(cfg.heads, "the attention heads")
        self.kv_heads = cfg.kv_heads if shard is None else shard.part(cfg.kv_heads, "the KV heads")
        self.q_dim, self.kv_dim = self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        if shard is not None:
            shard.part(cfg.ffn, "the ffn features")
        given = dict(weights)
        self.params: dict[str, Tensor] = {}
        missing = []
        for name, shape in weight_shapes(cfg, parts).items():
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
        m = LAYER_NAME.fullmatch(name)
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
        if not keep_f32 and self.cfg.dtype not in CONVERTIBLE_DTYPES:
            raise ValueError(f"llama: weight {name} is a float array and opdispatch cannot quantize to cfg.dtype "
                             f"{self.cfg.dtype}: give it as a param in its stored format, or use one of "
                             f"{', '.join(CONVERTIBLE_DTYPES)}")
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
        wqkv = _stack_rows(f"{p}self_attn.qkv_proj.weight", (wq, wk, wv)) if self.stack_qkv else None
        wqk = _stack_rows(f"{p}self_attn.qk_proj.weight", (wq, wk)) if self.stack_qkv and wqkv is None else None
        layer = _Layer(w["input_layernorm"], wq, wk, wv, w["self_attn.o_proj"], w["post_attention_layernorm"], *mlp,
                       state(f"cache.k.{i}", (self.max_seqs * cfg.max_ctx, self.kv_dim), cfg.cache_dtype),
                       state(f"cache.v.{i}", (self.max_seqs * cfg.max_ctx, self.kv_dim), cfg.cache_dtype),
                       wqkv, wqk)
        for t in (*w.values(), layer.k_cache, layer.v_cache, layer.wqkv, layer.wqk):
            if t is not None:
                t.layer = i  # a layer split keeps the layer's weights, its cache and its ops on one device
        return layer

    @property
    def states(self) -> list[Tensor]:
        return [c for layer in self.layers for c in (layer.k_cache, layer.v_cache)]

    def build(self, n_tokens: int, n_past: int, *, batch: int = 1, first_seq: int = 0,
              logits: str = "all", greedy: bool = False, inputs: StepInputs | None = None
              ) -> tuple[list[Tensor], StepInputs]:
        """The graph of one step: `batch` sequences (cache regions first_seq ..) of n_tokens tokens each,
        the furthest of them starting at position n_past -> [logits f32 (batch * n_tokens, vocab)],
        sequence b's rows at b * n_tokens ..; logits="last": (batch, vocab), each sequence's last token.

        Decode of several sequences (n_tokens 1) is one graph: their rows go through the projections and
        the MLP together, each writes its K/V rows into its own cache region (set_rows at rows from
        StepInputs.kv_idx), and flash_attn_ext reads the regions through its batch axis (q (B, heads, n,
        head_dim), K/V views (B, kv_heads, window, head_dim) of the cache, a stride of max_ctx rows
        between sequences) with a mask per sequence (B, 1, n, window): flash_attn_ext takes a mask with a
        batch axis (broadcast by modulo, docs/ops.md), so sequences at different positions share the step.
        The window (cache positions read) is window_for(n_past + n_tokens), the same for all of them.

        greedy (decode only, n_tokens 1): the step picks each sequence's next token on the device: it
        embeds the tokens in `next_tokens` (no token input: StepInputs.tokens is None), and instead of the
        logits it returns [next_tokens, token_log] updated: argmax of each sequence's logits (ties: the
        last index, ggml's argmax) into next_tokens and into token_log at its kv_idx row. Steps chained
        this way need no host work between them but the next positions (Plan.submit).

        inputs: the StepInputs of another rank's graph of the same step (a tensor split: every rank's
        graph reads the same inputs, fed once); default: new ones.
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
        inp = inputs if inputs is not None else StepInputs(None if greedy else input("tokens", (rows,), "i32"),
                                   input("pos", (rows,), "i32"), input("kv_idx", (rows,), "i64"),
                                   input("kq_mask", (b_, 1, n, window), "f16"), first_seq, cfg.max_ctx)
        if (inp.tokens is None) != greedy or inp.mask.shape != (b_, 1, n, window) or inp.first_seq != first_seq:
            raise ValueError("llama: the inputs given are those of another step")
        x = ops.get_rows(self.embed, next_tokens if greedy else inp.tokens)  # (B * n, hidden)
        for layer in self.layers:
            h = ops.mul(ops.rms_norm(x, cfg.rms_eps), layer.attn_norm)
            # RoPE sees the B * n rows as one run of tokens (a position each), then q splits by sequence.
            stack = layer.wqkv if layer.wqkv is not None else layer.wqk
            if stack is not None:  # one projection; q, k (and v) are column ranges of its rows (free views)
                qkv = ops.mul_mat(stack, h)  # (B * n, q_dim + kv_dim [+ kv_dim])
                rs, es = qkv.strides
                q = qkv.view((1, rows, self.heads, hd), (rows * rs, rs, hd * es, es))
                k = qkv.view((1, rows, self.kv_heads, hd), (rows * rs, rs, hd * es, es), self.q_dim * es)
            else:
                q = ops.mul_mat(layer.wq, h).reshape(1, rows, self.heads, hd)
                k = ops.mul_mat(layer.wk, h).reshape(1, rows, self.kv_heads, hd)
            if layer.wqkv is not None:
                v = qkv.view((rows, self.kv_dim), (rs, es), (self.q_dim + self.kv_dim) * es)
            else:
                v = ops.mul_mat(layer.wv, h)  # (B * n, kv_dim)
            q, k = self._rope(q, inp.pos), self._rope(k, inp.pos)
            # Read the cache through set_rows' result: the write is ordered before the read.
            keys = self._window(ops.set_rows(layer.k_cache, k.reshape(rows, self.kv_dim), inp.kv_idx), window,
                                b_, first_seq)
            values = self._window(ops.set_rows(layer.v_cache, v, inp.kv_idx), window, b_, first_seq)
            q = q.reshape(b_, n, self.heads, hd).permute(0, 2, 1, 3)  # (B, heads, n, hd)
            attn = ops.flash_attn_ext(q, keys, values, inp.mask, scale=hd ** -0.5)  # (B, n, heads, hd)
            x = ops.add(x, self._reduce(ops.mul_mat(layer.wo, attn.reshape(rows, self.q_dim))))
            h = ops.mul(ops.rms_norm(x, cfg.rms_eps), layer.ffn_norm)
            if layer.router is None:
                gated = ops.glu_split(ops.mul_mat(layer.w_gate, h), ops.mul_mat(layer.w_up, h), "swiglu")
                x = ops.add(x, self._reduce(ops.mul_mat(layer.w_down, gated)))
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
        return ops.add(self._reduce(out), residual)

    def _reduce(self, partial: Tensor) -> Tensor:
        """A row-parallel projection's result: a shard's partial sums summed over the ranks (all_reduce_sum);
        unchanged without a shard."""
        if self.shard is None:
            return partial
        return ops.all_reduce_sum(partial, self.shard.group, self.shard.rank)

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
        shape = (batch, self.kv_heads, window, self.cfg.head_dim)
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
