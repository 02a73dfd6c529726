"""opdispatch's Llama against transformers, an implementation nobody here wrote (issue 6), on the GPU.

A transformers model (LlamaForCausalLM, MixtralForCausalLM) is built from a
small config with seeded random weights, its config goes through
LlamaConfig.from_hf and its state_dict through weights.state_dict.state_dict_arrays into
opdispatch's LlamaModel, and opdispatch's Generator runs a prompt (prefill)
and greedy decode steps on cuda0. transformers runs the whole token sequence
in one forward (eager attention, on the GPU): its logits at every position
are what prefill + decode must give.

- f32 weights and an f32 KV cache: at every step (the prefill, each decode
  step) max |logit diff| <= 1e-3 * max |logit|, and the same greedy tokens
  except where transformers' top two logits are closer than that bound (rare,
  counted; until such a near-tie our tokens are the ones transformers decodes).
- f16 / bf16 weights: the error against transformers in f32 and in the same
  type, measured, printed and bounded (see HALF_BOUNDS).

Each test prints one line starting with "hf-compare"; run with -rA to see them
(pytest-xdist forwards captured output only through the report).
Weights are not HF's init (std 0.02 gives near-uniform attention and logits,
where every greedy step is a near-tie): matrices have std 1/sqrt(fan-in),
embeddings std 1, norm weights uniform in [0.8, 1.2], as random_weights draws.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the comparison with transformers needs torch (on the GPU machine)")
transformers = pytest.importorskip("transformers",
                                   reason="the comparison with transformers needs transformers (on the GPU machine)")

torch.set_float32_matmul_precision("highest")  # transformers' f32 reference in f32, not TF32

from opdispatch.models.generate import Generator  # noqa: E402
from opdispatch.models.llama.config import LlamaConfig  # noqa: E402
from opdispatch.models.llama.model import LlamaModel  # noqa: E402
from opdispatch.models.weights.state_dict import state_dict_arrays  # noqa: E402

DEVICE, TORCH_DEVICE = "cuda0", "cuda"
PROMPT_LEN, DECODE_STEPS = 16, 32
#: max |logit diff| / max |logit| at every step with f32 weights and cache (issue 6). The prefill's
#: flash attention rounds Q, K, V and P to f16 tiles (as ggml's does): transformers made to round the
#: same on the CPU moved these models' logits by 2e-4..3.3e-4 of the largest, inside the bound.
F32_BOUND = 1e-3
#: the same, with f16 / bf16 weights (and an f16 KV cache), against transformers in f32 and in that type.
#: Unit roundoff 2^-11 (f16), 2^-8 (bf16); a logit sums products through a few layers whose matmul inputs
#: are rounded to the type (transformers in that type also keeps its residual stream, norms, attention and
#: logits in it), so a few units of roundoff. Measured with opdispatch's CPU reference (f32 activations,
#: exact attention) and transformers 5.24 on the CPU, over 6 seeds: f16 7e-4..9e-4 against f32,
#: 1.5e-3..1.7e-3 against transformers f16 (whose own error against f32 is 1.2e-3..1.4e-3); bf16
#: 5e-3..7e-3 and 1.2e-2 (its own 9e-3..1.3e-2). On the GPU the matmul inputs are rounded to the weights'
#: type and prefill attention runs on f16 tiles: allow ~6x (f16) and ~5x (bf16) the CPU's figures.
HALF_BOUNDS = {"f16": 1e-2, "bf16": 6e-2}
#: ... and no worse than this many times transformers' own error in the type (against its f32)
HALF_VS_TRANSFORMERS = 2.0
#: an MoE prompt is redrawn (at most this many times) where transformers' router ranks its last chosen expert
#: and the next within F32_BOUND of its largest router logit, in some layer at some position: a tie that f32
#: rounding breaks either way (on the H200 a gap of 5e-5 flipped an expert, and every later position differed)
ROUTING_DRAWS = 8
#: greedy tokens allowed to differ from transformers' (each only where its top two logits nearly tie)
MAX_NEAR_TIES = 2

LLAMA = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256)
LLAMA3_ROPE = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=500000.0,
                   max_position_embeddings=256,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
MIXTRAL = dict(vocab_size=1000, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=256,
               num_local_experts=8, num_experts_per_tok=2)
# Qwen2-MoE (Qwen2MoeForCausalLM) is left out: besides its routed experts every layer has a shared
# expert whose output is scaled by sigmoid(shared_expert_gate(x)), and q/k/v have biases. LlamaConfig
# expresses neither (from_hf refuses model_type 'qwen2_moe', checked below): running it would be a
# different model. Its routing alone (norm_topk_prob False) is what LlamaConfig.norm_topk covers.


# -- helpers ----------------------------------------------------------------------------------------------


def hf_model(kind: str, seed: int, **config: Any) -> Any:
    """A transformers CausalLM ("llama" or "mixtral") in f32 with eager attention and seeded weights."""
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}[kind]
    # eager attention and (transformers 5) eager experts: the plain torch code, no fused or grouped kernels
    moe = {"experts_implementation": "eager"} if kind == "mixtral" else {}
    cfg = config_cls(**config, tie_word_embeddings=False, attn_implementation="eager", **moe)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    assert model.config._attn_implementation == "eager"
    assert getattr(model.config, "_experts_implementation", None) in (None, "eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.8, 1.2)  # RMSNorm weights
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:  # nn.Linear (out, in) and stacked experts (E, out, in): fan-in last
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.float().eval()


def to_opdispatch(model: Any, **overrides: Any) -> LlamaModel:
    """opdispatch's LlamaModel of a transformers model: its config by from_hf, its state dict as arrays."""
    cfg = LlamaConfig.from_hf(model.config.to_dict(), **overrides)
    return LlamaModel(cfg, state_dict_arrays(model.state_dict()))


