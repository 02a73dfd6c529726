"""The `1b` preset end to end beside transformers: decode and prefill tokens/s, and the HBM roofline.

Model: PRESETS["1b"] (hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocab
32000), max_ctx 1024, a KV cache of 16 sequences, weights in bf16, f16,
q8_0 or q4_0, or in llama-quantize's Q4_K_M mixture (q4_K, q6_K for the
output and the attn_v/ffn_down of the layers its use_more_bits picks: those
layers' q/k/v stay three projections); at batch-1 decode also its Q4_0,
Q5_K_M, Q6_K and IQ4_XS mixtures (DOWNLOADS). Speed does not depend on the values,
so the weights are drawn directly in their stored format from one random
pool a type (opdispatch.models.llama.stored.random_params) instead of
drawing 1.1B floats and quantizing them. Each layer's
q/k/v projections are stacked into one where their types agree (LlamaModel's
stack_qkv).

- decode, batch B (1 or 16): every sequence holds CTX (512) prefilled tokens
  (one batched prefill step fills all 16); a timed round is Generator.decode_greedy:
  GREEDY_STEPS (128) greedy decode steps per sequence from position CTX (a generation
  of 128 tokens; on the H200 a 20-step call ran 0.925 ms a step, a 200-step one
  0.872: the call has costs of its own, spread here as a generation spreads them), each step's token
  the previous step's argmax, picked and fed back on the GPU, the steps queued
  without waiting (Plan.submit; the host writes each step's positions and
  mask), the tokens read once at the end, as generate() runs greedy decoding.
  step_ms is a round over GREEDY_STEPS. `device_ms` is the greedy step plan's launches
  alone (back to back, one synchronize), so host_ms = step_ms - device_ms.
  `host_pick_tokens/s`: a step that brings the logits back and picks on the host
  (what top-k/top-p sampling runs): Plan.run (one upload, the CUDA graph replay,
  the logits back) and numpy's argmax, at position CTX.
  Modes: default (fusion, CUDA graphs and programmatic dependent launch on),
  no-fusion, no-graphs, no-pdl (OPDISPATCH_PDL=0) (bf16 at batch 1 only).
- prefill: one sequence of PREFILL (512) tokens (LM head on the last one).
- roofline: weight bytes read per step (every matrix but the embedding, of
  which a step reads B rows) over the copy bandwidth measured in this run
  (`copy_bandwidth`), divided by the step time: 1.0 would read the weights
  at copy speed. The KV cache read (kv_bytes) is left out of it.

Baselines, same process, same shape: transformers' LlamaForCausalLM, random
weights, built on the GPU in bf16 (f16 for the f16 rows; q8_0/q4_0 rows
compare with bf16, torch has no such kernels): eager decode with its dynamic
KV cache after a CTX-token prefill (a few steps, so the context grows by a
few tokens; the argmax stays on the GPU and one synchronize ends the loop),
eager prefill; and `torch.compile(mode="reduce-overhead")` decode with a
StaticCache at position CTX (the argmax fed back on the GPU, one synchronize
after STEPS steps), run in one subprocess per batch under a time
limit each (OPDISPATCH_BENCH_COMPILE_S, default 180; OPDISPATCH_BENCH_COMPILE=0
skips it): a compile that fails or runs past the limit records "n/a" with the
reason (a device-side assert's own message from the child's stderr) instead
of failing. It runs once per batch, bf16, and its rows are bf16's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

import attrs
import numpy as np
import pytest

from bench import device_seconds

from opdispatch.models.llama.stored import random_params

pytestmark = pytest.mark.gpu

CTX = 512  # prefilled tokens per sequence before the timed decode step
PREFILL = 512  # tokens of the timed prefill
MAX_CTX = 1024
MAX_SEQS = 16
PRESET, DEVICE = "1b", "cuda0"
STEPS, ROUNDS = 20, 5  # decode steps per timed round, rounds (median)
GREEDY_STEPS = 128  # steps of one timed decode_greedy call: a generation of 128 tokens after CTX
HF_STEPS = 5
COMPILE_S = float(os.environ.get("OPDISPATCH_BENCH_COMPILE_S", "180"))
#: the file types people download, timed at batch-1 decode only (issue 18's tokens/s table): llama-quantize's
#: Q4_0 (q4_0, its output q6_K), Q5_K_M, Q6_K and IQ4_XS mixtures
DOWNLOADS = ("Q4_0", "Q5_K_M", "Q6_K", "IQ4_XS")
HF_DTYPE = {"bf16": "bf16", "f16": "f16", "q8_0": "bf16", "q4_0": "bf16", "Q4_K_M": "bf16",
            **{ft: "bf16" for ft in DOWNLOADS}}

#: (weights, kind, batch, mode), in run order: one weights' model at a time. weights: a dtype for every
#: matrix, or a file type of llama-quantize's ("Q4_K_M": q4_K, some q6_K), its mixture
CASES = [
    ("bf16", "decode", 1, "default"), ("bf16", "decode", 16, "default"), ("bf16", "prefill", 1, "default"),
    ("bf16", "decode", 1, "no-fusion"), ("bf16", "decode", 1, "no-graphs"), ("bf16", "decode", 1, "no-pdl"),
    *[(dt, kind, b, "default") for dt in ("f16", "q8_0", "q4_0", "Q4_K_M")
      for kind, b in (("decode", 1), ("decode", 16), ("prefill", 1))],
    *[(ft, "decode", 1, "default") for ft in DOWNLOADS],
]


def matrix_dtype(weights: str) -> str:
    """cfg.dtype for a weights row: the dtype itself, or a file type's default (Q4_K_M: q4_K, its commonest)."""
    from opdispatch.models.mixture import PRESETS as FILE_TYPES

    return FILE_TYPES[weights].default if weights in FILE_TYPES else weights


