"""The 1b preset's greedy decode step (or its 512-token prefill), kernel by kernel, on a GPU: what moved between two
commits, where a step goes.

    python3 scripts/decode_profile.py run LABEL [--batch B | --prefill] DTYPE...   one run: writes $OUT (or /tmp)/prof-LABEL.json
    python3 scripts/decode_profile.py table [DIR]          every prof-*.json of DIR side by side

A run builds the model (random weights in their stored format: opdispatch.models.llama.stored, of the checkout
installed now; DTYPE a dtype or a file type such as Q4_K_M), prefills 512 tokens in each of B sequences (1 unless
--batch), and times
`Generator.step(1, 512, batch=B, greedy=True)`'s plan (a token for each sequence); with --prefill, the plan of one
sequence's 512-token prefill instead (`Generator.step(512, 0, logits="last")`, as benchmarks/test_bench_model.py
times it). Either plan: its device time (3 medians of 15
rounds of 20 replays) and, through torch.profiler (CUPTI), each kernel's duration summed over 50 replays, by
kernel name without its parameter list (so that a kernel whose parameters changed still lines up). With
programmatic dependent launch on (the default) a kernel's duration includes its wait for the one before;
OPDISPATCH_PDL=0 gives durations without overlap. Either way the table also gives each kernel's time added to the
step in the last replay (its end minus the latest end before it; these sum to the replay's span), which is what a
kernel costs the step with the overlap, and that time again by launch grid (so that a kernel launched for several
weight shapes, such as a step's GEMMs, shows each shape's share). To compare commits, install each in turn (pip
install -e) and run this script from the repository root of each with a different LABEL.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
from typing import Callable, Sequence

REPS = 50
CTX = 512


def kernel_name(name: str) -> str:
    """A kernel's name without its parameter list."""
    return name.split("(")[0][:140]


def launch_shape(event: dict) -> str:
    """A kernel event's name without its parameter list, and its grid (the trace's args): one row for each
    shape a kernel is launched in (a step's GEMMs of different weights apart)."""
    return f"{kernel_name(event['name'])} grid {tuple(event.get('args', {}).get('grid', ()))}"


