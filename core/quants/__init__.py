"""ggml's block-quantized formats on the host (numpy only), one module a family.

Each format is a `Format` record: its name, its geometry (values and bytes a
block) and its numpy `decode` (raw blocks -> float32 values, bit for bit
ggml's ``dequantize_row_*``) and `encode` (float32 values -> raw blocks, byte
for byte ggml's ``quantize_row_*_ref``; None where opdispatch has none). The
layouts are ggml's ``block_*`` structs (ggml-common.h), so GGUF weights load
without conversion; docs/ops.md lists them. `opdispatch.dtypes` builds its
dtype table and its `quantize` / `dequantize` from `FORMATS`.

- `legacy`: the 32-value formats q4_0, q4_1, q5_0, q5_1, q8_0.
- `kquants`: the 256-value K-quants q2_K .. q6_K and q8_K (decoders; their
  encoders are in `kquants_encode`, ggml's scale searches in `kquants_search`).
- `iquants`: the non-linear 4-bit I-quants iq4_nl (32 values) and iq4_xs (256).
- `iquants_grid`: the grid I-quants iq2_xxs, iq2_xs, iq3_xxs, iq1_s, iq3_s,
  iq2_s, iq1_m (dequantize only: ggml quantizes them with an importance matrix).
- `mxfp4`: OCP's mxfp4 (32 e2m1 values under an e8m0 scale).

`iq_grids` holds the I-quants' and mxfp4's lookup tables as data, and writes
them as the CUDA header core/backends/cuda/iq_grids.cuh.

A new format is a `Format` in its family's module and a line in `_FAMILIES`.
"""

from __future__ import annotations

from . import iquants, iquants_grid, kquants, legacy, mxfp4
from .common import Format

__all__ = ["Format", "FORMATS"]

_FAMILIES = (legacy, kquants, iquants, iquants_grid, mxfp4)

#: every block format, by name, in ggml's type order within each family
FORMATS: dict[str, Format] = {f.name: f for family in _FAMILIES for f in family.FORMATS}
