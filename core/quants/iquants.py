"""ggml's non-linear 4-bit I-quants: iq4_nl (32 values a block) and iq4_xs (256), both ways.

A 4-bit code picks one of 16 fixed levels (`iq_grids.KVALUES_IQ4NL`, -127 ..
113) times a scale: iq4_nl's f16 d, iq4_xs's f16 d times a 6-bit per-32-value
scale (ls - 32). Layouts as ggml-common.h's block_iq4_nl / block_iq4_xs.

The encoders are ggml's quantize_row_iq4_nl_impl without importance weights
(every value weighted by its square), evaluated one float32 operation at a
time in C's order (ggml-base is built without FMA contraction):

- a first scale max / -127 (ntry < 0) or max / 127 (ntry > 0) picks each
  value's nearest level (best_index_int8), and the least-squares scale of those
  levels is kept, d = sum(w q x) / sum(w q q);
- with ntry > 0, 2*ntry + 1 more scales (itry - 127) / max are tried, keeping
  the one whose levels fit best (largest sum(w q x)^2 / sum(w q q));
- iq4_xs then rounds its 8 sub-block scales to 6 bits of d = -max_scale/32
  and picks the levels again with the rounded scales; iq4_nl, with ntry > 0,
  picks them again with d itself.

`quantize_row_iq4_nl_ref` runs it with ntry = -1 (one pass: what ggml's CPU
and CUDA copies to iq4_nl do), and is this format's `encode`; llama-quantize
writes iq4_nl files with ntry = 7 (ggml's quantize_iq4_nl): `encode_iq4_nl_file`.
iq4_xs uses ntry = 7 both ways. A sub-block whose |x| stays below 1e-15 gets
scale 0; its codes are then 8 (level 1), as ggml's own re-pick gives, except
that quantize_row_iq4_nl_ref leaves them as they were (stale or uninitialised
bytes, decoding to 0 all the same). Non-finite inputs give unspecified codes.
"""

from __future__ import annotations

import numpy as np

from .common import F16, QK, QK_K, Format, first, halves, nearest_int, split
from .iq_grids import KVALUES_IQ4NL

_F32 = np.float32
_LEVELS = KVALUES_IQ4NL.astype(_F32)
_EPS = _F32(1e-15)  # ggml's GROUP_MAX_EPS
_SUB = 32  # values a scale covers, in both formats


