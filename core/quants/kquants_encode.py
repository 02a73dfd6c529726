"""ggml's K-quant encoders: quantize_row_q2_K_ref .. quantize_row_q6_K_ref and quantize_row_q8_K_ref, in numpy.

Byte for byte ggml's reference quantizers without importance weights (what
llama-quantize writes without --imatrix). Each super-block of 256 values:
1. a scale search per sub-block (`kquants_search`) gives a float scale (and min);
2. those are quantized to 4-, 6- or 8-bit integers against the super-block's
   f16 d (and dmin);
3. the codes are recomputed from the stored (f16-rounded) scales, as ggml
   does, except in sub-blocks whose stored scale is 0, which keep the search's
   codes;
4. codes and scales are packed as block_q*_K (ggml-common.h; docs/ops.md).
Float32 steps follow C (see kquants_search); integers stored to uint8/int8
fields wrap as C's conversions do. Blocks are encoded a chunk at a time so that
the temporaries of the searches stay small.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .common import QK_K, f16_bytes, f16_round, nearest_int
from .kquants_search import first_absmax, make_q3_quants, make_qkx2_quants, make_qx_quants, seq_sum

F32 = np.float32
_CHUNK = 4096  # super-blocks a pass: the searches' (values, sub-blocks) temporaries stay a few MB
_SHIFT2 = (2 * np.arange(4, dtype=np.int32))[:, None]  # crumb j of a byte sits at bits 2j
_SHIFT1 = np.arange(8, dtype=np.int32)[:, None]  # bit b of a byte


def _columns(x: np.ndarray, n: int) -> np.ndarray:
    """Super-blocks (B, 256) -> sub-blocks as columns (n, B*256/n), the layout kquants_search works in."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _values(codes: np.ndarray, nblocks: int) -> np.ndarray:
    """Columns (n, M) back to super-blocks (B, 256)."""
    return codes.T.reshape(nblocks, QK_K)


def _positive_max(s: np.ndarray) -> np.ndarray:
    """ggml's ``float m = 0; if (s[j] > m) m = s[j];`` over the last axis: +0 unless some s > 0; NaNs never win."""
    m = np.fmax.reduce(s, axis=-1)
    return np.where(m > 0, m, F32(0))


def _recode(
    x: np.ndarray, codes: np.ndarray, d: np.ndarray, lo: int, hi: int, dm: np.ndarray | None = None
) -> np.ndarray:
    """Codes from the stored scales where d != 0, else the search's: (B, 256) -> (B, 256).

    New codes are nearest_int((x + dm)/d) (or x/d) clamped to lo..hi, then
    shifted by -lo so that they count from 0 as the search's do. d, dm (B, S):
    float32 products of the block's f16 scale and a sub-block's integer scale.
    """
    nb, subs = d.shape
    v = x.reshape(nb, subs, -1)
    if dm is not None:
        v = v + dm[..., None]
    new = np.clip(nearest_int(v / d[..., None]), lo, hi) - lo
    return np.where((d != 0)[..., None], new, codes.reshape(nb, subs, -1)).reshape(nb, QK_K)


def _crumbs(codes: np.ndarray) -> np.ndarray:
    """2-bit codes (B, 256) -> (B, 64) bytes: in each 128, value 32j + l goes to bits 2j of byte l."""
    q = codes.reshape(-1, 2, 4, 32)
    return (q << _SHIFT2).sum(axis=2).astype(np.uint8).reshape(-1, 64)


def _bits(flags: np.ndarray) -> np.ndarray:
    """1-bit flags (B, 256) -> (B, 32) bytes: value 32b + l is bit b of byte l."""
    return (flags.reshape(-1, 8, 32).astype(np.int32) << _SHIFT1).sum(axis=1).astype(np.uint8)


def _u8(v: np.ndarray) -> np.ndarray:
    """An int stored into a uint8 field: its low 8 bits, as C's conversion."""
    return (v & 0xFF).astype(np.uint8)


