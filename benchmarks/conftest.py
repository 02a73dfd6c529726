"""Benchmark fixtures: GPU-only, each figure a ratio against a baseline measured in the same run.

A benchmark times `REPS` back-to-back runs then one synchronize, so the
launch and sync overheads of one call are amortised the same way for
opdispatch and for torch. Bytes (inputs + output) or FLOPs are counted by
each benchmark explicitly and stored in `extra_info`, with the derived GB/s,
the fraction of the copy bandwidth measured here, and the ratio to torch.
"""

from __future__ import annotations

import time
from typing import Callable

import pytest

from opdispatch.backends.cuda.devices import discover

REPS = 20


def _require_gpu() -> None:
    devices, why = discover()
    if not devices:
        pytest.skip(f"benchmarks need a CUDA GPU: {why}")
    pytest.importorskip("torch")


def device_seconds(fn: Callable[[], None], sync: Callable[[], None], reps: int = REPS, rounds: int = 15) -> float:
    """Median seconds of one call of `fn`, timed over `reps` calls per round."""
    fn()
    sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / reps)
    times.sort()
    return times[len(times) // 2]


@pytest.fixture(scope="session")
def torch_cuda():  # noqa: ANN201
    _require_gpu()
    import torch

    return torch


@pytest.fixture(scope="session")
def copy_bandwidth(torch_cuda) -> float:  # noqa: ANN001
    """Device copy bandwidth in bytes/s (read + write), measured now on 1 GiB."""
    torch = torch_cuda
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    secs = device_seconds(lambda: dst.copy_(src), torch.cuda.synchronize)
    return 2 * src.numel() * 4 / secs


@pytest.fixture
def measure(benchmark, torch_cuda, copy_bandwidth):  # noqa: ANN001, ANN201
    """measure(plan, nbytes, torch_fn) -> records GB/s, % of copy bandwidth, ratio to torch."""

    def run(plan, nbytes: int, torch_fn: Callable[[], object] | None, flops: int = 0) -> dict:  # noqa: ANN001
        torch = torch_cuda
        ours = device_seconds(plan.launch, plan.synchronize)
        info = {"bytes": nbytes, "us": ours * 1e6, "GB/s": nbytes / ours / 1e9,
                "copy_fraction": nbytes / ours / copy_bandwidth, "copy_GB/s": copy_bandwidth / 1e9}
        if flops:
            info["TFLOP/s"] = flops / ours / 1e12
        if torch_fn is not None:
            theirs = device_seconds(torch_fn, torch.cuda.synchronize)
            info["torch_us"] = theirs * 1e6
            info["speedup_vs_torch"] = theirs / ours
        benchmark.extra_info.update(info)
        benchmark.pedantic(lambda: (plan.launch(), plan.synchronize()), rounds=5, iterations=1)
        return info

    return run
