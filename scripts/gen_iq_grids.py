"""Write core/backends/cuda/iq_grids.cuh from opdispatch.quants.iq_grids (run from the repository root)."""

from __future__ import annotations

from pathlib import Path

from opdispatch.quants.iq_grids import cuda_header

HEADER = Path(__file__).resolve().parent.parent / "core" / "backends" / "cuda" / "iq_grids.cuh"

if __name__ == "__main__":
    HEADER.write_text(cuda_header())
    print(f"wrote {HEADER}")
