"""ggml's K-quants: super-blocks of 256 values, q2_K .. q6_K, and q8_K.

Each super-block holds sub-blocks of 16 (q2_K, q3_K, q6_K) or 32 (q4_K, q5_K)
values, each sub-block with its own integer scale (and min) times the
super-block's f16 d (and dmin); q8_K (ggml's 8-bit dot-product operand) is a
float32 d, 256 int8 codes and their sums by 16. Layouts as ggml-common.h's
block_q*_K; the decoders evaluate ggml's dequantize_row_q*_K float32
expressions in its order: (d*sc)*q - (dmin*m), so the values match bit for
bit. The encoders (`kquants_encode`) are byte for byte ggml's quantize_row_*_ref.
"""

from __future__ import annotations

import numpy as np

from . import kquants_encode as encode
from .common import QK_K, Format, halves, split

_SHIFT2 = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]  # four 2-bit fields of a byte, low first
_SHIFT1 = np.arange(8, dtype=np.uint8)[:, None]  # eight 1-bit fields of a byte, low first


def _crumbs(b: np.ndarray) -> np.ndarray:
    """2-bit fields of (..., 2, 32) bytes -> (..., 256): value 128n + 32j + l is bits 2j of byte (n, l)."""
    return ((b[..., :, None, :] >> _SHIFT2) & 3).reshape(*b.shape[:-2], QK_K)


def _bits(b: np.ndarray) -> np.ndarray:
    """1-bit fields of (..., 32) bytes -> (..., 256): value 32j + l is bit j of byte l."""
    return ((b[..., None, :] >> _SHIFT1) & 1).reshape(*b.shape[:-1], QK_K)


def _per_sub(scale: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Scale (..., S) times codes (..., 256), each scale covering 256 // S consecutive values."""
    s = scale.shape[-1]
    return (scale[..., None] * q.reshape(*q.shape[:-1], s, QK_K // s)).reshape(q.shape)


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4_K/q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4).

    Sub-blocks 0-3 hold scale and min in the low 6 bits of bytes 0-3 and 4-7;
    sub-blocks 4-7 take their low 4 bits from the nibbles of bytes 8-11 and
    their top 2 bits from the top bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    lo, mid, top = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([lo & 63, (top & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scale.astype(np.float32), mins.astype(np.float32)


def _nibbles_k4(qs: np.ndarray) -> np.ndarray:
    """q4_K/q5_K's 128 bytes -> 256 4-bit codes.

    Byte l of 32-byte chunk c holds value 64c + l (low nibble) and 64c + 32 + l (high).
    """
    b = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([b & 0x0F, b >> 4], axis=-2).reshape(*qs.shape[:-1], QK_K)


def _decode_q2_k(raw: np.ndarray) -> np.ndarray:
    """scales[16] (low nibble scale, high nibble min), qs[64] (2-bit codes), d, dmin."""
    scales, qs, d, dmin = split(raw, (16, 64, 2, 2))
    q = _crumbs(qs.reshape(*qs.shape[:-1], 2, 32)).astype(np.float32)
    dl = halves(d) * (scales & 0x0F).astype(np.float32)
    ml = halves(dmin) * (scales >> 4).astype(np.float32)
    return _per_sub(dl, q) - np.repeat(ml, 16, axis=-1)


def _decode_q3_k(raw: np.ndarray) -> np.ndarray:
    """hmask[32] (3rd bits), qs[64] (low 2 bits), scales[12] (16 six-bit scales, offset 32), d.

    A code is its low 2 bits minus 4 where its hmask bit is clear. Scale i has
    its low 4 bits in nibble i // 8 of byte i % 8 and its top 2 bits in
    crumb i // 4 of byte 8 + i % 4.
    """
    hmask, qs, sc, d = split(raw, (32, 64, 12, 2))
    low = _crumbs(qs.reshape(*qs.shape[:-1], 2, 32)).astype(np.int8)
    q = (low - 4 * (1 - _bits(hmask)).astype(np.int8)).astype(np.float32)
    lo4 = np.concatenate([sc[..., :8] & 0x0F, sc[..., :8] >> 4], axis=-1)
    hi2 = ((sc[..., None, 8:12] >> _SHIFT2) & 3).reshape(*sc.shape[:-1], 16)
    scale = ((lo4 | (hi2 << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    return _per_sub(halves(d) * scale, q)


def _decode_q4_k(raw: np.ndarray) -> np.ndarray:
    """d, dmin, scales[12] (8 six-bit scales and mins, see _scale_min_k4), qs[128] (4-bit codes)."""
    d, dmin, sc, qs = split(raw, (2, 2, 12, 128))
    scale, mins = _scale_min_k4(sc)
    q = _nibbles_k4(qs).astype(np.float32)
    return _per_sub(halves(d) * scale, q) - np.repeat(halves(dmin) * mins, 32, axis=-1)


def _decode_q5_k(raw: np.ndarray) -> np.ndarray:
    """q4_K's fields plus qh[32] before qs: the 5th bit of value 32s + l is bit s of qh[l]."""
    d, dmin, sc, qh, qs = split(raw, (2, 2, 12, 32, 128))
    scale, mins = _scale_min_k4(sc)
    q = (_nibbles_k4(qs) | (_bits(qh) << 4)).astype(np.float32)
    return _per_sub(halves(d) * scale, q) - np.repeat(halves(dmin) * mins, 32, axis=-1)


def _decode_q6_k(raw: np.ndarray) -> np.ndarray:
    """ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d; codes offset 32.

    In half n, ql's 64 bytes give values 128n + m (low nibble) and 128n + 64 + m
    (high nibble); qh's 32 bytes give values 128n + 32j + l their top bits as
    crumb j of byte l.
    """
    ql, qh, sc, d = split(raw, (128, 64, 16, 2))
    b = ql.reshape(*ql.shape[:-1], 2, 1, 64)
    low = np.concatenate([b & 0x0F, b >> 4], axis=-2).reshape(*ql.shape[:-1], QK_K)
    q = ((low | (_crumbs(qh.reshape(*qh.shape[:-1], 2, 32)) << 4)).astype(np.int8) - np.int8(32))
    return _per_sub(halves(d) * sc.view(np.int8).astype(np.float32), q.astype(np.float32))


def _decode_q8_k(raw: np.ndarray) -> np.ndarray:
    """d (f32), qs[256] (int8), bsums[16] (int16, unused here): d * q, as dequantize_row_q8_K."""
    d, qs, _ = split(raw, (4, QK_K, 32))
    return np.ascontiguousarray(d).view("<f4") * qs.view(np.int8).astype(np.float32)


FORMATS = tuple(
    Format(name, QK_K, block_bytes, decode, encode.chunked(encoder, block_bytes))
    for name, block_bytes, decode, encoder in (
        ("q2_K", 84, _decode_q2_k, encode.encode_q2_k),
        ("q3_K", 110, _decode_q3_k, encode.encode_q3_k),
        ("q4_K", 144, _decode_q4_k, encode.encode_q4_k),
        ("q5_K", 176, _decode_q5_k, encode.encode_q5_k),
        ("q6_K", 210, _decode_q6_k, encode.encode_q6_k),
        ("q8_K", 292, _decode_q8_k, encode.encode_q8_k),
    )
)
