"""The Llama graph against a plain numpy Llama (and Mixtral), the KV cache against recomputation,
configs from HF config dicts, and sampling."""

from __future__ import annotations

from collections import Counter

import io
import math
import re
import time

import attrs
import numpy as np
import pytest

from opdispatch import plan as plan_module
from opdispatch.backends.cuda.devices import H200
from opdispatch.compiler import compile
from opdispatch.dtypes import to_host_float
from opdispatch.graph import Graph
from opdispatch.models import generate as generation
from opdispatch.models.generate import Generator, generate
from opdispatch.models.llama.config import PRESETS, LlamaConfig
from opdispatch.models.llama.model import LlamaModel
from opdispatch.models.llama.names import random_weights, weight_shapes
from opdispatch.models.llama.stored import random_params, weight_types
from opdispatch.models.sampling import Sampler
from opdispatch.plugins.cuda_matmul import fusion as mm_fusion, support as mm_support
from opdispatch.testing.metrics import nmse
from opdispatch.tensor import param

TINY_F32 = attrs.evolve(PRESETS["tiny"], dtype="f32", cache_dtype="f32")
MOE_F32 = attrs.evolve(PRESETS["tiny-moe"], dtype="f32", cache_dtype="f32")
PROMPT = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46]


def numpy_llama(cfg: LlamaConfig, w: dict[str, np.ndarray], ids: list[int],
                inv_freq: np.ndarray | None = None) -> np.ndarray:
    """Logits (T, vocab) of HF's Llama / Mixtral written out in float64, sharing no code with opdispatch.

    MoE layers (cfg.experts) read HF Mixtral's weights, one expert at a time, and
    route as MixtralSparseMoeBlock: softmax over the router logits, the top
    experts_used, their probabilities renormalized when cfg.norm_topk, the
    weighted sum of the chosen experts' SwiGLU. `inv_freq`: RoPE frequencies
    (default base**(-2i/d)).
    """
    t_len, hd = len(ids), cfg.head_dim
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_eps) * g

    def rotate_half(x: np.ndarray) -> np.ndarray:
        return np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)

    def swiglu(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
        g = h @ gate.T
        return (g / (1 + np.exp(-g)) * (h @ up.T)) @ down.T

    def moe(p: str, h: np.ndarray) -> np.ndarray:
        logits = h @ w[p + "block_sparse_moe.gate.weight"].T
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out = np.zeros_like(h)
        for t in range(t_len):
            ranked = sorted(range(cfg.experts), key=lambda e: -probs[t, e])
            chosen, k = ranked[:cfg.experts_used], cfg.experts_used
            # The selection must not hinge on rounding: the last chosen and the first left out are apart.
            assert k == cfg.experts or probs[t, ranked[k - 1]] - probs[t, ranked[k]] > 1e-5
            gates = probs[t, chosen] / (probs[t, chosen].sum() if cfg.norm_topk else 1.0)
            for e, g in zip(chosen, gates):
                q = f"{p}block_sparse_moe.experts.{e}."
                out[t] += g * swiglu(h[t], w[q + "w1.weight"], w[q + "w3.weight"], w[q + "w2.weight"])
        return out

    if inv_freq is None:
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
        if cfg.experts:
            x = x + moe(p, h)
        else:
            x = x + swiglu(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def assert_close_logits(got: np.ndarray, ref: np.ndarray, rel: float = 1e-3) -> None:
    err = np.abs(got - ref).max()
    assert err <= rel * np.abs(ref).max(), f"max |logit diff| {err:.3g} vs max |logit| {np.abs(ref).max():.3g}"


@pytest.fixture(scope="module")
def tiny() -> tuple[LlamaConfig, dict[str, np.ndarray], LlamaModel]:
    w = random_weights(TINY_F32, seed=1)
    return TINY_F32, w, LlamaModel(TINY_F32, w)


@pytest.mark.parametrize("stack_qkv", [False, True], ids=["qkv", "stacked-qkv"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda0", marks=pytest.mark.gpu)])
def test_prefill_and_decode_match_numpy_llama(tiny, device: str, stack_qkv: bool) -> None:
    cfg, w, _ = tiny
    gen = Generator(LlamaModel(cfg, w, stack_qkv=stack_qkv), device)
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda0", marks=pytest.mark.gpu)])
def test_greedy_decode_on_the_device_picks_the_host_argmax_across_a_window_boundary(device: str) -> None:
    cfg = attrs.evolve(TINY_F32, max_ctx=300)
    w = random_weights(cfg, 3)
    rng = np.random.default_rng()
    prompts = [rng.integers(0, cfg.vocab, n).tolist() for n in (245, 238)]
    gen = Generator(LlamaModel(cfg, w, max_seqs=2), device, batch=2)
    out = gen.generate_batch(prompts, 16)  # decode positions 245..260: windows 256, then 300
    assert gen.step(1, 250, batch=2, greedy=True)[0] is not gen.step(1, 256, batch=2, greedy=True)[0]
    assert "tokens" not in [t.name for t in out.decode_plan.graph.inputs]  # the tokens stay on the device
    alone = LlamaModel(cfg, w)
    for prompt, tokens in zip(prompts, out.tokens):
        host = Generator(alone, device)
        logits, picked = host.forward(prompt)[-1], []
        for _ in range(16):
            picked.append(int(np.argmax(logits)))
            logits = host.forward(picked[-1:])[-1]
        assert list(tokens) == picked, f"seed-free random prompt of {len(prompt)} tokens"
    assert gen.lengths == [245 + 15, 238 + 15]


def test_generation_reports_timing_and_plans(tiny) -> None:
    _, _, model = tiny
    out = generate(model, PROMPT, 4, "cpu")
    assert len(out.tokens) == 4 and out.decode_steps == 3
    assert out.prefill_tps > 0 and out.decode_tps > 0
    assert out.decode_plan is not out.prefill_plan
    assert out.decode_plan.graph.inputs[0].shape == (1,)


def test_decode_time_leaves_out_compiling_and_binding_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy decode across a window boundary compiles and binds a new plan mid-way (and binds its
    first one on its first write): neither is decoding, so neither is in decode_s."""
    slow = 0.5
    compile_, bind_plan = generation.compile, plan_module.bind_plan
    monkeypatch.setattr(generation, "compile", lambda *a, **k: (time.sleep(slow), compile_(*a, **k))[1])
    monkeypatch.setattr(plan_module, "bind_plan", lambda plan: (time.sleep(slow), bind_plan(plan))[1])
    cfg = attrs.evolve(TINY_F32, max_ctx=300)
    model = LlamaModel(cfg, random_weights(cfg, 5))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab, 250).tolist()
    out = generate(model, prompt, 12, "cpu")  # decode positions 250..260: windows 256, then 300
    assert out.decode_steps == 11 and out.compile_s >= 3 * slow  # prefill, then both decode plans
    assert out.decode_s < slow, out.decode_s


def test_decode_graph_is_the_same_across_tokens(tiny) -> None:
    _, _, model = tiny
    assert len({Graph.build(model.build(1, n_past)[0]).key() for n_past in (11, 12, 57)}) == 1


def test_window_grows_in_steps_of_128() -> None:
    cfg = attrs.evolve(TINY_F32, max_ctx=600)
    model = LlamaModel(cfg, random_weights(cfg, 0))
    assert [model.build(1, n)[1].mask.shape[-1] for n in (0, 127, 128, 255, 256, 599)] == [128, 128, 256, 256, 384,
                                                                                            600]
    with pytest.raises(ValueError, match="max_ctx"):
        model.build(2, 599)


# -- several sequences per step ----------------------------------------------------------------

PROMPTS = [PROMPT, [7, 1, 250, 9, 4], [200, 3, 17, 17, 60, 2, 99, 128]]  # ragged: 11, 5 and 8 tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda0", marks=pytest.mark.gpu)])
def test_batch_decode_gives_each_sequence_the_logits_it_gets_alone(tiny, device: str) -> None:
    cfg, w, alone_model = tiny
    model = LlamaModel(cfg, w, max_seqs=4)
    gen = Generator(model, device, batch=3)
    pre = gen.forward_batch(PROMPTS)  # (3, 11, vocab): one padded prefill step
    assert pre.shape == (3, len(PROMPT), cfg.vocab) and gen.lengths == [len(p) for p in PROMPTS]
    seqs = [list(p) for p in PROMPTS]
    got = [[pre[b, :len(p)]] for b, p in enumerate(PROMPTS)]
    for _ in range(6):  # sequences at different positions, one decode graph per step
        for b, s in enumerate(seqs):
            s.append(int(np.argmax(got[b][-1][-1])))
        step = gen.forward_batch([s[-1:] for s in seqs])
        assert step.shape == (3, 1, cfg.vocab)
        for b in range(3):
            got[b].append(step[b])
    assert gen.lengths == [len(s) for s in seqs]
    plan = gen._last
    assert plan.graph.inputs[0].shape == (3,) and gen.step(1, 14, batch=3)[1].mask.shape[:2] == (3, 1)
    for b, s in enumerate(seqs):
        # the same tokens, decoded alone (another model, one sequence in its cache)
        _, ref = run_steps(alone_model, PROMPTS[b], 6, device)
        mine = np.concatenate(got[b])
        np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    assert_close_logits(np.concatenate(got[1]), numpy_llama(cfg, w, seqs[1]))


def test_generate_batch_makes_the_tokens_generate_makes_for_each_prompt(tiny) -> None:
    cfg, w, alone_model = tiny
    model = LlamaModel(cfg, w, max_seqs=3)
    gen = Generator(model, "cpu", batch=3)
    for sampler in (Sampler(), Sampler("top-p", top_p=0.9, temperature=1.3, seed=5)):
        out = gen.generate_batch(PROMPTS, 7, sampler)
        assert out.tokens == tuple(generate(alone_model, p, 7, "cpu", sampler=sampler).tokens for p in PROMPTS)
        assert out.decode_steps == 6 and out.decode_tps > 0 and out.prefill_tps > 0
        assert out.decode_plan.graph.inputs[0].shape == (3,)
    same = gen.generate_batch([PROMPT] * 3, 3)  # equal prompts: the prefill's LM head reads the last rows only
    assert same.prefill_plan.graph.outputs[0].shape == (3, cfg.vocab)
    assert same.tokens == (generate(alone_model, PROMPT, 3, "cpu").tokens,) * 3
    log = io.StringIO()
    gen.generate_batch(PROMPTS, 2, progress=log)
    assert log.getvalue().startswith("generated 6/6 tokens")


def test_batch_steps_write_each_sequence_in_its_own_cache_region(tiny) -> None:
    cfg, w, _ = tiny
    model = LlamaModel(cfg, w, max_seqs=4)
    assert model.states[0].shape == (4 * cfg.max_ctx, cfg.kv_dim)
    _, inp = model.build(1, 40, batch=3, first_seq=1)
    feeds = inp.feeds_batch([[5], [6], [7]], [40, 3, 17])
    assert feeds[inp.kv_idx].tolist() == [1 * 128 + 40, 2 * 128 + 3, 3 * 128 + 17]
    assert feeds[inp.pos].tolist() == [40, 3, 17]
    mask = feeds[inp.mask]
    assert mask.shape == (3, 1, 1, 128) and mask.dtype == np.float16
    assert [int((mask[b, 0, 0] == 0).sum()) for b in range(3)] == [41, 4, 18]  # each sees its own positions
    # the same graph at every position: one plan, one CUDA graph for the whole decode
    assert len({Graph.build(model.build(1, n, batch=3)[0]).key() for n in (11, 12, 57)}) == 1
    with pytest.raises(ValueError, match="max_seqs 4"):
        model.build(1, 0, batch=3, first_seq=2)
    with pytest.raises(ValueError, match="max_seqs of the model"):
        Generator(LlamaModel(cfg, w), "cpu", batch=2)
    with pytest.raises(ValueError, match="outside its window"):
        inp.feeds_batch([[5], [6], [7]], [40, 3, 128])
    # On an H200 (planned without one): a head size its kernels take; every node on the GPU, q rotated,
    # K/V written and the attention read through flash_attn_ext's batch axis by one fused launch a layer.
    big = LlamaConfig(vocab=512, hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, max_ctx=512, dtype="bf16")
    plan = compile(LlamaModel(big, random_weights(big), max_seqs=16).build(1, 300, batch=16)[0], H200)
    assert plan.summary()["copies"] == 0 and all(s.device is H200 for s in plan.steps if s.kind != "view")
    fa = [s for s in plan.fusions if s.kernel == "rope_qkv_flash_attn_ext"]
    assert len(fa) == 2 and fa[0].nodes[-1].srcs[1].shape == (16, 2, 384, 64)  # 301 positions: window_for's 384


@pytest.mark.parametrize("dtype", ["f32", "bf16", "q4_0"])
def test_qkv_projections_are_one_mat_vec_a_layer_and_unstacked_when_dtypes_differ(tiny, dtype: str) -> None:
    cfg, w, _ = tiny
    cfg = attrs.evolve(cfg, dtype=dtype)
    model = LlamaModel(cfg, w, stack_qkv=True)
    assert all(layer.wqkv is not None for layer in LlamaModel(cfg, w).layers)  # on by default
    assert all(layer.wqkv is None for layer in LlamaModel(cfg, w, stack_qkv=False).layers)
    layer = model.layers[0]
    assert layer.wqkv is not None and layer.wqkv.shape == (cfg.hidden + 2 * cfg.kv_dim, cfg.hidden)
    assert layer.wqkv.dtype == layer.wq.dtype
    raw = layer.wqkv.data.reshape(-1)
    assert raw.tobytes() == layer.wq.data.tobytes() + layer.wk.data.tobytes() + layer.wv.data.tobytes()
    graph = Graph.build(model.build(1, 5)[0])
    weights = [t.srcs[0] for t in graph.nodes if t.op == "mul_mat"]
    for layer in model.layers:  # one stacked q/k/v projection a layer, no separate q, k or v
        assert sum(t is layer.wqkv for t in weights) == 1
        assert not any(t is layer.wq or t is layer.wk or t is layer.wv for t in weights)
    # A k_proj stored in another dtype than q_proj's: no stacking, three projections, the same logits.
    mixed = dict(w)
    for i in range(cfg.layers):
        name = f"model.layers.{i}.self_attn.k_proj.weight"
        mixed[name] = param(name, w[name], "f16" if dtype != "f16" else "f32")
    other = LlamaModel(cfg, mixed, stack_qkv=True)
    assert all(layer.wqkv is None and layer.wqk is None for layer in other.layers)
    got, ref = Generator(other, "cpu").forward(PROMPT), Generator(model, "cpu").forward(PROMPT)
    assert_close_logits(got, ref, rel={"f32": 1e-3, "bf16": 3e-2, "q4_0": 0.4}[dtype])
    # Only v_proj in another dtype (a Q4_K_M file's q6_K attn_v): q and k stacked, v apart, the same logits.
    mixed = dict(w)
    for i in range(cfg.layers):
        name = f"model.layers.{i}.self_attn.v_proj.weight"
        mixed[name] = param(name, w[name], "f16" if dtype != "f16" else "f32")
    qk = LlamaModel(cfg, mixed, stack_qkv=True)
    layer = qk.layers[0]
    assert layer.wqkv is None and layer.wqk is not None and layer.wqk.shape == (cfg.hidden + cfg.kv_dim, cfg.hidden)
    assert layer.wqk.data.reshape(-1).tobytes() == layer.wq.data.tobytes() + layer.wk.data.tobytes()
    weights = [t.srcs[0] for t in Graph.build(qk.build(1, 5)[0]).nodes if t.op == "mul_mat"]
    for layer in qk.layers:  # the q/k stack and v a layer
        assert [sum(t is x for t in weights) for x in (layer.wqk, layer.wv, layer.wq, layer.wk)] == [1, 1, 0, 0]
    assert all(layer.wqk is None for layer in LlamaModel(cfg, mixed, stack_qkv=False).layers)
    got = Generator(qk, "cpu").forward(PROMPT)
    assert_close_logits(got, ref, rel={"f32": 1e-3, "bf16": 3e-2, "q4_0": 0.4}[dtype])
    if dtype == "f32":
        assert_close_logits(ref, numpy_llama(tiny[0], w, PROMPT))
    # On an H200 (planned without one): the decode attention fuses q/k/v rope and the cache writes over
    # the views of the stacked output as over separate projections, so stacking saves two launches a layer.
    big = LlamaConfig(vocab=512, hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, max_ctx=512, dtype="bf16")
    bw = random_weights(big)
    for batch in (1, 16):
        plans = [compile(LlamaModel(big, bw, max_seqs=16, stack_qkv=s).build(1, 300, batch=batch)[0], H200)
                 for s in (False, True)]
        for plan in plans:
            assert plan.summary()["copies"] == 0 and all(s.device is H200 for s in plan.steps if s.kind != "view")
            assert [s.kernel for s in plan.fusions].count("rope_qkv_flash_attn_ext") == big.layers
        assert plans[1].summary()["launches"] == plans[0].summary()["launches"] - 2 * big.layers


@pytest.mark.parametrize("batch", [1, 2, 16])
def test_1b_decode_step_fuses_the_attention_at_every_batch(batch: int) -> None:
    # On an H200 (planned without one): the 1b preset's attention (32 / 8 heads, D = 64) at 512 tokens of
    # context, as Generator.step builds it: one fused rope + cache writes + attention launch a layer for 1 to
    # 16 sequences (the fused kernel holds as many blocks an SM as the unfused one: the same KV splits).
    cfg = attrs.evolve(PRESETS["1b"], layers=2, vocab=256, ffn=256, max_ctx=1024)
    plan = compile(LlamaModel(cfg, random_weights(cfg), max_seqs=16).build(1, 512, batch=batch, greedy=True)[0],
                   H200)
    fa = [s.nodes[-1] for s in plan.fusions if s.kernel == "rope_qkv_flash_attn_ext"]
    assert len(fa) == cfg.layers == sum(n.op == "flash_attn_ext" for n in plan.graph.nodes), plan.explain()
    assert fa[0].srcs[1].shape == (batch, 8, 640, 64)  # window_for(513)


#: a config whose head size the fused decode attention takes (64)
BIG = LlamaConfig(vocab=512, hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, max_ctx=512, dtype="f32")


def fused_kernels(plan) -> list[str]:  # noqa: ANN001
    """The fusion rules explain() names, in plan order."""
    return re.findall(r"\[fused (\w+)\]", plan.explain())


@pytest.mark.parametrize(("weights", "path"), [("bf16", "mmf"), ("q4_0", "mmq_small"), ("Q4_K_M", "mmq_small")])
def test_decode_fuses_the_residual_adds_at_batch_16(weights: str, path: str) -> None:
    """On an H200 (planned without one), the 1b preset's decode step adds each layer's attention and MLP outputs
    to the residual stream (x + o_proj(attn), x + down_proj(h)) in the product's kernel at batch 16 (mmf for
    bf16 weights, mmq_small for the block formats: the addend a (16, hidden) tensor, its rows hidden floats apart)
    as at batch 1 (the mat-vecs: one row), so that no add runs on its own."""
    cfg = PRESETS["1b"]
    model = LlamaModel(cfg, random_params(cfg, weights=weights), max_seqs=16)
    for batch in (16, 1):
        plan = compile(model.build(1, 300, batch=batch)[0], H200)
        fused = [s for s in plan.fusions if s.kernel == "mul_mat_add"]
        assert len(fused) == 2 * cfg.layers, plan.explain()
        assert not [s for s in plan.steps if s.kind == "kernel" and s.nodes[0].op == "add"], plan.explain()
        assert {s.nodes[0].srcs[0].shape for s in fused} == {(cfg.hidden, cfg.hidden), (cfg.hidden, cfg.ffn)}
        for step in fused:
            prod, add = step.nodes
            (residual,) = [t for t in add.srcs if t is not prod]
            assert add.shape == residual.shape == (batch, cfg.hidden)
            assert mm_fusion.bias_col(prod, residual) == (cfg.hidden if batch > 1 else 0)
            taken = mm_support.choose(prod, H200).path
            assert taken == path if batch > 1 else taken in mm_fusion.MMV_PATHS


@pytest.mark.parametrize(("n_tokens", "batch"), [(1, 1), (1, 16), (7, 1)], ids=["decode", "decode-16", "prefill"])
def test_unstacked_projections_get_the_fused_kernels_of_the_stacked_ones(n_tokens: int, batch: int) -> None:
    # A Q4_K_M file's mixture: attn_q and attn_k q4_K, attn_v q6_K in some layers (here the second), whose q and
    # k projections are stacked without v. Graph.build puts the v projection between the q and k nodes; the
    # q/k/v rules hoist it (FusionRule.hoist).
    cfg = attrs.evolve(BIG, dtype="q4_K")
    w = random_weights(cfg)
    name = "model.layers.1.self_attn.v_proj.weight"
    models = [LlamaModel(cfg, {**w, name: param(name, w[name], "q6_K")}, max_seqs=16), LlamaModel(cfg, w, max_seqs=16)]
    assert [layer.wqkv is None for m in models for layer in m.layers] == [False, True, False, False]
    assert models[0].layers[1].wqk is not None
    mixed, stacked = (compile(m.build(n_tokens, 300 if n_tokens == 1 else 0, batch=batch)[0], H200) for m in models)
    rule = "rope_qkv_flash_attn_ext" if n_tokens == 1 else "rope_qkv_set_rows"
    assert fused_kernels(stacked).count(rule) == cfg.layers
    # The stacked layers' attention norm runs inside their q/k/v product (rms_norm_mul_mat: the mat-vec, or the
    # GEMM's quantize). The unstacked layer's normed values are read by two products: at one column the q/k
    # stack's mat-vec runs the norm and writes them for v (rms_norm_mul_mat_share); above, cuda_norm's
    # rms_norm -> mul runs it, one launch more.
    columns = n_tokens * batch
    only_mixed = Counter(fused_kernels(mixed)) - Counter(fused_kernels(stacked))
    only_stacked = Counter(fused_kernels(stacked)) - Counter(fused_kernels(mixed))
    assert only_stacked == {"rms_norm_mul_mat": 1}
    assert only_mixed == ({"rms_norm_mul_mat_share": 1} if columns == 1 else {"rms_norm_mul": 1})
    assert mixed.summary()["copies"] == 0
    assert mixed.summary()["launches"] == stacked.summary()["launches"] + 1 + (columns > 1)  # v (and the norm)


@pytest.mark.gpu
def test_unstacked_projections_decode_as_the_stacked_ones() -> None:
    # The same f32 weights as three projections or one: the same kernels on the same values (the fused decode
    # attention reads q, k, v rows through their strides), so the logits agree to f32 rounding.
    w = random_weights(BIG, seed=3)
    gens = [Generator(LlamaModel(BIG, w, stack_qkv=s), "cuda0") for s in (False, True)]
    seq = list(PROMPT)
    got: list[list[np.ndarray]] = [[g.forward(seq)] for g in gens]
    for _ in range(8):
        seq.append(int(np.argmax(got[1][-1][-1])))
        for g, out in zip(gens, got):
            out.append(g.forward(seq[-1:]))
    for n, (a, b) in enumerate(zip(*got)):
        assert np.isfinite(a).all()
        err = nmse(a.astype(np.float64), b.astype(np.float64))
        assert err <= 1e-7, f"step {n}: NMSE {err:.3g} of the unstacked logits against the stacked ones"
    for g in gens:  # the decode step ran the fused rope + K/V writes + attention in both
        plan = compile(g.model.build(1, len(seq) - 1)[0], "cuda0")
        assert fused_kernels(plan).count("rope_qkv_flash_attn_ext") == BIG.layers, plan.explain()


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


def test_the_8b_preset_is_llama_3_8b_shaped_and_splits_over_two_devices() -> None:
    cfg = PRESETS["8b"]
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.dtype) == (4096, 32, 32, 8, 14336, "bf16")
    assert cfg.n_params() == 8_030_261_248  # Meta-Llama-3-8B's parameter count (vocab 128256)
    assert cfg.n_params() == sum(math.prod(s) for s in weight_shapes(cfg).values())
    halves = weight_shapes(cfg, parts=2)  # the tensor split's shards: every split axis divides by 2
    assert halves["model.layers.0.self_attn.k_proj.weight"] == (512, 4096)
    assert halves["model.layers.0.mlp.down_proj.weight"] == (4096, 7168)


#: a file type's default type and its types on the tiny model below (2 query heads a KV head: IQ4_XS keeps attn_v
#: iq4_xs)
MIXED = {"Q4_K_M": ("q4_K", {"q4_K", "q6_K"}), "IQ4_XS": ("iq4_xs", {"iq4_xs", "q6_K"})}


@pytest.mark.parametrize("weights", ["bf16", "q8_0", *MIXED])
def test_random_params_are_views_of_one_pool_a_type_in_their_stored_format(weights: str) -> None:
    cfg = attrs.evolve(PRESETS["tiny"], hidden=256, heads=4, kv_heads=2, ffn=512, cache_dtype="f32",
                       dtype=MIXED[weights][0] if weights in MIXED else weights)
    params = random_params(cfg, seed=1, weights=weights)
    matrices = {n: t for n, t in params.items() if not isinstance(t, np.ndarray)}
    assert {n for n, a in params.items() if isinstance(a, np.ndarray)} == {
        n for n, s in weight_shapes(cfg).items() if len(s) == 1}  # the norms: f32 arrays near 1
    assert all(a.dtype == np.float32 and 0.9 <= a.min() and a.max() <= 1.1 for a in params.values()
               if isinstance(a, np.ndarray))
    types = {t.dtype.name for t in matrices.values()}
    assert types == (MIXED[weights][1] if weights in MIXED else {weights})

    def owner(a: np.ndarray) -> np.ndarray:
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a

    for name in types:  # every matrix of a type is a view of that type's pool: no host copy per weight
        pools = {id(owner(t.data)) for t in matrices.values() if t.dtype.name == name}
        assert len(pools) == 1
    if weights == "bf16":
        head = matrices["lm_head.weight"]
        values = np.abs(to_host_float(head.dtype, head.host_view(head.data)))
        assert 2**-7 <= values.min() and values.max() < 2**-5
    logits = Generator(LlamaModel(cfg, params), "cpu").forward(PROMPT[:4])
    assert np.isfinite(logits).all() and logits.std() > 0


# -- mixture of experts -------------------------------------------------------------------


def run_steps(model: LlamaModel, prompt: list[int], steps: int, device: str = "cpu") -> tuple[list[int], np.ndarray]:
    """Prefill `prompt`, then `steps` greedy decode steps: (the whole sequence, logits of every position)."""
    gen = Generator(model, device)
    seq = list(prompt)
    got = [gen.forward(seq)]
    for _ in range(steps):
        seq.append(int(np.argmax(got[-1][-1])))
        got.append(gen.forward(seq[-1:]))
    return seq, np.concatenate(got)


@pytest.mark.parametrize("k, norm_topk", [(2, True), (2, False), (3, True), (1, False)],
                         ids=["mixtral", "no-renorm", "k3", "k1"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda0", marks=pytest.mark.gpu)])
def test_moe_prefill_and_decode_match_numpy_mixtral(device: str, k: int, norm_topk: bool) -> None:
    cfg = attrs.evolve(MOE_F32, experts_used=k, norm_topk=norm_topk)
    w = random_weights(cfg, seed=1)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in w  # HF Mixtral's names
    seq, got = run_steps(LlamaModel(cfg, w), PROMPT, 8, device)
    assert_close_logits(got, numpy_llama(cfg, w, seq))


def test_moe_weights_stacked_or_per_expert_under_either_name_give_one_model() -> None:
    w = random_weights(MOE_F32, seed=1)
    ref = Generator(LlamaModel(MOE_F32, w), "cpu").forward(PROMPT)
    qwen, stacked = {}, {}
    for name, x in w.items():
        for mixtral, hf in ((".block_sparse_moe.gate.", ".mlp.gate."), (".w1.", ".gate_proj."),
                            (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
            name = name.replace(mixtral, hf)
        qwen[name.replace("block_sparse_moe.", "mlp.")] = x
    for name, shape in weight_shapes(MOE_F32).items():
        if len(shape) == 3:  # "...mlp.experts.gate_proj.weight" <- "...mlp.experts.{e}.gate_proj.weight"
            stem, proj = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
            stacked[name] = np.stack([qwen[f"{stem}.{e}.{proj}.weight"] for e in range(shape[0])])
        else:
            stacked[name] = qwen[name]
    for weights in (qwen, stacked):
        np.testing.assert_array_equal(Generator(LlamaModel(MOE_F32, weights), "cpu").forward(PROMPT), ref)
    # Stacked float16 params (as a loader makes them) are used as they are.
    params = {n: param(n, x, "f16") if x.ndim == 3 else x for n, x in stacked.items()}
    model = LlamaModel(MOE_F32, params)
    up = "model.layers.0.mlp.experts.up_proj.weight"
    assert model.params[up] is params[up]
    assert_close_logits(Generator(model, "cpu").forward(PROMPT), ref, 5e-3)
    # ... and so are per-expert params, their blocks stacked.
    per_expert = {n: param(n, x, "q8_0") if ".experts." in n else x for n, x in qwen.items()}
    stacked_q8 = LlamaModel(MOE_F32, per_expert).params["model.layers.1.mlp.experts.down_proj.weight"]
    assert stacked_q8.dtype.name == "q8_0" and stacked_q8.shape == (4, 64, 64)
    assert stacked_q8.data.tobytes() == b"".join(per_expert[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].data
                                                 .tobytes() for e in range(4))


def moe_ops(model: LlamaModel, n: int) -> list[str]:
    return [t.op for t in Graph.build(model.build(n, 0)[0]).nodes]


@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_router_nodes_run_consecutively_for_the_topk_moe_fusion(norm_topk: bool) -> None:
    cfg = attrs.evolve(PRESETS["tiny-moe"], norm_topk=norm_topk)
    model = LlamaModel(cfg, random_weights(cfg))
    router = ["soft_max", "reshape", "top_k", "get_rows"] + (["reshape", "sum_rows", "div"] if norm_topk else [])
    experts = ["view", "reshape", "mul_mat_id", "mul_mat_id", "glu", "mul_mat_id", "mul", "view", "view", "add", "add"]
    for n in (1, 7):
        ops = " ".join(moe_ops(model, n))
        assert ops.count(" ".join(["mul_mat"] + router + experts)) == cfg.layers, ops
    # On an H200 (planned without one): gate/up + glu fused for one token, the 2 experts + residual in one add.
    plan = compile(model.build(1, 0)[0], H200)
    fused = [s.kernel for s in plan.fusions]
    assert fused.count("mul_mat_id_glu") == cfg.layers and fused.count("multi_add_2") == cfg.layers


def test_moe_decode_graph_is_the_same_across_tokens() -> None:
    model = LlamaModel(PRESETS["tiny-moe"], random_weights(PRESETS["tiny-moe"]))
    assert len({Graph.build(model.build(1, n_past)[0]).key() for n_past in (11, 12, 57)}) == 1


# -- weights --------------------------------------------------------------------------------


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes q_proj/k_proj into a GGUF."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


@pytest.mark.parametrize("cfg", [TINY_F32, MOE_F32], ids=["dense", "moe"])
def test_normal_rope_on_gguf_permuted_qk_equals_neox_on_hf_weights(cfg: LlamaConfig) -> None:
    w = random_weights(cfg, seed=3)
    gguf_w = dict(w)
    for i in range(cfg.layers):
        p = f"model.layers.{i}.self_attn."
        gguf_w[p + "q_proj.weight"] = llama_cpp_permute(w[p + "q_proj.weight"], cfg.heads, cfg.heads)
        gguf_w[p + "k_proj.weight"] = llama_cpp_permute(w[p + "k_proj.weight"], cfg.heads, cfg.kv_heads)
    seq, neox = run_steps(LlamaModel(cfg, w), PROMPT, 4)
    normal_cfg = attrs.evolve(cfg, rope_mode="normal")
    _, normal = run_steps(LlamaModel(normal_cfg, gguf_w), PROMPT, 4)
    assert_close_logits(normal, neox, 1e-5)
    assert_close_logits(normal, numpy_llama(cfg, w, seq))
    # The mode matters: normal RoPE on HF's own rows is another model.
    _, wrong = run_steps(LlamaModel(normal_cfg, w), PROMPT, 4)
    assert np.abs(wrong - neox).max() > 1e-2 * np.abs(neox).max()


def test_lm_head_left_out_is_tied_to_the_embedding() -> None:
    w = random_weights(TINY_F32, seed=4)
    w["lm_head.weight"] = w["model.embed_tokens.weight"].copy()
    ref = Generator(LlamaModel(TINY_F32, w), "cpu").forward(PROMPT)
    del w["lm_head.weight"]
    model = LlamaModel(TINY_F32, w)
    assert model.lm_head is model.embed
    np.testing.assert_array_equal(Generator(model, "cpu").forward(PROMPT), ref)


def test_weights_that_do_not_fit_are_named() -> None:
    w = random_weights(MOE_F32)
    with pytest.raises(ValueError, match=r"missing weights \(1\): model\.layers\.1\.mlp\.experts\.up_proj\.weight"):
        LlamaModel(MOE_F32, {k: v for k, v in w.items() if k != "model.layers.1.block_sparse_moe.experts.2.w3.weight"})
    with pytest.raises(ValueError, match=r"does not use \(1\): model\.layers\.0\.self_attn\.q_proj\.bias"):
        LlamaModel(MOE_F32, {**w, "model.layers.0.self_attn.q_proj.bias": np.ones(64, np.float32)})
    bad = {**w, "model.norm.weight": np.ones(65, np.float32)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(65,\), expected \(64,\)"):
        LlamaModel(MOE_F32, bad)
    LlamaModel(MOE_F32, {**w, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8)})  # a buffer, not a weight


# -- configs from HF ------------------------------------------------------------------------


def hf_llama3_inv_freq(head_dim: int, base: float, s: dict) -> np.ndarray:
    """transformers' _compute_llama3_parameters (modeling_rope_utils.py), in numpy."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    old, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                              s["factor"])
    wavelen = 2 * math.pi / inv_freq
    inv_llama = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, inv_llama)


LLAMA_32_1B = {  # meta-llama/Llama-3.2-1B's config.json, as transformers writes it
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.45.0",
    "use_cache": True, "vocab_size": 128256,
}
MIXTRAL = {  # mistralai/Mixtral-8x7B-v0.1's, less the keys at MixtralConfig's defaults
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "model_type": "mixtral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_local_experts": 8, "vocab_size": 32000,
}


def test_from_hf_reads_llama_and_mixtral_configs() -> None:
    cfg = LlamaConfig.from_hf(LLAMA_32_1B)
    assert (cfg.vocab, cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ffn) == (128256, 2048, 16, 32, 8, 8192)
    assert (cfg.rope_base, cfg.rms_eps, cfg.max_ctx, cfg.experts, cfg.rope_mode) == (5e5, 1e-5, 4096, 0, "neox")
    inv = 500000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(inv / np.array(cfg.rope_freq_factors),
                               hf_llama3_inv_freq(64, 5e5, LLAMA_32_1B["rope_scaling"]), rtol=1e-12)
    moe = LlamaConfig.from_hf(MIXTRAL, max_ctx=512, dtype="q8_0")
    assert (moe.experts, moe.experts_used, moe.norm_topk, moe.kv_heads) == (8, 2, True, 8)
    assert (moe.rope_base, moe.rms_eps, moe.max_ctx, moe.dtype) == (1e6, 1e-5, 512, "q8_0")
    qwen_style = LlamaConfig.from_hf({**MIXTRAL, "num_experts_per_tok": 4, "norm_topk_prob": False})
    assert (qwen_style.experts_used, qwen_style.norm_topk) == (4, False)
    assert LlamaConfig.from_hf({**MIXTRAL, "rope_scaling": {"type": "linear", "factor": 4.0}}).rope_freq_scale == 0.25


@pytest.mark.parametrize("change, match", [
    ({"model_type": "qwen2"}, "model_type 'qwen2'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"head_dim": 128}, "head_dim 128"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling 'yarn'"),
    ({"model_type": "mistral", "sliding_window": 1024}, "sliding_window 1024 shorter than max_ctx 4096"),
    ({"hidden_size": None}, "lacks hidden_size"),
])
def test_from_hf_refuses_what_the_builder_does_not_run(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf({**LLAMA_32_1B, **change})


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"type": "linear", "factor": 4.0},
], ids=["llama3", "linear"])
def test_scaled_rope_from_hf_matches_transformers_frequencies(scaling: dict) -> None:
    tiny = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 128, "rope_scaling": scaling}
    cfg = LlamaConfig.from_hf(tiny, dtype="f32", cache_dtype="f32")
    base = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    inv_freq = hf_llama3_inv_freq(16, 10000.0, scaling) if scaling.get("rope_type") == "llama3" else \
        base / scaling["factor"]  # linear: positions divided by the factor
    if cfg.rope_freq_factors is not None:  # all three of llama3's bands are exercised
        assert {1.0, 8.0} < set(cfg.rope_freq_factors) and len(set(cfg.rope_freq_factors)) > 3
    w = random_weights(cfg, seed=5)
    seq, got = run_steps(LlamaModel(cfg, w), PROMPT * 2, 4)
    ref = numpy_llama(cfg, w, seq, inv_freq)
    assert_close_logits(got, ref)
    assert np.abs(numpy_llama(cfg, w, seq) - ref).max() > 1e-2 * np.abs(ref).max()  # the scaling shows