def best_index(x: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 over the iq4 levels: the nearest level, the upper one on a tie.

    Its binary search ends at the first level above x (searchsorted), then
    compares the two distances in float32; NaN ends on the last level, as in C.
    """
    mu = np.clip(np.searchsorted(_LEVELS, x, side="right"), 1, 15)
    lower = (x - _LEVELS[mu - 1]) < (_LEVELS[mu] - x)
    idx = np.where(lower, mu - 1, mu)
    return np.where(x <= _LEVELS[0], 0, np.where(x >= _LEVELS[15], 15, idx))


def _sum(terms: np.ndarray) -> np.ndarray:
    """C's `s = 0; for j: s += terms[j]` in float32, over the last axis (accumulate is sequential)."""
    zero = np.zeros((*terms.shape[:-1], 1), _F32)
    return np.add.accumulate(np.concatenate([zero, terms], axis=-1), axis=-1, dtype=_F32)[..., -1]


def _fit(x: np.ndarray, w: np.ndarray, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Levels of x * inv (inv per sub-block) and their sums sum(w q x), sum(w q q)."""
    codes = best_index(inv[..., None] * x)
    q = _LEVELS[codes]
    wq = w * q
    return codes, _sum(wq * x), _sum(wq * q)


def _sub_scales(x: np.ndarray, ntry: int) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-value sub-block of x (..., n, 32): ggml's scale search -> (scales (..., n), codes (..., n, 32))."""
    w = x * x
    ax = np.abs(x)
    amax = ax.max(axis=-1)
    vmax = first(x, ax == amax[..., None])[..., 0]
    live = amax >= _EPS
    vmax = np.where(live, vmax, _F32(1))  # dead sub-blocks: any finite max; their scale is 0 below
    d0 = (-vmax if ntry > 0 else vmax) / _LEVELS[0]
    codes, sqx, sq2 = _fit(x, w, _F32(1) / d0)
    d = np.where(sq2 > 0, sqx / np.where(sq2 > 0, sq2, _F32(1)), _F32(0))
    best = d * sqx
    for itry in range(-ntry, ntry + 1):
        _, sqx, sq2 = _fit(x, w, _F32(itry + int(KVALUES_IQ4NL[0])) / vmax)
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        d = np.where(better, sqx / np.where(sq2 > 0, sq2, _F32(1)), d)
        best = np.where(better, d * sqx, best)
    return np.where(live, d, _F32(0)), np.where(live[..., None], codes, 8)


def _pack(codes: np.ndarray) -> np.ndarray:
    """Codes (..., k*32) -> (..., k*16) bytes: per 32 values, byte j = code j | code j+16 << 4."""
    c = codes.reshape(*codes.shape[:-1], -1, 2, 16).astype(np.uint8)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*codes.shape[:-1], -1)


def _encode_iq4_nl(x: np.ndarray, ntry: int) -> np.ndarray:
    scale, codes = _sub_scales(x[..., None, :], ntry)
    if ntry > 0:
        inv = np.where(scale != 0, _F32(1) / np.where(scale != 0, scale, _F32(1)), _F32(0))
        codes = best_index(inv[..., None] * x[..., None, :])
    return np.concatenate([scale.astype(F16).view(np.uint8), _pack(codes[..., 0, :])], axis=-1)


def encode_iq4_nl(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_iq4_nl_ref: (..., 32) float32 -> (..., 18) blocks (d, qs[16])."""
    return _encode_iq4_nl(x, -1)


def encode_iq4_nl_file(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_iq4_nl without an importance matrix (ntry = 7): the bytes llama-quantize writes."""
    return _encode_iq4_nl(x, 7)


def encode_iq4_xs(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_iq4_xs_ref: (..., 256) float32 -> (..., 136) blocks (d, scales_h, scales_l[4], qs)."""
    xs = x.reshape(*x.shape[:-1], QK_K // _SUB, _SUB)
    scales, _ = _sub_scales(xs, 7)
    amax = np.abs(scales).max(axis=-1, keepdims=True)
    max_scale = np.where(amax > 0, first(scales, np.abs(scales) == amax), _F32(0))
    d = -max_scale / _F32(32)  # an all-zero block keeps -0.0, as in ggml
    inv = np.where(d != 0, _F32(1) / np.where(d != 0, d, _F32(1)), _F32(0))
    ls = np.clip(nearest_int(inv * scales), -32, 31)
    dl = d * ls.astype(_F32)
    idl = np.where(dl != 0, _F32(1) / np.where(dl != 0, dl, _F32(1)), _F32(0))
    codes = best_index(idl[..., None] * xs).reshape(x.shape)
    ls = (ls + 32).astype(np.uint16)
    lo = (ls & 0x0F).astype(np.uint8)
    scales_l = lo[..., 0::2] | (lo[..., 1::2] << 4)
    scales_h = np.bitwise_or.reduce((ls >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=-1, keepdims=True)
    return np.concatenate(
        [d.astype(F16).view(np.uint8), scales_h.astype("<u2").view(np.uint8), scales_l, _pack(codes)], axis=-1
    )


def _decode_iq4_nl(raw: np.ndarray) -> np.ndarray:
    """d, qs[16]: value j = d * level(low nibble of qs[j]), value j + 16 = d * level(high nibble)."""
    d, qs = split(raw, (2, 16))
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return halves(d) * _LEVELS[codes]


def _decode_iq4_xs(raw: np.ndarray) -> np.ndarray:
    """d, scales_h (u16: 2 high bits per sub-block), scales_l[4] (a nibble each), qs[128] (iq4_nl's order per 32).

    Sub-block b's scale ls = nibble b % 2 of scales_l[b // 2] | ((scales_h >> 2b) & 3) << 4; dl = d * (ls - 32).
    """
    d, sh, sl, qs = split(raw, (2, 2, 4, 128))
    h = sh[..., 0].astype(np.int32) | (sh[..., 1].astype(np.int32) << 8)
    lo = np.stack([sl & 0x0F, sl >> 4], axis=-1).reshape(*sl.shape[:-1], 8).astype(np.int32)
    ls = lo | (((h[..., None] >> (2 * np.arange(8))) & 3) << 4)
    dl = halves(d) * (ls - 32).astype(_F32)
    q = qs.reshape(*qs.shape[:-1], 8, 16)
    codes = np.concatenate([q & 0x0F, q >> 4], axis=-1)
    return (dl[..., None] * _LEVELS[codes]).reshape(*raw.shape[:-1], QK_K)


FORMATS = (
    Format("iq4_nl", QK, 18, _decode_iq4_nl, encode_iq4_nl),
    Format("iq4_xs", QK_K, 136, _decode_iq4_xs, encode_iq4_xs),
)