@attrs.define
class Setup:
    """One dtype's model on cuda0: its generators per mode, weight bytes, prefilled caches."""

    dtype: str
    model: Any
    weight_bytes: int
    matrix_params: int
    kv_bytes_per_seq: int
    gens: dict[str, Any] = attrs.field(factory=dict)


_SETUPS: dict[str, Setup] = {}


def setup_for(dtype: str) -> Setup:
    from opdispatch.models.generate import Generator
    from opdispatch.models.llama.config import PRESETS
    from opdispatch.models.llama.model import LlamaModel

    if dtype in _SETUPS:
        return _SETUPS[dtype]
    _SETUPS.clear()  # one dtype at a time (CASES are grouped by dtype)
    t0 = time.perf_counter()
    cfg = attrs.evolve(PRESETS[PRESET], dtype=matrix_dtype(dtype), max_ctx=MAX_CTX)
    model = LlamaModel(cfg, random_params(cfg, weights=dtype), max_seqs=MAX_SEQS, stack_qkv=True)
    embed = model.embed
    read = [t for t in {id(t): t for t in model.params.values()}.values() if t is not embed]
    weight_bytes = sum(t.nbytes for t in read)
    matrix_params = sum(int(np.prod(t.shape)) for t in read if t.ndim == 2)
    kv = 2 * cfg.layers * (CTX + 1) * cfg.kv_dim * (2 if cfg.cache_dtype in ("f16", "bf16") else 4)
    s = Setup(dtype, model, weight_bytes, matrix_params, kv)
    gen = s.gens["default"] = Generator(model, DEVICE, batch=MAX_SEQS)
    # Fill every sequence's cache with CTX tokens: one batched prefill step (LM head on the last rows).
    prompts = np.random.default_rng(1).integers(0, cfg.vocab, (MAX_SEQS, CTX)).tolist()
    gen.forward_batch(prompts, last=True)
    print(f"\n{dtype}: model built, uploaded and prefilled ({MAX_SEQS} x {CTX} tokens) in "
          f"{time.perf_counter() - t0:.1f} s; compile {gen.compile_s:.1f} s", file=sys.stderr)
    _SETUPS[dtype] = s
    return s


def median_seconds(step: Callable[[], object], steps: int = STEPS, rounds: int = ROUNDS) -> float:
    """bench.device_seconds for a step that waits for its own result (nothing left to synchronize)."""
    return device_seconds(step, lambda: None, reps=steps, rounds=rounds)


# -- transformers baselines ---------------------------------------------------------------------------


