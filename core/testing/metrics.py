"""Error metrics of the conformance standard (docs/conformance.md)."""

from __future__ import annotations

import numpy as np


def nmse(out: np.ndarray, ref: np.ndarray) -> float:
    """sum((out-ref)^2) / sum(ref^2) in float64.

    NaN must match in place (a NaN where the reference has none, or none where
    it has one, gives inf); infinities must match in place and sign. Both are
    left out of the sums.
    """
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"nmse: shapes differ: {out.shape} vs {ref.shape}")
    nan_out, nan_ref = np.isnan(out), np.isnan(ref)
    if not np.array_equal(nan_out, nan_ref):
        return float("inf")
    inf_out, inf_ref = np.isinf(out), np.isinf(ref)
    if not np.array_equal(inf_out, inf_ref) or not np.array_equal(out[inf_out], ref[inf_ref]):
        return float("inf")
    finite = ~inf_ref & ~nan_ref
    diff = out[finite] - ref[finite]
    den = float(np.sum(ref[finite] ** 2))
    num = float(np.sum(diff * diff))
    return num / den if den > 0 else num
