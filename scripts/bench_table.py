"""Print markdown tables from a pytest-benchmark JSON written by the benchmarks.

Op benchmarks go in the first table (fused plans against their unfused one after it); model benchmarks (benchmarks/test_bench_model.py, whose
extra_info names a "preset") in a second: tokens/s, % of the HBM roofline, the transformers
baselines and the speedup over them; benchmarks of a model split over two GPUs (benchmarks/test_bench_split.py,
whose extra_info names a "split") in a third: one GPU's tokens/s and the split's, the speedup and its target, and
the split's agreement with one GPU.
"""

from __future__ import annotations

import json
import sys


def _fmt(v: object, spec: str) -> str:
    if isinstance(v, (int, float)):
        return format(v, spec)
    return "n/a" if isinstance(v, str) and v.startswith("n/a") else ("" if v is None else str(v))


def table(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    machine = data.get("machine_info", {})
    benches = data.get("benchmarks", [])
    ops = [b for b in benches if "preset" not in b.get("extra_info", {})]
    splits = [b for b in benches if "split" in b.get("extra_info", {})]
    models = [b for b in benches if "preset" in b.get("extra_info", {}) and b not in splits]
    rows = [f"machine: {machine.get('node', '?')}, {machine.get('cpu', {}).get('brand_raw', '')}"]
    if ops:
        rows += ["",
                 "| benchmark | us | GB/s | % copy BW | same-size copy % | TFLOP/s | torch us | speedup vs torch |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for b in ops:
        e = b.get("extra_info", {})

        def cell(key: str, fmt: str) -> str:
            return format(e[key], fmt) if key in e else ""

        frac = format(100 * e["copy_fraction"], ".0f") + "%" if "copy_fraction" in e else ""
        same = format(100 * e["same_size_copy_fraction"], ".0f") + "%" if "same_size_copy_fraction" in e else ""
        rows.append(f"| {b['name']} | {cell('us', '.1f')} | {cell('GB/s', '.0f')} | {frac} | {same} | "
                    f"{cell('TFLOP/s', '.1f')} | {cell('torch_us', '.1f')} | {cell('speedup_vs_torch', '.2f')} |")
    fused = [b for b in ops if "unfused_us" in b.get("extra_info", {})]
    if fused:
        rows += ["", "fused against the unfused plan, same run:"]
        rows += [f"- {b['name']}: {b['extra_info']['us']:.1f} us, unfused {b['extra_info']['unfused_us']:.1f} us "
                 f"({b['extra_info']['unfused_us'] / b['extra_info']['us']:.2f}x)" for b in fused]
    if models:
        rows += ["",
                 "| preset | dtype | kind | batch | mode | tokens/s | ms/step | device ms | host ms | % roofline | "
                 "host-pick tokens/s | HF eager tokens/s | torch.compile tokens/s | speedup vs HF | speedup vs compile |",
                 "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for b in models:
        e = b["extra_info"]
        roof = _fmt(100 * e["roofline"], ".0f") + "%" if isinstance(e.get("roofline"), float) else ""
        hf = _fmt(e.get("hf_eager_tokens/s"), ".1f")
        if hf and e.get("hf_dtype") not in (None, e.get("dtype")):
            hf += f" ({e['hf_dtype']})"
        rows.append(
            f"| {e['preset']} | {e['dtype']} | {e.get('kind', 'decode')} | {e['batch']} | {e['mode']} | "
            f"{_fmt(e.get('tokens/s'), '.0f')} | {_fmt(e.get('step_ms'), '.3f')} | {_fmt(e.get('device_ms'), '.3f')} | "
            f"{_fmt(e.get('host_ms'), '.3f')} | {roof} | {_fmt(e.get('host_pick_tokens/s'), '.0f')} | {hf} | "
            f"{_fmt(e.get('torch_compile_tokens/s'), '.0f')} | "
            f"{_fmt(e.get('speedup_vs_hf'), '.1f')} | {_fmt(e.get('speedup_vs_compile'), '.2f')} |")
    if splits:
        rows += ["", split_table(splits)]
    reasons = sorted({str(e[k]) for b in models for e in [b["extra_info"]]
                      for k in ("hf_eager_tokens/s", "torch_compile_tokens/s") if str(e.get(k, "")).startswith("n/a")})
    if reasons:
        rows.append("\nbaselines not measured: " + "; ".join(reasons))
    copy = next((b["extra_info"].get("copy_GB/s") for b in benches if "copy_GB/s" in b.get("extra_info", {})), None)
    if copy:
        rows.append(f"\ncopy bandwidth measured in this run: {copy:.0f} GB/s")
    return "\n".join(rows)


def split_table(benches: list[dict]) -> str:
    """The split benchmarks' rows: one GPU against two, the target (issue 21) and whether it is met."""
    rows = ["| split | preset | dtype | batch | one GPU tokens/s | two GPUs tokens/s | speedup | target | "
            "logits NMSE vs one GPU | same greedy tokens |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for b in benches:
        e = b["extra_info"]
        target = "none" if e.get("target") is None else f">= {e['target']}x: {'met' if e.get('met') else 'NOT met'}"
        rows.append(f"| {e['split']} | {e['preset']} | {e.get('dtype', '')} | {e.get('batch', '')} | "
                    f"{_fmt(e.get('one_gpu_tokens/s'), '.0f')} | {_fmt(e.get('two_gpu_tokens/s'), '.0f')} | "
                    f"{_fmt(e.get('speedup'), '.2f')} | {target} | {_fmt(e.get('logits_nmse'), '.2g')} | "
                    f"{_fmt(e.get('same_tokens'), '')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(sys.argv[1]))