def hf_config() -> Any:
    from transformers import LlamaConfig as HFConfig

    return HFConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rms_norm_eps=1e-5,
                    rope_theta=10000.0, tie_word_embeddings=False)


def hf_model(torch: Any, dtype: str) -> Any:
    """LlamaForCausalLM with random weights, made on the GPU (no slow CPU init), in bf16 or f16."""
    from transformers import LlamaForCausalLM

    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(tdt)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(hf_config())
    finally:
        torch.set_default_dtype(old)
    return model.to(tdt).eval()


_HF: dict[str, Any] = {}
_HF_RESULTS: dict[tuple[str, str, int], float] = {}


def hf_tokens_per_s(torch: Any, dtype: str, kind: str, batch: int) -> float:
    """transformers eager tokens/s (cached per dtype, kind, batch)."""
    key = (dtype, kind, batch)
    if key in _HF_RESULTS:
        return _HF_RESULTS[key]
    if dtype not in _HF:
        _HF.clear()
        torch.cuda.empty_cache()
        _HF[dtype] = hf_model(torch, dtype)
    model = _HF[dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        if kind == "prefill":
            ids = torch.randint(0, 32000, (1, PREFILL), device="cuda", generator=gen)
            model(ids, use_cache=False)
            torch.cuda.synchronize()
            secs = median_seconds(lambda: (model(ids, use_cache=False), torch.cuda.synchronize()), 1, 3)
            tps = PREFILL / secs
        else:
            ids = torch.randint(0, 32000, (batch, CTX), device="cuda", generator=gen)
            out = model(ids, use_cache=True)
            pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(2):
                out = model(tok, past_key_values=pkv, use_cache=True)
                pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(HF_STEPS):
                out = model(tok, past_key_values=pkv, use_cache=True)
                pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            tps = batch * HF_STEPS / (time.perf_counter() - t0)
            del out, pkv
    _HF_RESULTS[key] = tps
    return tps


_COMPILED: dict[int, float | str] = {}


def torch_compile_tokens_per_s(batch: int) -> float | str:
    """torch.compile decode tokens/s at `batch` (bf16), or 'n/a: why'. One subprocess per batch: a device-side
    assert poisons the CUDA context of its process, so one batch's failure must not take the other down."""
    if batch not in _COMPILED:
        if os.environ.get("OPDISPATCH_BENCH_COMPILE", "1") == "0":
            _COMPILED[batch] = "n/a: skipped"
        else:
            _COMPILED.update(_run_compile_child(batch))
    return _COMPILED.get(batch, "n/a")


def _run_compile_child(batch: int) -> dict[int, float | str]:
    cmd = [sys.executable, __file__, "--torch-compile", str(batch)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_S)
        out, err, why = done.stdout, done.stderr, f"exit status {done.returncode}"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        why = f"over the {COMPILE_S:.0f} s limit"
    got: dict[int, float | str] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            got[int(r["batch"])] = r["tps"] if "tps" in r else f"n/a: {r['error']}"
    # A device-side assert names its index check on stderr (Triton: "Assertion `index out of bounds: ...`
    # failed", ATen: "...Assertion `srcIndex < srcSelectDimSize` failed"): keep the first in the reason.
    asserts = [ln.strip() for ln in err.splitlines() if "Assertion" in ln or "index out of bounds" in ln]
    if batch in got and isinstance(got[batch], str) and asserts:
        got[batch] += f" [{asserts[0][:200]}]"
    if batch not in got:
        last = (asserts or err.strip().splitlines() or [""])[-1][:200]
        got[batch] = f"n/a: {why}" + (f" ({last})" if last else "")
    print(f"\ntorch.compile child (batch {batch}): {time.perf_counter() - t0:.1f} s: {got}", file=sys.stderr)
    if err.strip() and not isinstance(got.get(batch), float):
        print("torch.compile child stderr (last 40 lines):\n" + "\n".join(err.strip().splitlines()[-40:]),
              file=sys.stderr)
    return got


#: StaticCache rows beyond the CTX prefilled ones (the timed steps all write row CTX)
COMPILE_CACHE_MARGIN = 64


def _compile_child(batches: list[int]) -> None:
    """Run in a subprocess: torch.compile(reduce-overhead) decode with a StaticCache; a JSON line per batch.

    Every index the model takes is explicit and in range: token ids < vocab, cache_position (long) CTX <
    max_cache_len = CTX + COMPILE_CACHE_MARGIN, position_ids (long, (batch, 1)) = CTX < max_position_embeddings,
    and the cache is made for this batch on the GPU in bf16 (transformers 5's StaticCache takes config and
    max_cache_len and sizes its layers from the first update; transformers 4's takes max_batch_size, device and
    dtype). A prefill of CTX tokens (eager) fills rows 0..CTX-1 first.
    """
    import inspect

    import torch
    from transformers import StaticCache

    model = hf_model(torch, "bf16")
    vocab = model.config.vocab_size
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)
    for batch in batches:
        try:
            max_len = CTX + COMPILE_CACHE_MARGIN
            params = inspect.signature(StaticCache.__init__).parameters
            kw: dict[str, Any] = dict(config=model.config, max_cache_len=max_len)
            for name, value in (("max_batch_size", batch), ("batch_size", batch), ("device", "cuda"),
                                ("dtype", torch.bfloat16)):
                if name in params:  # transformers 4.x; 5.x swallows unknown keywords, so ask the signature
                    kw[name] = value
            cache = StaticCache(**kw)
            gen = torch.Generator(device="cuda").manual_seed(0)
            ids = torch.randint(0, vocab, (batch, CTX), device="cuda", generator=gen, dtype=torch.long)
            with torch.inference_mode():
                model(input_ids=ids, past_key_values=cache, use_cache=True,
                      cache_position=torch.arange(CTX, device="cuda", dtype=torch.long),
                      position_ids=torch.arange(CTX, device="cuda", dtype=torch.long).expand(batch, CTX))
                torch.cuda.synchronize()  # a failure of the eager prefill is named as such
                tok = torch.zeros((batch, 1), dtype=torch.long, device="cuda")
                pos = torch.full((1,), CTX, dtype=torch.long, device="cuda")
                position_ids = torch.full((batch, 1), CTX, dtype=torch.long, device="cuda")

                def one() -> None:  # the greedy token stays on the GPU and feeds the next step, as ours does
                    out = step(input_ids=tok, past_key_values=cache, cache_position=pos, position_ids=position_ids,
                               use_cache=True)
                    tok.copy_(out.logits[:, -1:].argmax(-1))

                secs = device_seconds(one, torch.cuda.synchronize, reps=STEPS, rounds=3)
            print(json.dumps({"batch": batch, "tps": batch / secs}), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the parent records n/a
            print(json.dumps({"batch": batch, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}), flush=True)


def measure(s: Setup, gen: Any, kind: str, batch: int, copy_bandwidth: float) -> tuple[dict[str, Any], Callable]:
    """Our figures for one case, and the step that was timed."""
    vocab = s.model.cfg.vocab
    info: dict[str, Any] = {}
    if kind == "decode":
        first = [int(t) for t in np.random.default_rng(2).integers(0, vocab, batch)]

        def step() -> None:  # GREEDY_STEPS steps from position CTX, tokens picked and fed back on the GPU
            gen.lengths[:batch] = [CTX] * batch
            gen.decode_greedy(first, GREEDY_STEPS)

        step()  # binds (compiles kernels, captures the CUDA graph on the next run)
        secs = device_seconds(step, lambda: None, reps=1, rounds=ROUNDS) / GREEDY_STEPS
        plan, inp = gen.step(1, CTX, batch=batch, greedy=True)
        device = device_seconds(plan.launch, plan.synchronize, reps=STEPS, rounds=ROUNDS)
        # A step that brings the logits back and picks on the host (Generator.forward_batch, top-k/top-p).
        host_plan, host_inp = gen.step(1, CTX, batch=batch)
        toks = [[t] for t in first]

        def host_pick() -> None:
            (logits,) = host_plan.run(host_inp.feeds_batch(toks, [CTX] * batch), copy=False)
            logits.argmax(axis=-1)

        host_pick()
        host_pick_s = median_seconds(host_pick)
        gen.lengths[:batch] = [CTX] * batch
        info.update({"tokens/s": batch / secs, "ms/token": secs * 1e3 / batch, "step_ms": secs * 1e3,
                     "device_ms": device * 1e3, "host_ms": (secs - device) * 1e3,
                     "host_pick_tokens/s": batch / host_pick_s,
                     "weight_bytes": s.weight_bytes, "kv_bytes": batch * s.kv_bytes_per_seq,
                     "roofline": s.weight_bytes / copy_bandwidth / secs,
                     "copy_GB/s": copy_bandwidth / 1e9, "launches": plan.summary()["launches"]})
    else:
        plan, inp = gen.step(PREFILL, 0, batch=1, logits="last")
        toks = np.random.default_rng(3).integers(0, vocab, (1, PREFILL)).tolist()
        feeds = inp.feeds_batch(toks, [0])

        def step() -> None:
            plan.run(feeds, copy=False)

        step()
        secs = median_seconds(step, 3, 3)
        flops = 2 * s.matrix_params * PREFILL  # the matmuls; attention adds ~2% at 512 tokens
        info.update({"tokens/s": PREFILL / secs, "ms/token": secs * 1e3 / PREFILL, "step_ms": secs * 1e3,
                     "TFLOP/s": flops / secs / 1e12, "copy_GB/s": copy_bandwidth / 1e9})
    return info, step


# -- the benchmark --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, kind, batch, mode", CASES,
                         ids=[f"{d}-{k}-b{b}-{m}" for d, k, b, m in CASES])