def run_opdispatch(model: LlamaModel, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill, then `steps` greedy decode steps on DEVICE: (steps + 1 greedy tokens, logits of each step)."""
    gen = Generator(model, DEVICE)
    logits = [gen.forward(prompt)]
    tokens = [int(np.argmax(logits[-1][-1]))]
    for _ in range(steps):
        logits.append(gen.forward(tokens[-1:]))
        tokens.append(int(np.argmax(logits[-1][-1])))
    return tokens, logits


def run_transformers(model: Any, seq: list[int]) -> np.ndarray:
    """Logits (len(seq), vocab) as float32 of one forward over the whole sequence, on TORCH_DEVICE."""
    with torch.no_grad():
        out = model.to(TORCH_DEVICE)(input_ids=torch.tensor([seq], device=TORCH_DEVICE), use_cache=False)
    return out.logits[0].float().cpu().numpy()


@attrs.frozen
class Comparison:
    """Logits of our steps (prefill rows, then one row per decode step) against a reference's rows."""

    worst: float  # max over steps of max |diff| / max |ref| within the step
    prefill: float
    decode: float  # the worst decode step
    positions: int
    equal: int  # greedy tokens equal to the reference's argmax
    total: int
    differ: list[tuple[int, float]]  # (position, ref's logit of its argmax - ref's logit of our token)
    first_differ: int | None  # index in our tokens of the first that differs, None if none

    def line(self, what: str) -> str:
        return (f"hf-compare {what}: max |dlogit|/max|logit| = {self.worst:.2g} over {self.positions} positions "
                f"(prefill {self.prefill:.2g}, decode worst {self.decode:.2g}), greedy tokens equal "
                f"{self.equal}/{self.total}")


def compare(tokens: list[int], steps: list[np.ndarray], ref: np.ndarray) -> Comparison:
    """Our greedy tokens and step logits against reference logits over prompt + tokens[:-1]."""
    ours = np.concatenate(steps)
    assert ours.shape == ref.shape and np.isfinite(ours).all() and np.isfinite(ref).all()
    errs, at = [], 0
    for s in steps:
        r = ref[at:at + len(s)]
        errs.append(float(np.abs(s - r).max() / np.abs(r).max()))
        at += len(s)
    gen_rows = ref[len(steps[0]) - 1:]  # the rows whose argmax is a generated token
    ref_tokens = gen_rows.argmax(-1)
    differ = [(len(steps[0]) - 1 + i, float(gen_rows[i].max() - gen_rows[i, t]))
              for i, t in enumerate(tokens) if t != ref_tokens[i]]
    first = next((i for i, t in enumerate(tokens) if t != ref_tokens[i]), None)
    return Comparison(max(errs), errs[0], max(errs[1:], default=0.0), len(ref), len(tokens) - len(differ),
                      len(tokens), differ, first)


def assert_greedy_tokens(cmp: Comparison, ref: np.ndarray, bound: float) -> None:
    """Our tokens are transformers' greedy ones except at near-ties: its top two logits closer than the bound."""
    for pos, gap in cmp.differ:
        top2 = np.sort(ref[pos])[-2:]
        tie = bound * np.abs(ref[pos]).max()
        assert gap <= tie and top2[1] - top2[0] <= tie, (
            f"greedy token at position {pos} differs from transformers' and is no near-tie: its top logit is "
            f"{gap:.3g} above ours (bound {tie:.3g})")
    assert len(cmp.differ) <= MAX_NEAR_TIES, f"{len(cmp.differ)} greedy tokens differ (near-ties): {cmp.differ}"


def routing_near_tie(model: Any, seq: list[int], used: int, bound: float) -> int | None:
    """The first position where transformers' router, in some layer, ranks its `used`-th expert and the
    next within `bound` of the position's largest |router logit|; None where it never does."""
    with torch.no_grad():
        out = model.to(TORCH_DEVICE)(input_ids=torch.tensor([seq], device=TORCH_DEVICE), use_cache=False,
                                     output_router_logits=True)
    ties = []
    for layer_logits in out.router_logits:
        r = layer_logits.float().reshape(len(seq), -1).cpu().numpy()
        top = np.sort(r, axis=1)
        gap = top[:, -used] - top[:, -used - 1]
        ties += np.flatnonzero(gap <= bound * np.abs(r).max(axis=1)).tolist()
    return min(ties, default=None)


def check_f32(hf: Any, what: str, rng: np.random.Generator, experts_used: int = 0) -> Comparison:
    """Our f32 logits and greedy tokens against transformers'; for an MoE (`experts_used` > 0), on a prompt
    whose routing has no near-tie (ROUTING_DRAWS)."""
    model = to_opdispatch(hf, dtype="f32", cache_dtype="f32")
    for _ in range(ROUTING_DRAWS):
        prompt = rng.integers(0, model.cfg.vocab, PROMPT_LEN).tolist()
        tokens, steps = run_opdispatch(model, prompt, DECODE_STEPS)
        seq = prompt + tokens[:-1]
        if not experts_used or routing_near_tie(hf, seq, experts_used, F32_BOUND) is None:
            break
    else:
        pytest.fail(f"{what}: each of {ROUTING_DRAWS} prompts has a routing near-tie")
    ref = run_transformers(hf, seq)
    cmp = compare(tokens, steps, ref)
    print(cmp.line(what))
    assert cmp.worst <= F32_BOUND, cmp.line(what)
    assert_greedy_tokens(cmp, ref, F32_BOUND)
    return cmp


# -- f32: llama, llama with llama3 rope scaling, mixtral -------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("config", [LLAMA, LLAMA3_ROPE], ids=["llama-hd64", "llama3-rope-hd128"])
def test_llama_f32_matches_transformers(config: dict, seed: int, rng: np.random.Generator) -> None:
    hf = hf_model("llama", seed, **config)
    cfg = LlamaConfig.from_hf(hf.config.to_dict())
    # from_hf read what transformers runs (transformers 5 keeps rope_theta and the scaling in rope_parameters)
    assert (cfg.hidden, cfg.heads, cfg.kv_heads, cfg.layers) == (config["hidden_size"], config["num_attention_heads"],
                                                                 config["num_key_value_heads"],
                                                                 config["num_hidden_layers"])
    assert cfg.rope_base == config["rope_theta"] and cfg.rms_eps == config["rms_norm_eps"]
    assert (cfg.rope_freq_factors is not None) == ("rope_scaling" in config)
    check_f32(hf, f"llama f32 ({cfg.head_dim}-dim heads{', llama3 rope' if 'rope_scaling' in config else ''})",
              rng)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [4, 8])
