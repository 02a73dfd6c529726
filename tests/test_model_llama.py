"""The Llama graph against a plain numpy Llama, and the KV cache against recomputation."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from opdispatch.graph import Graph
from opdispatch.models.llama import PRESETS, Generator, LlamaConfig, LlamaModel, generate, random_weights

TINY_F32 = attrs.evolve(PRESETS["tiny"], dtype="f32", cache_dtype="f32")
PROMPT = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46]


def numpy_llama(cfg: LlamaConfig, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Logits (T, vocab) of HF's Llama written out in float64, sharing no code with opdispatch."""
    t_len, hd = len(ids), cfg.head_dim
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_eps) * g

    def rotate_half(x: np.ndarray) -> np.ndarray:
        return np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)

    inv_freq = cfg.rope_base ** (-np.arange(0, hd, 2) / hd)
    freqs = np.arange(t_len)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)  # (T, hd)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]  # broadcast over heads

    def rope(x: np.ndarray) -> np.ndarray:  # x (T, H, hd)
        return x * cos + rotate_half(x) * sin

    causal = np.tril(np.ones((t_len, t_len), bool))
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(t_len, cfg.heads, hd))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(t_len, cfg.kv_heads, hd))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t_len, cfg.kv_heads, hd)
        group = cfg.heads // cfg.kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # GQA: head h reads kv head h // group
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(t_len, cfg.hidden)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def assert_close_logits(got: np.ndarray, ref: np.ndarray, rel: float = 1e-3) -> None:
    err = np.abs(got - ref).max()
    assert err <= rel * np.abs(ref).max(), f"max |logit diff| {err:.3g} vs max |logit| {np.abs(ref).max():.3g}"


@pytest.fixture(scope="module")
def tiny() -> tuple[LlamaConfig, dict[str, np.ndarray], LlamaModel]:
    w = random_weights(TINY_F32, seed=1)
    return TINY_F32, w, LlamaModel(TINY_F32, w)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda0", marks=pytest.mark.gpu)])
def test_prefill_and_decode_match_numpy_llama(tiny, device: str) -> None:
    cfg, w, model = tiny
    gen = Generator(model, device)
    seq = list(PROMPT)
    got = [gen.forward(seq)]
    for _ in range(8):
        seq.append(int(np.argmax(got[-1][-1])))
        got.append(gen.forward(seq[-1:]))
    ref = numpy_llama(cfg, w, seq)
    assert_close_logits(np.concatenate(got), ref)
    assert gen.n_past == len(seq)


def test_prefill_then_decode_equals_one_prefill(tiny) -> None:
    _, _, model = tiny
    out = generate(model, PROMPT, 9, "cpu")
    seq = list(PROMPT) + list(out.tokens[:-1])
    gen = Generator(model, "cpu")
    logits = gen.forward(seq)
    assert [int(t) for t in np.argmax(logits[len(PROMPT) - 1:], axis=-1)] == list(out.tokens)
    # The same logits, step by step, from a new generator that shares the compiled plans.
    steps = Generator(model, "cpu")
    incremental = np.concatenate([steps.forward(PROMPT)] + [steps.forward([t]) for t in out.tokens[:-1]])
    np.testing.assert_allclose(incremental, logits, rtol=0, atol=1e-4 * np.abs(logits).max())


def test_decode_across_a_window_boundary_equals_one_prefill() -> None:
    cfg = attrs.evolve(TINY_F32, max_ctx=300)
    model = LlamaModel(cfg, random_weights(cfg, 2))
    seq = np.random.default_rng(0).integers(0, cfg.vocab, 262).tolist()
    whole = Generator(model, "cpu").forward(seq)  # window 300
    gen = Generator(model, "cpu")
    steps = [gen.forward(seq[:250])] + [gen.forward([t]) for t in seq[250:]]  # windows 256, then 300
    assert gen.step(1, 255)[0] is not gen.step(1, 256)[0]  # the cache moved between decode plans
    np.testing.assert_allclose(np.concatenate(steps), whole, rtol=0, atol=1e-4 * np.abs(whole).max())


def test_generation_reports_timing_and_plans(tiny) -> None:
    _, _, model = tiny
    out = generate(model, PROMPT, 4, "cpu")
    assert len(out.tokens) == 4 and out.decode_steps == 3
    assert out.prefill_tps > 0 and out.decode_tps > 0
    assert out.decode_plan is not out.prefill_plan
    assert out.decode_plan.graph.inputs[0].shape == (1,)


def test_decode_graph_is_the_same_across_tokens(tiny) -> None:
    _, _, model = tiny
    assert len({Graph.build(model.build(1, n_past)[0]).key() for n_past in (11, 12, 57)}) == 1


def test_window_grows_in_steps_of_256() -> None:
    cfg = attrs.evolve(TINY_F32, max_ctx=600)
    model = LlamaModel(cfg, random_weights(cfg, 0))
    assert [model.build(1, n)[1].mask.shape[-1] for n in (0, 255, 256, 599)] == [256, 256, 512, 600]
    with pytest.raises(ValueError, match="max_ctx"):
        model.build(2, 599)


@pytest.mark.parametrize("dtype, cache", [("f16", "f16"), ("bf16", "bf16"), ("q8_0", "f16"), ("q4_0", "f32")])
def test_stored_dtypes_stay_close_to_f32(tiny, dtype: str, cache: str) -> None:
    cfg, w, _ = tiny
    low = LlamaModel(attrs.evolve(cfg, dtype=dtype, cache_dtype=cache), w)
    got = Generator(low, "cpu").forward(PROMPT)
    ref = numpy_llama(cfg, w, PROMPT)
    bound = {"f16": 5e-3, "bf16": 3e-2, "q8_0": 4e-2, "q4_0": 0.4}[dtype]  # measured: 6e-4, 5e-3, 9e-3, 0.14
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= bound * np.abs(ref).max()


def test_config_refuses_unusable_dtypes() -> None:
    with pytest.raises(ValueError, match="q8_0"):
        attrs.evolve(PRESETS["tiny"], cache_dtype="q8_0")  # head_dim 16 holds no 32-value block
    with pytest.raises(ValueError, match="heads"):
        LlamaConfig(vocab=8, hidden=60, layers=1, heads=8, kv_heads=2, ffn=64)
