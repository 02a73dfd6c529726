"""numpy kernels for every op: the oracle for device plugins and the CPU plugin.

A reference kernel is `fn(node, out, *srcs)`: `out` and `srcs` are host numpy
views of the node's storage (raw uint8 rows for block formats, None for an
absent optional source); it computes from the sources and writes `out` with
`store`. Accumulation is in float64 where it matters. Each module below
registers the kernels of one op family in `REFERENCE`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..dtypes import DType, dtype as as_dtype, from_float, to_host_float
from ..tensor import Tensor

RefKernel = Callable[..., None]

#: op name -> reference kernel
REFERENCE: dict[str, RefKernel] = {}


def reference(*ops: str) -> Callable[[RefKernel], RefKernel]:
    """Register `fn` as the reference kernel of `ops`."""

    def register(fn: RefKernel) -> RefKernel:
        for name in ops:
            if name in REFERENCE:
                raise RuntimeError(f"reference kernel for '{name}' registered twice")
            REFERENCE[name] = fn
        return fn

    return register


def load(arr: np.ndarray, t: Tensor | DType | str) -> np.ndarray:
    """Host values of a tensor: floats as float32 (block formats dequantized), ints as they are."""
    dt = t.dtype if isinstance(t, Tensor) else as_dtype(t)
    return to_host_float(dt, arr)


def store(out: np.ndarray, values: np.ndarray, t: Tensor | DType | str) -> None:
    """Write `values` (broadcast to the output's shape) into `out`, converting to its dtype."""
    dt = t.dtype if isinstance(t, Tensor) else as_dtype(t)
    values = np.asarray(values)
    if dt.is_quant:
        shape = out.shape[:-1] + (out.shape[-1] // dt.block_bytes * dt.block_size,)
        out[...] = from_float(dt, np.broadcast_to(values, shape))
    elif dt.is_int:
        out[...] = np.broadcast_to(values, out.shape).astype(dt.numpy)
    else:
        out[...] = from_float(dt, np.broadcast_to(values, out.shape))


def _register_all() -> None:
    # Imported for their registrations; each family's module lists its ops.
    from . import attention, collective, elementwise, layout, matmul, norm, reduce, rows  # noqa: F401


_register_all()