def test_mixtral_f32_matches_transformers(experts: int, seed: int, rng: np.random.Generator) -> None:
    hf = hf_model("mixtral", seed, **{**MIXTRAL, "num_local_experts": experts})
    cfg = LlamaConfig.from_hf(hf.config.to_dict())
    assert (cfg.experts, cfg.experts_used, cfg.norm_topk, cfg.rope_base) == (experts, 2, True, 1e6)
    check_f32(hf, f"mixtral f32 ({experts} experts, 2 used)", rng, experts_used=cfg.experts_used)


def test_qwen2_moe_is_refused_not_approximated() -> None:
    if not hasattr(transformers, "Qwen2MoeConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen2MoeConfig")
    config = transformers.Qwen2MoeConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2).to_dict()
    with pytest.raises(ValueError, match="qwen2_moe"):
        LlamaConfig.from_hf(config)


# -- f16 / bf16 ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_llama_half_precision_against_transformers(dtype: str, seed: int, rng: np.random.Generator) -> None:
    """opdispatch with f16/bf16 weights and an f16 cache, against transformers in f32 and in the same type."""
    hf = hf_model("llama", seed, **LLAMA)
    hf_low = copy.deepcopy(hf).to({"f16": torch.float16, "bf16": torch.bfloat16}[dtype])
    model = to_opdispatch(hf, dtype=dtype, cache_dtype="f16")  # weights rounded from f32 as transformers' .to()
    prompt = rng.integers(0, model.cfg.vocab, PROMPT_LEN).tolist()
    tokens, steps = run_opdispatch(model, prompt, DECODE_STEPS)
    seq = prompt + tokens[:-1]
    ref32, ref_low = run_transformers(hf, seq), run_transformers(hf_low, seq)
    vs32, vs_low = compare(tokens, steps, ref32), compare(tokens, steps, ref_low)
    # transformers' own error in this type: the yardstick for ours
    own = float(np.abs(ref_low - ref32).max() / np.abs(ref32).max())
    line = (f"hf-compare llama {dtype}: max |dlogit|/max|logit| = {vs32.worst:.2g} vs transformers f32, "
            f"{vs_low.worst:.2g} vs transformers {dtype} (whose own error vs f32 is {own:.2g}), over "
            f"{vs32.positions} positions, greedy tokens equal {vs32.equal}/{vs32.total} (f32's argmax)")
    print(line)
    bound = HALF_BOUNDS[dtype]
    assert vs32.worst <= bound and vs_low.worst <= bound, line
    assert vs32.worst <= HALF_VS_TRANSFORMERS * own, line
    assert_greedy_tokens_loosely(vs32, ref32, bound)


def assert_greedy_tokens_loosely(cmp: Comparison, ref: np.ndarray, bound: float) -> None:
    """In f16/bf16 a token may differ from f32's greedy one only where f32's logits are within the type's bound."""
    for pos, gap in cmp.differ:
        assert gap <= bound * np.abs(ref[pos]).max(), f"position {pos}: f32's top logit is {gap:.3g} above ours"
