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

A new format is a `Format` in its family's module and a line in `_FAMILIES`.
"""

from __future__ import annotations

from . import kquants, legacy
from .common import Format

__all__ = ["Format", "FORMATS"]

_FAMILIES = (legacy, kquants)

#: every block format, by name, in ggml's type order within each family
FORMATS: dict[str, Format] = {f.name: f for family in _FAMILIES for f in family.FORMATS}