# -- sampling --------------------------------------------------------------------------------


def test_top_k_1_is_greedy(tiny) -> None:
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((50, 300))
    rows[0, [5, 9]] = rows[0].max() + 1  # a tie: the first index wins, as np.argmax
    s = Sampler("top-k", top_k=1, temperature=0.3)
    assert [s(r) for r in rows] == [int(np.argmax(r)) for r in rows]
    _, _, model = tiny
    assert generate(model, PROMPT, 6, "cpu", sampler=s).tokens == generate(model, PROMPT, 6, "cpu").tokens


def test_top_p_keeps_the_nucleus() -> None:
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    logits = np.log(probs) + 3.0
    for p, ids in ((0.4, [1]), (0.7, [1, 3]), (0.85, [1, 3, 2]), (1.0, [1, 3, 2, 0])):
        got_ids, got_p = Sampler("top-p", top_p=p).candidates(logits)
        assert got_ids.tolist() == ids
        np.testing.assert_allclose(got_p, probs[ids] / probs[ids].sum(), rtol=1e-12)
    s = Sampler("top-p", top_p=0.7, seed=11)
    draws = np.array([s(logits) for _ in range(4000)])
    assert set(draws.tolist()) == {1, 3}
    assert abs((draws == 1).mean() - 0.625) < 0.03  # 0.5 / 0.8, within ~4 sigma


