"""Benchmark fixtures: GPU-only, each figure a ratio against a baseline measured in the same run.

Times come from bench.device_seconds (back-to-back runs, one synchronize); the
figures of one benchmark that are compared (ours, torch's, the same-size copy, an unfused plan)
are timed in interleaved rounds (bench.interleaved_seconds).
Bytes (inputs + output) or FLOPs are counted by each benchmark explicitly and
stored in `extra_info`, with the derived GB/s, the fraction of the copy
bandwidth measured here (a 1 GiB copy), the fraction a copy of the same
bytes reaches with the same timing (the ceiling at that size: launch and
ramp costs weigh on small sizes), and the ratio to torch.

`measure` times one plan run after another. `measure_cold` is for ops whose data
fits in the L2 (the mat-vecs, rope at 4096 tokens): its plan holds 32 or more
instances of the op, taking several input sets in turn (256 MB in all), run as
one CUDA graph, so each instance reads cold data with no host launch before it,
as in a decode step; torch and the same-size copy run the same way, in a torch
CUDA graph.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

import pytest
from bench import Cold, device_seconds, interleaved_seconds, torch_graph

from opdispatch.backends.cuda.devices import discover


def _require_gpu() -> None:
    devices, why = discover()
    if not devices:
        pytest.skip(f"benchmarks need a CUDA GPU: {why}")
    pytest.importorskip("torch")


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
    """measure(plan, nbytes, torch_fn) -> records GB/s, % of copy bandwidth, ratio to torch; for byte
    counts (no flops), also what a copy of that many bytes reaches with the same timing."""

    def run(plan, nbytes: int, torch_fn: Callable[[], object] | None, flops: int = 0) -> dict:  # noqa: ANN001
        torch = torch_cuda
        timed = [(plan.launch, plan.synchronize)]
        if not flops:
            # The ceiling at this size: a device copy moving the same bytes (half read, half written),
            # timed the same way, as a fraction of the 1 GiB copy's bandwidth.
            src = torch.empty(nbytes // 8, device="cuda", dtype=torch.float32).uniform_()
            dst = torch.empty_like(src)
            timed.append((lambda: dst.copy_(src), torch.cuda.synchronize))
        if torch_fn is not None:
            timed.append((torch_fn, torch.cuda.synchronize))
        ours, *rest = interleaved_seconds(timed)
        info = _bandwidth(nbytes, ours, copy_bandwidth)
        if flops:
            info["TFLOP/s"] = flops / ours / 1e12
        else:
            info["same_size_copy_fraction"] = 8 * src.numel() / rest.pop(0) / copy_bandwidth
            del src, dst
        return _record(benchmark, plan, info, ours, rest[0] if rest else None)

    return run


def _bandwidth(nbytes: int, secs: float, copy_bandwidth: float) -> dict:
    """The figures of `nbytes` moved in `secs`: GB/s and the fraction of the copy bandwidth."""
    return {"bytes": nbytes, "us": secs * 1e6, "GB/s": nbytes / secs / 1e9,
            "copy_fraction": nbytes / secs / copy_bandwidth, "copy_GB/s": copy_bandwidth / 1e9}


def _record(benchmark, plan, info: dict, ours: float, theirs: float | None) -> dict:  # noqa: ANN001
    """`info` with the ratio to torch (when `theirs`, torch's seconds, was measured) into the benchmark's
    extra_info, then pytest-benchmark's own rounds of `plan`."""
    if theirs is not None:
        info["torch_us"] = theirs * 1e6
        info["speedup_vs_torch"] = theirs / ours
    benchmark.extra_info.update(info)
    benchmark.pedantic(lambda: (plan.launch(), plan.synchronize()), rounds=5, iterations=1)
    return info


@pytest.fixture
def measure_cold(benchmark, torch_cuda, copy_bandwidth):  # noqa: ANN001, ANN201
    """measure_cold(plan, layout, nbytes, torch_fn, also) for a plan computing layout.instances instances of
    one op, instance i on input set layout.of(i) (bench.cold), each with its own output: `us` is one plan
    run (one CUDA graph) over the instances, `nbytes` one instance's bytes. torch_fn(i) issues torch's
    instance i; torch's instances and as many same-size copies (layout.sets source/destination pairs
    in turn) are timed in a torch CUDA graph. `also` names other plans of ours over the same instances
    (the unfused pair of a fusion), timed in the same rounds: f"{name}_us" an instance."""

    def run(plan, layout: Cold, nbytes: int, torch_fn: Callable[[int], object] | None,  # noqa: ANN001
            also: Mapping[str, Any] = MappingProxyType({})) -> dict:
        torch = torch_cuda
        n = layout.instances
        pairs = [(torch.empty(nbytes // 8, device="cuda").uniform_(), torch.empty(nbytes // 8, device="cuda"))
                 for _ in range(layout.sets)]
        timed = [(plan.launch, plan.synchronize),
                 (torch_graph(torch, lambda: [pairs[layout.of(i)][1].copy_(pairs[layout.of(i)][0]) for i in range(n)]),
                  torch.cuda.synchronize)]
        timed += [(other.launch, other.synchronize) for other in also.values()]
        if torch_fn is not None:
            timed.append((torch_graph(torch, lambda: [torch_fn(i) for i in range(n)]), torch.cuda.synchronize))
        ours, same, *rest = (s / n for s in interleaved_seconds(timed))
        info = {**_bandwidth(nbytes, ours, copy_bandwidth), "sets": layout.sets, "instances": n,
                "same_size_copy_fraction": 8 * (nbytes // 8) / same / copy_bandwidth,
                **{f"{name}_us": secs * 1e6 for name, secs in zip(also, rest)}}
        theirs = rest[len(also):]
        del pairs, timed
        return _record(benchmark, plan, info, ours, theirs[0] if theirs else None)

    return run
