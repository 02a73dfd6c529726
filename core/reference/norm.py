"""Reference kernels of the norm ops: statistics and scaling in float64.

Rows with inf or NaN give NaN where C's arithmetic does (docs/ops.md, "Edge values"): numpy's
warnings about them are silenced.
"""

from __future__ import annotations

import numpy as np

from ..tensor import Tensor
from . import load, reference, store


def _rows(arr: np.ndarray, t: Tensor) -> np.ndarray:
    return load(arr, t).astype(np.float64)


@reference("norm")
@np.errstate(invalid="ignore", divide="ignore")
def _norm(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    v = _rows(x, node.srcs[0])
    d = v - v.mean(axis=-1, keepdims=True)
    var = np.mean(d * d, axis=-1, keepdims=True)
    store(out, d / np.sqrt(var + node.params["eps"]), node)


@reference("rms_norm")
@np.errstate(invalid="ignore", divide="ignore")
def _rms_norm(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    v = _rows(x, node.srcs[0])
    store(out, v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + node.params["eps"]), node)


@reference("l2_norm")
@np.errstate(invalid="ignore", divide="ignore")
def _l2_norm(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    v = _rows(x, node.srcs[0])
    length = np.sqrt(np.sum(v * v, axis=-1, keepdims=True))
    # ggml's 1 / fmaxf(sqrtf(sum), eps): fmax, as C's fmaxf, drops a NaN length (the row is x / eps)
    store(out, v / np.fmax(length, node.params["eps"]), node)


@reference("group_norm")
@np.errstate(invalid="ignore", divide="ignore")
def _group_norm(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    v = _rows(x, node.srcs[0])
    v = v.reshape((1,) * (4 - v.ndim) + v.shape)  # (N, C, H, W)
    groups, eps = node.params["groups"], node.params["eps"]
    n_channels = v.shape[1]
    per_group = -(-n_channels // groups)  # ceil, as ggml; trailing groups may be short or empty
    y = np.empty_like(v)
    for start in range(0, n_channels, per_group):
        block = v[:, start : start + per_group]
        d = block - block.mean(axis=(1, 2, 3), keepdims=True)
        var = np.mean(d * d, axis=(1, 2, 3), keepdims=True)
        y[:, start : start + per_group] = d / np.sqrt(var + eps)
    store(out, y.reshape(out.shape), node)
