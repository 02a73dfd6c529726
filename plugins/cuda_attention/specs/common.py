"""What every attention launch spec uses: the kernels' folder, the C++ type of each dtype, operand strides
and alignment as the kernels take them, and ALiBi's arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from opdispatch.ops.attention import alibi_bases
from opdispatch.ops.base import pad4
from opdispatch.tensor import Tensor

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"

#: a tensor's device address (CudaContext.ptr at bind time; a fake one in tests)
Ptr = Callable[[Tensor], int]

#: C++ type of each K/V (and cache) dtype in the kernels
CTYPE = {"f32": "float", "f16": "od::f16", "bf16": "od::bf16", "q8_0": "od::quant::q8_0",
         "q4_0": "od::quant::q4_0"}


def idx_ctype(idx: str) -> str:
    """C++ type of set_rows' row ids."""
    return "int" if idx == "i32" else "long long"


def elem_strides(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape padded to 4 dims and strides in elements (0 for the padding)."""
    pad = 4 - t.ndim
    return pad4(t.shape), (0,) * pad + tuple(s // t.dtype.block_bytes for s in t.strides)


def byte_strides(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape padded to 4 dims and strides in bytes (0 for the padding)."""
    pad = 4 - t.ndim
    return pad4(t.shape), (0,) * pad + tuple(t.strides)


def aligned(t: Tensor, ptr: Ptr, unit: int) -> bool:
    """Every row of `t` starts on a `unit`-byte boundary (the row length is checked by the caller)."""
    shape, strides = byte_strides(t)
    return ptr(t) % unit == 0 and all(s % unit == 0 for n, s in zip(shape[:3], strides[:3]) if n > 1)


def alibi_fields(n_head: int, max_bias: float) -> dict[str, Any]:
    """The kernels' ALiBi arguments (use_alibi, m0, m1, n_head_log2), from ggml's bases."""
    bases = alibi_bases(n_head, max_bias)
    if bases is None:
        return {"use_alibi": 0, "m0": 1.0, "m1": 1.0, "n_head_log2": 1}
    n_log2, m0, m1 = bases
    return {"use_alibi": 1, "m0": m0, "m1": m1, "n_head_log2": n_log2}