def test_model(benchmark, torch_cuda, copy_bandwidth, monkeypatch, dtype: str, kind: str, batch: int,  # noqa: ANN001
               mode: str) -> None:
    from opdispatch.models.generate import Generator

    torch = torch_cuda
    s = setup_for(dtype)
    if mode == "no-graphs":
        # read when the plan is compiled (its cache key) and bound (its segments); this generator's plans only
        monkeypatch.setenv("OPDISPATCH_DISABLE_CUDA_GRAPHS", "1")
    if mode == "no-pdl":  # read when the plan is bound
        monkeypatch.setenv("OPDISPATCH_PDL", "0")
    if mode not in s.gens:
        s.gens[mode] = Generator(s.model, DEVICE, fusion=mode != "no-fusion", batch=MAX_SEQS)
    t0 = time.perf_counter()
    info, step = measure(s, s.gens[mode], kind, batch, copy_bandwidth)
    info = {"preset": PRESET, "dtype": dtype, "kind": kind, "batch": batch, "mode": mode, **info}
    ours_s = time.perf_counter() - t0
    hf_dtype = HF_DTYPE[dtype]
    try:
        hf = hf_tokens_per_s(torch, hf_dtype, kind, batch)
        info.update({"hf_eager_tokens/s": hf, "speedup_vs_hf": info["tokens/s"] / hf})
    except Exception as exc:  # noqa: BLE001 - a baseline that breaks is reported, ours still counts
        info["hf_eager_tokens/s"] = f"n/a: {type(exc).__name__}: {str(exc)[:120]}"
    info["hf_dtype"] = hf_dtype
    if kind == "decode" and mode == "default":
        tc = torch_compile_tokens_per_s(batch)
        info["torch_compile_tokens/s"] = tc
        if isinstance(tc, float):
            info["speedup_vs_compile"] = info["tokens/s"] / tc
    benchmark.extra_info.update(info)
    benchmark.pedantic(step, rounds=3, iterations=1)
    extra = (f", device {info['device_ms']:.3f} ms, host {info['host_ms']:.3f} ms, roofline "
             f"{100 * info['roofline']:.0f}%" if kind == "decode" else f", {info['TFLOP/s']:.0f} TFLOP/s")
    print(f"\n1b {dtype} {kind} b{batch} {mode}: {info['tokens/s']:.0f} tokens/s ({info['step_ms']:.3f} ms/step"
          f"{extra}); HF eager {info['hf_eager_tokens/s']}; ours measured in {ours_s:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--torch-compile":
        _compile_child([int(b) for b in sys.argv[2].split(",")])
    else:
        sys.exit("usage: test_bench_model.py --torch-compile 1[,16] (the torch.compile baseline, run by the benchmark)")
