"""Reference kernels of the reductions and sorts: sum, sum_rows, mean, cumsum, argmax, count_equal, argsort, top_k."""

from __future__ import annotations

import numpy as np

from ..tensor import Tensor
from . import load, reference, store


def _f64(arr: np.ndarray, t: Tensor) -> np.ndarray:
    return load(arr, t).astype(np.float64)


@reference("sum")
@np.errstate(invalid="ignore")  # inf - inf: NaN as C gives it
def _sum(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    store(out, _f64(x, node.srcs[0]).sum(), node)


@reference("sum_rows")
@np.errstate(invalid="ignore")  # inf - inf: NaN as C gives it
def _sum_rows(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    store(out, _f64(x, node.srcs[0]).sum(-1, keepdims=True), node)


@reference("mean")
@np.errstate(invalid="ignore")  # inf - inf: NaN as C gives it
def _mean(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    store(out, _f64(x, node.srcs[0]).mean(-1, keepdims=True), node)


@reference("cumsum")
@np.errstate(invalid="ignore")  # inf - inf: NaN as C gives it
def _cumsum(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    store(out, np.cumsum(_f64(x, node.srcs[0]), -1), node)


@reference("argmax")
def _argmax(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    rows = x.reshape(-1, x.shape[-1])
    # NaN is never the maximum (a row of NaN gives 0); ggml keeps the last index of the maximum.
    valid = ~np.isnan(rows)
    top = np.where(valid, rows, -np.inf).max(axis=-1, keepdims=True)
    hit = valid & (rows == top)
    last = rows.shape[-1] - 1 - np.argmax(hit[:, ::-1], axis=-1)
    out[...] = np.where(hit.any(axis=-1), last, 0)


@reference("count_equal")
def _count_equal(node: Tensor, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    out[...] = np.count_nonzero(a == b)


def _stable_argsort(x: np.ndarray, descending: bool) -> np.ndarray:
    # Negating keeps equal values equal, so ties stay in index order either way.
    return np.argsort(-x if descending else x, axis=-1, kind="stable")


@reference("argsort")
def _argsort(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    out[...] = _stable_argsort(x, node.params["order"] == "desc")


@reference("top_k")
def _top_k(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    out[...] = _stable_argsort(x, True)[..., : node.params["k"]]