def encode_q2_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_ref: 16 sub-blocks of 16, make_qkx2_quants(nmax 3, mad, w = |x|); 4-bit scales and mins."""
    nb = len(x)
    xc = _columns(x, 16)
    codes, scales, mins = make_qkx2_quants(xc, np.abs(xc), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    q4 = F32(15)
    ls = np.where((max_scale > 0)[:, None], nearest_int((q4 / max_scale)[:, None] * scales), 0)
    lm = np.where((max_min > 0)[:, None], nearest_int((q4 / max_min)[:, None] * mins), 0)
    sc = _u8(ls | (lm << 4))  # scale in the low nibble, min in the high one
    d = np.where(max_scale > 0, max_scale / q4, F32(0))
    dmin = np.where(max_min > 0, max_min / q4, F32(0))
    dl = f16_round(d)[:, None] * (sc & 0x0F).astype(F32)
    ml = f16_round(dmin)[:, None] * (sc >> 4).astype(F32)
    codes = _recode(x, _values(codes, nb), dl, 0, 3, ml)
    return np.concatenate([sc, _crumbs(codes), f16_bytes(d), f16_bytes(dmin)], axis=-1)


def encode_q3_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q3_K_ref: 16 sub-blocks of 16, make_q3_quants(nmax 4, rmse); 6-bit signed scales."""
    nb = len(x)
    codes, scales = make_q3_quants(_columns(x, 16), 4)
    scales = scales.reshape(nb, 16)
    _, max_scale = first_absmax(scales, axis=-1)
    nz = max_scale != 0
    iscale = F32(-32) / max_scale
    l = nearest_int(iscale[:, None] * scales).astype(np.int8).astype(np.int32)  # C: int8_t l = nearest_int(..)
    l6 = np.where(nz[:, None], np.clip(l, -32, 31) + 32, 0)  # a zero max leaves the 12 bytes zero
    d = np.where(nz, F32(1) / iscale, F32(0))
    dl = f16_round(d)[:, None] * (l6 - 32).astype(F32)
    codes = _recode(x, _values(codes, nb), dl, -4, 3)
    lo = (l6[:, :8] & 0x0F) | ((l6[:, 8:] & 0x0F) << 4)
    hi = ((l6.reshape(nb, 4, 4) >> 4) << _SHIFT2[None]).sum(axis=1)  # scale 4g + k: crumb g of byte 8 + k
    sc = np.concatenate([lo, hi], axis=-1).astype(np.uint8)
    return np.concatenate([_bits(codes > 3), _crumbs(codes & 3), sc, f16_bytes(d)], axis=-1)


def _scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins (B, 8) -> q4_K/q5_K's 12 bytes (the inverse of get_scale_min_k4)."""
    lo = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    mid = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    top = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, top], axis=-1).astype(np.uint8)


