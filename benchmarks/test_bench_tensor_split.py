"""The `1b` preset's greedy decode on one GPU and tensor-split over two (docs/multi-device.md#the-tensor-split).

Weights bf16, drawn in their stored format (opdispatch.models.llama.stored.random_params); one sequence holds CTX
prefilled tokens; a timed round is Generator.decode_greedy of GREEDY_STEPS steps from position CTX (the
tokens picked and fed back on the GPUs, the steps queued without waiting), as test_bench_model's decode
rows. The target (issue 21): the tensor split at least 1.5x one GPU at batch 1. Where it falls short,
`OPDISPATCH_BENCH_NCCL_PROTO` (e.g. LL) is passed to NCCL as NCCL_PROTO before the communicators are
made: a decode step's all-reduces are 2 a layer of 8 KiB each, latency-bound.
"""

from __future__ import annotations

import os
import time

import attrs
import numpy as np
import pytest

from bench import device_seconds

from opdispatch.backends.cuda.devices import discover
from opdispatch.models.llama.stored import random_params

pytestmark = pytest.mark.gpu

CTX, MAX_CTX, GREEDY_STEPS, ROUNDS = 512, 1024, 128, 5


def _decode_ms(gen, vocab: int) -> float:  # noqa: ANN001 - a Generator
    first = [int(np.random.default_rng(2).integers(0, vocab))]
    prompt = np.random.default_rng(1).integers(0, vocab, CTX).tolist()
    gen.reset()
    gen.forward(prompt)

    def step() -> None:
        gen.lengths[:1] = [CTX]
        gen.decode_greedy(first, GREEDY_STEPS)

    step()  # binds: kernels, NCCL's connections, the CUDA graphs
    return device_seconds(step, lambda: None, reps=1, rounds=ROUNDS) / GREEDY_STEPS * 1e3


def test_tensor_split_decode_against_one_gpu(benchmark) -> None:  # noqa: ANN001
    devices, why = discover()
    if len(devices) < 2:
        pytest.skip(f"needs two CUDA GPUs, found {len(devices)}" + (f" ({why})" if why else ""))
    if os.environ.get("OPDISPATCH_BENCH_NCCL_PROTO"):
        os.environ["NCCL_PROTO"] = os.environ["OPDISPATCH_BENCH_NCCL_PROTO"]
    from opdispatch.models.generate import Generator
    from opdispatch.models.llama.config import PRESETS
    from opdispatch.models.llama.model import LlamaModel

    cfg = attrs.evolve(PRESETS["1b"], max_ctx=MAX_CTX)
    model = LlamaModel(cfg, random_params(cfg))
    t0 = time.perf_counter()
    one = _decode_ms(Generator(model, "cuda0"), cfg.vocab)
    gen = Generator(model, devices=["cuda0", "cuda1"], split="tensor")
    two = _decode_ms(gen, cfg.vocab)
    same = Generator(model, "cuda0").generate(list(range(5, 37)), 32).tokens == gen.generate(
        list(range(5, 37)), 32).tokens
    info = {"one_gpu_ms/token": one, "tensor_split_ms/token": two, "speedup": one / two, "same_tokens": same,
            "nccl_proto": os.environ.get("NCCL_PROTO", "default"), "setup_s": time.perf_counter() - t0}
    benchmark.extra_info.update(info)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\n1b bf16 greedy decode b1 at {CTX}: one GPU {one:.3f} ms/token, tensor split over 2 {two:.3f} ms/token "
          f"= {one / two:.2f}x (target 1.5x); same tokens: {same}")