def test_top_p_on_a_flat_vocabulary_and_temperature() -> None:
    rng = np.random.default_rng(8)
    logits = rng.standard_normal(5000) * 0.5  # a nucleus of thousands: past the first partial sort
    ids, p = Sampler("top-p", top_p=0.9, temperature=1.5).candidates(logits)
    full = np.exp(logits / 1.5 - (logits / 1.5).max())
    full /= full.sum()
    order = np.argsort(-full, kind="stable")
    n = int(np.searchsorted(np.cumsum(full[order]), 0.9)) + 1  # the smallest prefix reaching 0.9
    assert ids.tolist() == order[:n].tolist() and n > 1000
    np.testing.assert_allclose(p, full[order[:n]] / full[order[:n]].sum(), rtol=1e-9)
    # top-k at temperature T draws in proportion to exp(logit / T) among the k largest.
    ids, p = Sampler("top-k", top_k=3, temperature=2.0).candidates(np.log([0.1, 0.4, 0.2, 0.3]))
    assert ids.tolist() == [1, 3, 2]
    np.testing.assert_allclose(p, np.sqrt([0.4, 0.3, 0.2]) / np.sqrt([0.4, 0.3, 0.2]).sum(), rtol=1e-12)


def test_sampling_repeats_with_its_seed(tiny) -> None:
    _, _, model = tiny
    gen = Generator(model, "cpu")
    s = Sampler("top-p", top_p=0.95, temperature=1.5, seed=3)
    first = gen.generate(PROMPT, 12, s)
    assert first.sampling == "top-p (p 0.95, temperature 1.5, seed 3)"
    assert gen.generate(PROMPT, 12, s).tokens == first.tokens  # the same sampler again: reset to its seed
    assert gen.generate(PROMPT, 12, Sampler("top-p", top_p=0.95, temperature=1.5, seed=3)).tokens == first.tokens
    assert gen.generate(PROMPT, 12, Sampler("top-p", top_p=0.95, temperature=1.5, seed=4)).tokens != first.tokens
    assert first.tokens != generate(model, PROMPT, 12, "cpu").tokens  # not greedy