def _encode_k4(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """q4_K/q5_K's shared part: 8 sub-blocks of 32 -> (codes (B, 256) in 0..nmax, head: d, dmin, scales[12]).

    make_qkx2_quants(squared error) with weights av_x + |x|, av_x the sub-block's RMS.
    """
    nb = len(x)
    xc = _columns(x, 32)
    av_x = np.sqrt(seq_sum(xc * xc) / F32(32))
    codes, scales, mins = make_qkx2_quants(xc, av_x + np.abs(xc), nmax, rmin, 0.1, nstep, False)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    q6 = F32(63)
    inv_scale = np.where(max_scale > 0, q6 / max_scale, F32(0))
    inv_min = np.where(max_min > 0, q6 / max_min, F32(0))
    ls = np.minimum(63, nearest_int(inv_scale[:, None] * scales) & 0xFF)  # C: uint8_t ls = nearest_int(..)
    lm = np.minimum(63, nearest_int(inv_min[:, None] * mins) & 0xFF)
    d, dmin = max_scale / q6, max_min / q6
    dl = f16_round(d)[:, None] * ls.astype(F32)
    ml = f16_round(dmin)[:, None] * lm.astype(F32)
    codes = _recode(x, _values(codes, nb), dl, 0, nmax, ml)
    return codes, np.concatenate([f16_bytes(d), f16_bytes(dmin), _scales_k4(ls, lm)], axis=-1)


def _nibbles_k4(codes: np.ndarray) -> np.ndarray:
    """4-bit codes (B, 256) -> (B, 128): byte l of chunk c holds value 64c + l (low) and 64c + 32 + l (high)."""
    q = codes.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).astype(np.uint8).reshape(-1, 128)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref: make_qkx2_quants(nmax 15, rmin -1, 21 grids); 6-bit scales and mins."""
    codes, head = _encode_k4(x, 15, -1.0, 20)
    return np.concatenate([head, _nibbles_k4(codes)], axis=-1)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref: make_qkx2_quants(nmax 31, rmin -0.5, 16 grids); the 5th bits go to qh."""
    codes, head = _encode_k4(x, 31, -0.5, 15)
    return np.concatenate([head, _bits(codes > 15), _nibbles_k4(codes & 15)], axis=-1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: 16 sub-blocks of 16, make_qx_quants(nmax 32, w = x*x); int8 scales.

    A super-block whose largest |scale| is below 1e-15 is all zero bytes.
    """
    nb = len(x)
    codes, scales = make_qx_quants(_columns(x, 16), 32)
    scales = scales.reshape(nb, 16)
    amax, max_scale = first_absmax(scales, axis=-1)
    iscale = F32(-128) / max_scale
    d = F32(1) / iscale
    sc = np.minimum(127, nearest_int(iscale[:, None] * scales)).astype(np.int8)
    dl = f16_round(d)[:, None] * sc.astype(F32)
    q = _recode(x, _values(codes, nb), dl, -32, 31).reshape(nb, 2, 4, 32)
    lo = q & 15
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=-1)
    qh = ((q >> 4) << _SHIFT2).sum(axis=2)  # value 128h + 32j + l: crumb j of qh byte 32h + l
    raw = np.concatenate(
        [ql.astype(np.uint8).reshape(nb, 128), qh.astype(np.uint8).reshape(nb, 64), sc.view(np.uint8), f16_bytes(d)],
        axis=-1,
    )
    return np.where((amax < F32(1e-15))[:, None], np.uint8(0), raw)


def encode_q8_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref: d = max/-127 as float32, qs = nearest_int(x/d) (int8), bsums = sums of 16 qs.

    An all-zero super-block gets d = 0 and qs = 0; ggml leaves its bsums
    unwritten, opdispatch writes 0 (their sum).
    """
    nb = len(x)
    amax, mx = first_absmax(x, axis=-1)
    iscale = F32(-127) / mx
    qs = np.minimum(127, nearest_int(iscale[:, None] * x)).astype(np.int8)
    zero = amax == 0
    qs = np.where(zero[:, None], np.int8(0), qs)
    d = np.where(zero, F32(0), F32(1) / iscale).astype("<f4")
    bsums = qs.reshape(nb, 16, 16).sum(axis=-1, dtype=np.int32).astype("<i2")
    return np.concatenate([d[:, None].view(np.uint8), qs.view(np.uint8), bsums.view(np.uint8)], axis=-1)


def chunked(encode: Callable[[np.ndarray], np.ndarray], block_bytes: int) -> Callable[[np.ndarray], np.ndarray]:
    """An encoder of (B, 256) blocks -> one of (..., 256) blocks, run _CHUNK super-blocks at a time."""

    def run(x: np.ndarray) -> np.ndarray:
        flat = np.ascontiguousarray(x, dtype=F32).reshape(-1, QK_K)
        out = np.empty((len(flat), block_bytes), np.uint8)
        for at in range(0, len(flat), _CHUNK):
            out[at : at + _CHUNK] = encode(flat[at : at + _CHUNK])
        return out.reshape(*x.shape[:-1], block_bytes)

    return run