def added_by_kernel(events: Sequence[dict], replays: int,
                    key: Callable[[dict], str] = lambda e: kernel_name(e["name"])) -> dict[str, list[float]]:
    """{key (the kernel's name): [us added to the step, launches]} over the last of `replays` equal replays of a
    plan, from the kernel events of a chrome trace ("name", "ts" and "dur" in us): a kernel adds its end minus the
    latest end of the kernels that started before it (0 when one of them ends later), so the sum is the replay's
    span."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    last = kernels[len(kernels) - len(kernels) // replays:]
    added: dict[str, list[float]] = {}
    end = last[0]["ts"] if last else 0.0
    for e in last:
        stop = e["ts"] + e["dur"]
        row = added.setdefault(key(e), [0.0, 0])
        row[0] += max(0.0, stop - end)
        row[1] += 1
        end = max(end, stop)
    return added


def run(label: str, dtypes: list[str], batch: int = 1, prefill: bool = False) -> None:
    sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
    import attrs
    import numpy as np
    import torch
    from bench import device_seconds
    from test_bench_model import MAX_CTX, MAX_SEQS, matrix_dtype
    from torch.profiler import ProfilerActivity, profile

    from opdispatch.models.generate import Generator
    from opdispatch.models.llama.config import PRESETS
    from opdispatch.models.llama.model import LlamaModel
    from opdispatch.models.llama.stored import random_params

    out = {}
    for dt in dtypes:
        cfg = attrs.evolve(PRESETS["1b"], dtype=matrix_dtype(dt), max_ctx=MAX_CTX)
        model = LlamaModel(cfg, random_params(cfg, weights=dt), max_seqs=MAX_SEQS, stack_qkv=True)
        gen = Generator(model, "cuda0", batch=batch)
        if prefill:  # the same tokens every replay: each rewrites the cache rows 0 .. CTX - 1 alike
            plan, inp = gen.step(CTX, 0, batch=1, logits="last")
            plan.run(inp.feeds_batch(np.random.default_rng(3).integers(0, cfg.vocab, (1, CTX)).tolist(), [0]),
                     copy=False)
        else:
            gen.forward_batch(np.random.default_rng(1).integers(0, cfg.vocab, (batch, CTX)).tolist(), last=True)
            gen.decode_greedy([5] * batch, 8)  # binds the step plan and captures its CUDA graph
            gen.lengths[:batch] = [CTX] * batch
            plan, _ = gen.step(1, CTX, batch=batch, greedy=True)
        device = [device_seconds(plan.launch, plan.synchronize, reps=20, rounds=15) * 1e6 for _ in range(3)]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPS):
                plan.launch()
            plan.synchronize()
        kernels: dict[str, list[float]] = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None)
            t = e.cuda_time_total if t is None else t
            if t:
                name = kernel_name(e.key)
                us, calls = kernels.get(name, [0.0, 0.0])
                kernels[name] = [us + t / REPS, calls + e.count / REPS]
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
            with open(os.path.join(tmp, "trace.json")) as f:
                events = json.load(f)["traceEvents"]
        out[dt] = {"device_us": device, "kernels": kernels, "added": added_by_kernel(events, REPS),
                   "added_by_shape": added_by_kernel(events, REPS, launch_shape)}
        print(f"{label} {dt}: step device us {[round(d, 1) for d in device]}", flush=True)
        del gen, model, plan
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"prof-{label}.json"), "w") as f:
        json.dump(out, f)


def _section(cols: dict[str, dict[str, list[float]]], what: str, total: str) -> None:
    """One table section: a column a run ({kernel: [us, calls]}), kernels by their largest us, then the sums."""
    labels = list(cols)
    print("  " + " | ".join(f"{label:>12s}" for label in labels) + f" | calls | kernel ({what})")
    names = {k for c in cols.values() for k in c}
    for k in sorted(names, key=lambda k: -max(c.get(k, [0, 0])[0] for c in cols.values())):
        cells = [cols[label].get(k) for label in labels]
        calls = next(c[1] for c in cells if c)
        row = " | ".join(f"{c[0]:12.2f}" if c else f"{'-':>12s}" for c in cells)
        print(f"  {row} | {calls:5.1f} | {k[:90]}")
    sums = [sum(v[0] for v in c.values()) for c in cols.values()]
    print("  " + " | ".join(f"{t:12.2f}" for t in sums) + f" |       | {total}")


def table(folder: str) -> None:
    runs = {os.path.basename(p)[5:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{folder}/prof-*.json"))}
    for dt in sorted({dt for r in runs.values() for dt in r}):
        labels = [label for label, r in runs.items() if dt in r]
        print(f"\n== {dt}: step device us (3 medians each)")
        for label in labels:
            print(f"  {label:14s} {[round(x, 1) for x in runs[label][dt]['device_us']]}")
        _section({label: runs[label][dt]["kernels"] for label in labels}, "us a step", "all kernels")
        added = {label: runs[label][dt]["added"] for label in labels if "added" in runs[label][dt]}
        if added:
            _section(added, "us added to the last replay: its end past the latest end before it", "the replay's span")
        shapes = {label: runs[label][dt]["added_by_shape"] for label in labels if "added_by_shape" in runs[label][dt]}
        if shapes:
            _section(shapes, "us added to the last replay, by launch grid", "the replay's span")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) >= 4 and args[0] == "run" and args[2] == "--batch" and args[3].isdigit():
        run(args[1], args[4:], int(args[3]))
    elif len(args) >= 4 and args[0] == "run" and args[2] == "--prefill":
        run(args[1], args[3:], prefill=True)
    elif len(args) >= 3 and args[0] == "run" and not args[2].startswith("--"):
        run(args[1], args[2:])
    elif len(args) in (1, 2) and args[0] == "table":
        table(args[1] if len(args) == 2 else os.environ.get("OUT", "/tmp"))
    else:
        sys.exit(__doc__)
