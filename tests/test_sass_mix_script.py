"""scripts/sass_mix.py without a GPU: the opcode mix and the hottest regions of a kernel's per-instruction counters,
on a listing in the form of ncu's `--page source --csv --print-source sass`."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from helpers import load_script

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "Thread Instructions Executed"]


@pytest.fixture(scope="module")
def sass():  # noqa: ANN201 - the script, imported as a module
    return load_script("sass_mix")


def _listing(path: Path, rng) -> tuple[int, int, int]:  # noqa: ANN001
    """A kernel of a prologue run once a warp, a loop body of 6 instructions run `loop` times (two of them PRMT,
    one predicated), a second loop of 3 run `inner` times, and an exit; returns (loop, inner, total)."""
    warps, loop, inner = int(rng.integers(10, 50)), int(rng.integers(1000, 5000)), int(rng.integers(100, 900))
    code = [("LDC R1, c[0x0][0x28]", warps), ("S2R R0, SR_TID.X", warps),
            ("PRMT R4, R5, R6, 0x3210", loop), ("@!P0 PRMT R7, R4, 0x7531, R8", loop),
            ("LOP3.LUT R9, R4, 0x77, RZ, 0xc0, !PT", loop),
            ("IDP.4A.S8.S8 R10, R9, R11, R10", loop), ("IMAD.U32 R5, RZ, RZ, UR5", loop), ("@P1 BRA 0x80", loop),
            ("LDGSTS.E.BYPASS.128 [R2], desc[UR6][R12.64]", inner), ("IADD3 R12, P0, R12, 0x200, RZ", inner),
            ("BRA 0x100", inner), ("EXIT", warps), ("BRA 0x200", 0)]
    with path.open("w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "void k<(int)15>(const unsigned char *)"])
        w.writerow(HEADER)
        for k, (src, n) in enumerate(code):
            w.writerow([hex(0x7f00 + 16 * k), f"      {src}", int(rng.integers(0, 40)), 0, n, 32 * n])
    return loop, inner, sum(n for _, n in code)


def test_mix_and_regions(sass, tmp_path: Path, rng) -> None:  # noqa: ANN001
    loop, inner, total = _listing(tmp_path / "k.csv", rng)
    code = sass.read(tmp_path / "k.csv")
    assert len(code) == 13 and code[3].opcode == "PRMT" and code[4].opcode == "LOP3"
    counts = sass.mix(code)
    assert sum(counts.values()) == total
    assert counts["PRMT"] == 2 * loop and counts["BRA"] == loop + inner and counts["IDP"] == loop
    hot = sass.regions(code)
    assert (hot[0].first, hot[0].last, hot[0].executed, hot[0].total) == (2, 7, loop, 6 * loop)
    assert (hot[1].first, hot[1].last, hot[1].executed) == (8, 10, inner)
    assert all(r.executed for r in hot)  # the never-executed last instruction is no region
    text = sass.report(code, n_regions=2)
    assert f"warp instructions executed: {total}" in text
    assert f"region 2-7: 6 instructions x {loop} = {6 * loop} ({6 * loop / total:.1%}); PRMT 2," in text
    assert "region 8-10:" in text and "region 0-1" not in text
