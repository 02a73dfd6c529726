"""Reference kernels of the rows family: get_rows, set_rows, cpy, dup, cont, set, acc."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..dtypes import from_float
from ..tensor import Tensor
from . import load, reference, store


def _lead(arr: np.ndarray, n: int) -> np.ndarray:
    """A view of arr with leading axes of size 1 up to n axes (ggml's 4-d view)."""
    return arr[(np.newaxis,) * (n - arr.ndim)]


def _check_index(op_name: str, idx: np.ndarray, rows: int, t: Tensor) -> None:
    bad = (idx < 0) | (idx >= rows)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise IndexError(
            f"{op_name}: row index {int(idx[pos])} at idx{list(pos)} is out of range "
            f"for the {rows} rows of {t.describe()}"
        )


@reference("get_rows")
def _get_rows(node: Tensor, out: np.ndarray, a: np.ndarray, idx: np.ndarray) -> None:
    src = node.srcs[0]
    a4, idx3 = _lead(a, 4), _lead(idx, 3).astype(np.int64)
    _check_index("get_rows", idx, a4.shape[2], src)
    b3, b2 = a4.shape[:2]
    # Gather the raw rows first: only the rows taken are dequantized.
    rows = a4[np.arange(b3)[:, None, None], np.arange(b2)[None, :, None], idx3]
    store(out, load(rows, src).reshape(node.shape), node)


@reference("set_rows")
def _set_rows(node: Tensor, out: np.ndarray, dst: np.ndarray, src: np.ndarray, idx: np.ndarray) -> None:
    # out aliases dst: only the indexed rows are written, the others keep their bytes.
    out4, idx3 = _lead(out, 4), _lead(idx, 3).astype(np.int64)
    src4 = _lead(load(src, node.srcs[1]), 4)
    _check_index("set_rows", idx, out4.shape[2], node.srcs[0])
    i3 = np.arange(out4.shape[0])[:, None]
    i2 = np.arange(out4.shape[1])[None, :]
    rows = idx3[i3 % idx3.shape[0], i2 % idx3.shape[1]]  # (D3, D2, n): idx tiles over the batch axes
    out4[i3[..., None], i2[..., None], rows] = from_float(node.dtype, src4)


@reference("cpy", "dup", "cont")
def _copy(node: Tensor, out: np.ndarray, a: np.ndarray, *_dst: np.ndarray) -> None:
    # cpy's second source is the destination itself (out aliases it): its values are not read.
    src = node.srcs[0]
    if src.dtype == node.dtype:
        # Bytes in row-major order (whole blocks for block formats): exact, where requantizing is not.
        out[...] = np.reshape(a, out.shape)
    else:
        store(out, load(a, src).reshape(node.shape), node)


@reference("set", "acc")
def _set_acc(node: Tensor, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    base = np.ascontiguousarray(a).reshape(-1)
    flat = out.reshape(-1)  # the node is contiguous, so this is a view
    flat[...] = base
    if b.size == 0:
        return
    start = node.params["offset"] // out.itemsize
    strides = node.params["strides"]
    window = as_strided(flat[start:], b.shape, strides)
    if node.op == "set":
        window[...] = b
    else:
        # From a's values, not the window being written: overlapping rows do not compound (as ggml).
        window[...] = as_strided(base[start:], b.shape, strides) + b
