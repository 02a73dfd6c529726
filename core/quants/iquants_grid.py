"""ggml's grid I-quants: iq2_xxs, iq2_xs, iq3_xxs, iq1_s, iq3_s, iq2_s, iq1_m (dequantize only).

Each super-block of 256 values holds one f16 d (iq1_m spreads its d over the
top nibbles of its scales) and, per group of 8 (iq3: 4) values, an index into
one of ggml's lookup grids (`iq_grids`) whose entry gives the magnitudes, plus
sign bits (iq2/iq3) or a shared +-1/8 shift (iq1); small per-sub-block scales
multiply d. Layouts as ggml-common.h's block_iq*; the decoders evaluate
ggml's dequantize_row_iq* float32 expressions in its order, so the values match
bit for bit (a sign is a multiply by +-1.0f, as in ggml, not a negation).

No encoder: ggml's quantizers for these search the grids weighted by an
importance matrix (quantize_row_iq*_ref do not exist for them, and llama.cpp
refuses to write them without one), so `Format.encode` is None.
"""

from __future__ import annotations

import numpy as np

from . import iq_grids as G
from .common import F16, QK_K, Format, halves, split

_F32 = np.float32
_BIT8 = np.arange(8, dtype=np.uint8)


def _le(b: np.ndarray, n: int) -> np.ndarray:
    """Little-endian unsigned ints of n bytes each from (..., k*n) bytes -> (..., k) uint32."""
    b = b.reshape(*b.shape[:-1], -1, n).astype(np.uint32)
    return sum((b[..., i] << np.uint32(8 * i) for i in range(1, n)), b[..., 0])


def _sign(bits: np.ndarray) -> np.ndarray:
    """Sign bytes (...) -> (..., 8) float32: -1.0 where bit j is set, else 1.0 (ggml's kmask_iq2xs test)."""
    on = (bits[..., None] & G.KMASK_IQ2XS) != 0
    return np.where(on, _F32(-1), _F32(1))


def _groups(db: np.ndarray, per: int) -> np.ndarray:
    """Scales (..., s), each for `per` consecutive groups of 8 values -> (..., s*per, 1), against (..., s*per, 8)."""
    return np.repeat(db, per, axis=-1)[..., None]


def _finish(y: np.ndarray) -> np.ndarray:
    return y.reshape(*y.shape[:-2], QK_K)


def _decode_iq2_xxs(raw: np.ndarray) -> np.ndarray:
    """d, then per 32 values 8 bytes: 4 grid indices (u8), a u32 of 4 x 7 sign bits and a 4-bit scale on top.

    db = d * (0.5 + scale) * 0.25; value 8l + j of the group = db * grid[j] * sign bit j of ksigns[7 bits l].
    """
    d, qs = split(raw, (2, 64))
    g = qs.reshape(*qs.shape[:-1], 8, 8)
    aux = _le(g[..., 4:], 4)[..., 0]  # (..., 8)
    db = halves(d) * (_F32(0.5) + (aux >> 28).astype(_F32)) * _F32(0.25)
    signs = G.KSIGNS_IQ2XS[(aux[..., None] >> np.uint32(7) * np.arange(4, dtype=np.uint32)) & 127]
    grid = G.IQ2XXS_GRID[g[..., :4]].astype(_F32)  # (..., 8, 4, 8)
    y = db[..., None, None] * grid * _sign(signs)
    return y.reshape(*y.shape[:-3], QK_K)


