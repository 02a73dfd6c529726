"""Reference kernels of the attention pieces: soft_max, rope, flash_attn_ext, diag_mask_inf.

ALiBi's slopes and YaRN's terms come from the op definitions (`opdispatch.ops.attention`),
which the device plugins import too.
"""

from __future__ import annotations

import numpy as np

from ..ops.attention import alibi_slopes, rope_yarn
from ..ops.base import pad4
from ..tensor import Tensor
from . import load, reference, store


def _outer_mask(arr: np.ndarray, t: Tensor, outer: tuple[int, int], rows: int) -> np.ndarray:
    """Mask values float64 `(outer[0], outer[1], rows, cols)`: first `rows` rows, outer dims by modulo."""
    m = load(arr, t).astype(np.float64).reshape(pad4(t.shape))[:, :, :rows, :]
    return m[np.arange(outer[0]) % m.shape[0]][:, np.arange(outer[1]) % m.shape[1]]


def _softmax(w: np.ndarray, sink: np.ndarray | None) -> np.ndarray:
    """Softmax over the last axis; `sink` (broadcastable, last axis 1) is an extra logit.

    A row with nothing to weigh (every logit -inf and no sink, or no logits)
    gives zeros rather than NaN; a NaN or +inf logit (or sink) makes the row NaN.
    """
    if w.shape[-1] == 0:
        return np.zeros_like(w)
    top = w.max(axis=-1, keepdims=True)
    if sink is not None:
        top = np.maximum(top, sink)
    top = np.where(np.isneginf(top), 0.0, top)  # all -inf: exp gives 0s, not NaN
    with np.errstate(invalid="ignore"):  # inf - inf: the row is NaN, as ggml's
        e = np.exp(w - top)
        total = e.sum(axis=-1, keepdims=True)
        if sink is not None:
            total = total + np.exp(sink - top)
        return np.divide(e, total, out=np.zeros_like(e), where=total != 0)


@reference("soft_max")
def _soft_max(node: Tensor, out: np.ndarray, a: np.ndarray, mask: np.ndarray | None,
              sinks: np.ndarray | None) -> None:
    ta, tmask, tsinks = node.srcs
    with np.errstate(invalid="ignore"):  # -inf * 0, inf - inf: NaN as C gives them
        w = load(a, ta).astype(np.float64).reshape(pad4(ta.shape)) * node.params["scale"]
        n3, n_head, rows, _ = w.shape
        if tmask is not None:
            slopes = alibi_slopes(n_head, node.params["max_bias"])
            w = w + slopes[:, None, None] * _outer_mask(mask, tmask, (n3, n_head), rows)
    sink = load(sinks, tsinks).astype(np.float64)[:, None, None] if tsinks is not None else None
    store(out, _softmax(w, sink).reshape(ta.shape), node)


@reference("rope")
def _rope(node: Tensor, out: np.ndarray, x: np.ndarray, pos: np.ndarray, freq_factors: np.ndarray | None) -> None:
    tx, tpos, tff = node.srcs
    p = node.params
    n_dims = p["n_dims"]
    half = n_dims // 2
    xv = load(x, tx).astype(np.float64).reshape(pad4(tx.shape))  # (B, T, H, D)
    i = np.arange(half)
    inv_freq = p["freq_base"] ** (-2.0 * i / n_dims)
    if tff is not None:
        inv_freq = inv_freq / load(freq_factors, tff)[:half].astype(np.float64)
    theta_ext = load(pos, tpos).astype(np.float64)[:, None] * inv_freq  # (T, half)
    theta = p["freq_scale"] * theta_ext
    lo, hi, mscale = rope_yarn(p)
    if p["ext_factor"] != 0.0:
        mix = p["ext_factor"] * (1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0))
        theta = theta * (1.0 - mix) + theta_ext * mix
    c = (np.cos(theta) * mscale)[None, :, None, :]
    s = (np.sin(theta) * mscale)[None, :, None, :]
    i0, i1 = (2 * i, 2 * i + 1) if p["mode"] == "normal" else (i, i + half)
    x0, x1 = xv[..., i0], xv[..., i1]
    y = xv.copy()
    y[..., i0] = x0 * c - x1 * s
    y[..., i1] = x0 * s + x1 * c
    store(out, y.reshape(tx.shape), node)


@reference("flash_attn_ext")
def _flash_attn_ext(node: Tensor, out: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                    mask: np.ndarray | None, sinks: np.ndarray | None) -> None:
    tq, tk, tv, tmask, tsinks = node.srcs
    p = node.params
    qv = load(q, tq).astype(np.float64)
    kv = load(k, tk).astype(np.float64)
    vv = load(v, tv).astype(np.float64)
    n_b, n_head, n_q, _ = qv.shape
    bias = None
    if tmask is not None:
        slopes = alibi_slopes(n_head, p["max_bias"])
        bias = slopes[:, None, None] * _outer_mask(mask, tmask, (n_b, n_head), n_q)
    sink = load(sinks, tsinks).astype(np.float64) if tsinks is not None else None
    res = np.empty(node.shape, np.float64)  # (B, Tq, Hq, Dv)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite inputs: NaN/inf as C gives them
        _attend(p, qv, kv, vv, bias, sink, res)
    store(out, res, node)


def _attend(p: dict, qv: np.ndarray, kv: np.ndarray, vv: np.ndarray, bias: np.ndarray | None,
            sink: np.ndarray | None, res: np.ndarray) -> None:
    """res[b, :, h] = softmax(logits + bias) @ v for every batch b and query head h."""
    n_b, n_head = qv.shape[:2]
    group = n_head // kv.shape[1]
    # One head at a time: memory stays O(Tq*Tk), not O(Hq*Tk*D) for repeated kv heads.
    for b in range(n_b):
        for h in range(n_head):
            s = p["scale"] * (qv[b, h] @ kv[b, h // group].T)
            if p["softcap"] != 0.0:
                s = p["softcap"] * np.tanh(s / p["softcap"])
            if bias is not None:
                # -inf entries are skipped outright (even where q.k is not finite), as ggml does.
                s = np.where(np.isneginf(bias[b, h]), -np.inf, s + bias[b, h])
            w = _softmax(s, sink[h] if sink is not None else None)
            res[b, :, h, :] = w @ vv[b, h // group]


@reference("diag_mask_inf")
def _diag_mask_inf(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    (tx,) = node.srcs
    cols = np.arange(tx.shape[-1])
    rows = np.arange(tx.shape[-2])[:, None] if tx.ndim >= 2 else 0  # a vector is row 0
    store(out, np.where(cols > node.params["n_past"] + rows, -np.inf, load(x, tx)), node)