@pytest.mark.parametrize("kw, match", [({"method": "beam"}, "method"), ({"method": "top-k", "top_k": 0}, "top_k"),
                                       ({"method": "top-p", "top_p": 1.5}, "top_p"),
                                       ({"method": "top-p", "temperature": 0.0}, "temperature")])
def test_sampler_refuses_bad_parameters(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Sampler(**kw)
    Sampler("greedy", temperature=0.0, top_k=0)  # greedy uses neither


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_one_line_elsewhere(tiny) -> None:
    _, _, model = tiny
    log = io.StringIO()
    generate(model, PROMPT, 5, "cpu", progress=log)
    assert len(log.getvalue().splitlines()) == 1
    assert log.getvalue().startswith("generated 5/5 tokens in ") and " tokens/s " in log.getvalue()
    tty = Terminal()
    generate(model, PROMPT, 5, "cpu", progress=tty)
    text = tty.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    assert "#" * 30 + " 5/5 tokens, " in text and "tokens/s" in text


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("weights", ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "IQ4_NL"])
def test_downloaded_file_types_plan_every_product_on_the_gpu(weights: str, batch: int) -> None:
    """The decode step of a model in each file type people download (llama-quantize's mixture: Q4_0's output q6_K,
    IQ4_XS's attn_v and first ffn_down q5_K, ...), planned for an H200 without one: every node on the GPU, every
    matrix product in cuda_matmul, none on the CPU (issue 18's files)."""
    cfg = attrs.evolve(PRESETS["tiny"], hidden=2048, heads=16, kv_heads=4, ffn=1024, layers=8, vocab=512,
                       dtype="f16")
    types = weight_types(cfg, weights)
    model = LlamaModel(cfg, random_params(cfg, weights=weights), max_seqs=16)
    plan = compile(model.build(1, 20, batch=batch)[0], H200)
    kernels = [s for s in plan.steps if s.kind in ("kernel", "fused")]
    assert {s.device.name for s in kernels} == {"cuda0"}, plan.explain()
    products = [n for s in kernels for n in s.nodes if n.op == "mul_mat"]
    assert {s.plugin for s in kernels if any(n.op == "mul_mat" for n in s.nodes)} == {"cuda_matmul"}
    multiplied = {n.srcs[0].dtype.name for n in products}
    embedding = types.pop("model.embed_tokens.weight")  # read by get_rows, not multiplied
    assert multiplied == set(types.values()), (embedding, types, multiplied)
