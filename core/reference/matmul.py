"""Reference kernels of the matrix products: mul_mat, mul_mat_id, out_prod.

Weights are dequantized exactly and every product accumulates in float64;
b is NOT first rounded to the weight's dot type as ggml's CPU does.
"""

from __future__ import annotations

import numpy as np

from ..ops.base import pad4
from ..tensor import Tensor
from . import load, reference, store


def _f64(arr: np.ndarray, t: Tensor) -> np.ndarray:
    """Host values of `t` as float64, padded to 4 dims."""
    return load(arr, t).astype(np.float64).reshape(pad4(t.shape))


def _repeat_batch(a: np.ndarray, like: tuple[int, ...]) -> np.ndarray:
    """Repeat-interleave a's two outer axes up to `like`'s (batch i uses a's i // r)."""
    return np.repeat(np.repeat(a, like[0] // a.shape[0], axis=0), like[1] // a.shape[1], axis=1)


@reference("mul_mat")
@np.errstate(invalid="ignore")  # inf * 0, inf - inf: NaN as C gives it
def _mul_mat(node: Tensor, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    ta, tb = node.srcs
    bv = _f64(b, tb)
    av = _repeat_batch(_f64(a, ta), bv.shape)
    store(out, np.matmul(bv, av.swapaxes(-1, -2)).reshape(node.shape), node)


@reference("mul_mat_id")
@np.errstate(invalid="ignore")  # inf * 0, inf - inf: NaN as C gives it
def _mul_mat_id(node: Tensor, out: np.ndarray, as_: np.ndarray, b: np.ndarray, ids: np.ndarray) -> None:
    tas, tb, tids = node.srcs
    experts = load(as_, tas).astype(np.float64)  # (E, M, K)
    bv = load(b, tb).astype(np.float64)  # (T, Ub, K)
    sel = np.asarray(load(ids, tids), dtype=np.int64)  # (T, U)
    n_exp = experts.shape[0]
    bad = np.argwhere((sel < 0) | (sel >= n_exp))
    if bad.size:
        t, u = bad[0]
        raise IndexError(
            f"mul_mat_id: ids[{t}, {u}] = {sel[t, u]} is out of range for {n_exp} experts "
            f"({len(bad)} bad ids) [{tas.describe()}, {tids.describe()}]"
        )
    rows = bv[:, np.arange(sel.shape[1]) % bv.shape[1], :]  # (T, U, K): b row u % Ub
    res = np.zeros(node.shape, np.float64)
    for e in np.unique(sel):  # one product per expert used, not one per (t, u)
        hit = sel == e
        res[hit] = rows[hit] @ experts[e].T
    store(out, res, node)


@reference("out_prod")
@np.errstate(invalid="ignore")  # inf * 0, inf - inf: NaN as C gives it
def _out_prod(node: Tensor, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    ta, tb = node.srcs
    bv = _f64(b, tb)  # (B3, B2, K, N)
    av = _repeat_batch(_f64(a, ta), bv.shape)  # (B3, B2, K, M)
    store(out, np.matmul(bv.swapaxes(-1, -2), av).reshape(node.shape), node)
