"""Print a markdown table from a pytest-benchmark JSON written by the benchmarks."""

from __future__ import annotations

import json
import sys


def table(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    machine = data.get("machine_info", {})
    rows = [f"machine: {machine.get('node', '?')}, {machine.get('cpu', {}).get('brand_raw', '')}",
            "",
            "| benchmark | us | GB/s | % copy BW | TFLOP/s | torch us | speedup vs torch |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for b in data.get("benchmarks", []):
        e = b.get("extra_info", {})

        def cell(key: str, fmt: str) -> str:
            return format(e[key], fmt) if key in e else ""

        frac = format(100 * e["copy_fraction"], ".0f") + "%" if "copy_fraction" in e else ""
        rows.append(f"| {b['name']} | {cell('us', '.1f')} | {cell('GB/s', '.0f')} | {frac} | "
                    f"{cell('TFLOP/s', '.1f')} | {cell('torch_us', '.1f')} | {cell('speedup_vs_torch', '.2f')} |")
    copy = next((b["extra_info"].get("copy_GB/s") for b in data.get("benchmarks", []) if "copy_GB/s" in b.get("extra_info", {})), None)
    if copy:
        rows.append(f"\ncopy bandwidth measured in this run: {copy:.0f} GB/s")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(sys.argv[1]))
