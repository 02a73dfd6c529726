"""Where a kernel's instructions go, from Nsight Compute's per-instruction counters (on the GPU machine).

    ncu --kernel-name regex:NAME --launch-skip 2 --launch-count 1 --set full --import-source yes -o REPORT CMD...
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SASS.csv
    python3 scripts/sass_mix.py SASS.csv [--regions N]

prints the warp instructions executed, each opcode's count and share with its warp-stall samples, and the N
hottest regions: runs of consecutive instructions executed the same number of times, which is what an unrolled
loop body is (session 20 found the table formats' dot this way: 75% of the mxfp4 mat-vec's instructions in one
body of 1702, 32 byte permutes a 32-value unit), each with its own opcode mix. An opcode is the mnemonic without
its modifiers and predicate (`@!P0 IMAD.U32` counts as IMAD).
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from pathlib import Path

import attrs


@attrs.frozen
class Instruction:
    """One SASS instruction of the report: its text, times executed (by warps), warp-stall samples."""

    source: str
    executed: int
    stalls: int

    @property
    def opcode(self) -> str:
        words = self.source.split()
        if not words:
            return "?"
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        return op.split(".")[0]


@attrs.frozen
class Region:
    """Instructions first .. last (indices into the listing), each executed `executed` times."""

    first: int
    last: int
    executed: int

    @property
    def total(self) -> int:
        return self.executed * (self.last - self.first + 1)


def read(path: Path) -> list[Instruction]:
    """The instructions of the report's first kernel: the CSV's first row names the kernel, the second holds the
    column names."""
    rows = list(csv.reader(path.open()))
    header = rows[1]
    src, ex, st = (header.index(c) for c in ("Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"))
    return [Instruction(r[src].strip(), int(r[ex] or 0), int(r[st] or 0)) for r in rows[2:] if len(r) == len(header)]


def mix(instructions: list[Instruction]) -> Counter:
    """Warp instructions executed by opcode."""
    counts: Counter = Counter()
    for i in instructions:
        counts[i.opcode] += i.executed
    return counts


def regions(instructions: list[Instruction]) -> list[Region]:
    """The runs of consecutive executed instructions with equal counts, the most instructions first."""
    runs: list[Region] = []
    for k, i in enumerate(instructions):
        if i.executed and runs and runs[-1].executed == i.executed and runs[-1].last == k - 1:
            runs[-1] = attrs.evolve(runs[-1], last=k)
        elif i.executed:
            runs.append(Region(k, k, i.executed))
    return sorted(runs, key=lambda r: -r.total)


def report(instructions: list[Instruction], n_regions: int = 4, top: int = 16) -> str:
    total = sum(i.executed for i in instructions)
    stalls: Counter = Counter()
    for i in instructions:
        stalls[i.opcode] += i.stalls
    lines = [f"warp instructions executed: {total}", "opcode       executed   share  stall samples"]
    lines += [f"{op:10s} {n:10d} {n / total:7.1%}  {stalls[op]}" for op, n in mix(instructions).most_common(top)]
    for r in regions(instructions)[:n_regions]:
        body = instructions[r.first:r.last + 1]
        ops = ", ".join(f"{op} {n // r.executed}" for op, n in mix(body).most_common(8))
        lines.append(f"region {r.first}-{r.last}: {len(body)} instructions x {r.executed} = {r.total} "
                     f"({r.total / total:.1%}); {ops}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--regions", type=int, default=4, help="hottest regions to list")
    args = parser.parse_args()
    print(report(read(args.csv), args.regions))


if __name__ == "__main__":
    main()