def _scale_pairs(d: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """iq2_xs/iq2_s: 8 bytes of two 4-bit scales -> 16 scales d * (0.5 + s) * 0.25, low nibble first."""
    s = np.stack([scales & 0x0F, scales >> 4], axis=-1).reshape(*scales.shape[:-1], 16)
    return d * (_F32(0.5) + s.astype(_F32)) * _F32(0.25)


def _decode_iq2_xs(raw: np.ndarray) -> np.ndarray:
    """d, qs u16[32] (9-bit grid index, 7 sign bits above it), scales[8] (a nibble per 16 values)."""
    d, qs, scales = split(raw, (2, 64, 8))
    q = _le(qs, 2)  # (..., 32)
    grid = G.IQ2XS_GRID[q & 511].astype(_F32)
    signs = G.KSIGNS_IQ2XS[q >> 9]
    return _finish(_groups(_scale_pairs(halves(d), scales), 2) * grid * _sign(signs))


def _decode_iq2_s(raw: np.ndarray) -> np.ndarray:
    """d, qs[32] (grid index low bits), signs[32] (one byte per 8 values), qh[8], scales[8].

    Group l of 32-value block b: index = qs[4b + l] | ((qh[b] >> 2l) & 3) << 8.
    """
    d, qs, signs, qh, scales = split(raw, (2, 32, 32, 8, 8))
    hi = (qh[..., None] >> np.array([0, 2, 4, 6], np.uint8)) & 3  # (..., 8, 4)
    idx = qs.astype(np.uint16) | (hi.reshape(*hi.shape[:-2], 32).astype(np.uint16) << 8)
    grid = G.IQ2S_GRID[idx].astype(_F32)
    return _finish(_groups(_scale_pairs(halves(d), scales), 2) * grid * _sign(signs))


def _decode_iq3_xxs(raw: np.ndarray) -> np.ndarray:
    """d, qs[64] (an iq3xxs_grid index per 4 values), then per 32 values a u32: 4 x 7 sign bits, 4-bit scale.

    db = d * (0.5 + scale) * 0.5; group l's 8 values are grid[qs[2l]], grid[qs[2l+1]] under ksigns[7 bits l].
    """
    d, qs, ss = split(raw, (2, 64, 32))
    aux = _le(ss, 4)  # (..., 8)
    db = halves(d) * (_F32(0.5) + (aux >> 28).astype(_F32)) * _F32(0.5)
    signs = G.KSIGNS_IQ2XS[(aux[..., None] >> np.uint32(7) * np.arange(4, dtype=np.uint32)) & 127]
    grid = G.IQ3XXS_GRID[qs].astype(_F32).reshape(*qs.shape[:-1], 8, 4, 8)
    y = db[..., None, None] * grid * _sign(signs)
    return y.reshape(*y.shape[:-3], QK_K)


def _decode_iq3_s(raw: np.ndarray) -> np.ndarray:
    """d, qs[64], qh[8], signs[32], scales[4]: index k of 32-value block b is qs[8b + k] | bit k of qh[b] << 8.

    db = d * (1 + 2*s), s the nibble b % 2 of scales[b // 2]; signs[4b + l] bit j signs value 8l + j.
    """
    d, qs, qh, signs, scales = split(raw, (2, 64, 8, 32, 4))
    hi = ((qh[..., None] >> _BIT8) & 1).reshape(*qh.shape[:-1], 64)
    grid = G.IQ3S_GRID[qs.astype(np.uint16) | (hi.astype(np.uint16) << 8)].astype(_F32)
    s = np.stack([scales & 0x0F, scales >> 4], axis=-1).reshape(*scales.shape[:-1], 8).astype(np.int32)
    db = halves(d) * (1 + 2 * s).astype(_F32)
    return _finish(_groups(db, 4) * grid.reshape(*qs.shape[:-1], 32, 8) * _sign(signs))


def _decode_iq1_s(raw: np.ndarray) -> np.ndarray:
    """d, qs[32], qh u16[8]: per 32 values qh holds 4 x 3 index bits, a 3-bit scale (bits 12-14), the sign of delta.

    Value j of group l in block b = d * (2*s + 1) * (grid[qs[4b+l] | ((qh >> 3l) & 7) << 8][j] + delta),
    delta = -1/8 where bit 15 is set, else +1/8.
    """
    d, qs, qh = split(raw, (2, 32, 16))
    h = _le(qh, 2)  # (..., 8)
    hi = (h[..., None] >> np.array([0, 3, 6, 9], np.uint32)) & 7
    grid = G.IQ1S_GRID[qs.astype(np.uint32) | (hi.reshape(*hi.shape[:-2], 32) << 8)].astype(_F32)
    dl = halves(d) * (2 * ((h >> 12) & 7) + 1).astype(_F32)
    delta = np.where(h & 0x8000, _F32(-0.125), _F32(0.125))
    return _finish(_groups(dl, 4) * (grid + _groups(delta, 4)))


def _decode_iq1_m(raw: np.ndarray) -> np.ndarray:
    """qs[32], qh[16], scales u16[4] (no d field: d is the f16 made of the top nibbles of the 4 scale words).

    Group t (8 values): index qs[t] | (nibble t % 2 of qh[t // 2] & 7) << 8, delta's sign bit 3 of that
    nibble; scale bits 3*(t % 4 // 2) + 6*(t // 4 % 2) of word t // 8, dl = d * (2*s + 1).
    """
    qs, qh, sc = split(raw, (32, 16, 8))
    w = _le(sc, 2)  # (..., 4)
    top = w >> 12
    d = (top[..., 0] | (top[..., 1] << 4) | (top[..., 2] << 8) | (top[..., 3] << 12)).astype(np.uint16)
    d = d.view(F16).astype(_F32)[..., None]
    nib = np.stack([qh & 0x0F, qh >> 4], axis=-1).reshape(*qh.shape[:-1], 32)
    grid = G.IQ1S_GRID[qs.astype(np.uint32) | ((nib & 7).astype(np.uint32) << 8)].astype(_F32)
    delta = np.where(nib & 0x08, _F32(-0.125), _F32(0.125))
    s = (w[..., :, None] >> np.array([0, 3, 6, 9], np.uint32)) & 7  # (..., 4 words, 4 scales)
    dl = d * (2 * s.reshape(*s.shape[:-2], 16) + 1).astype(_F32)
    return _finish(_groups(dl, 2) * (grid + delta[..., None]))


FORMATS = (
    Format("iq2_xxs", QK_K, 66, _decode_iq2_xxs),
    Format("iq2_xs", QK_K, 74, _decode_iq2_xs),
    Format("iq3_xxs", QK_K, 98, _decode_iq3_xxs),
    Format("iq1_s", QK_K, 50, _decode_iq1_s),
    Format("iq3_s", QK_K, 110, _decode_iq3_s),
    Format("iq2_s", QK_K, 82, _decode_iq2_s),
    Format("iq1_m", QK_K, 56, _decode_iq1_m),
)
