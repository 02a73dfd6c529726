"""mxfp4 (OCP microscaling FP4), as ggml stores it: 32 values, 17 bytes, both ways.

Block: e (one byte, an e8m0 power of two: 2**(e - 127)), qs[16] (4-bit e2m1
codes; value j in the low nibble of qs[j], value j + 16 in the high one). An
e2m1 code is a sign and the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; ggml keeps
them doubled as integers (`iq_grids.KVALUES_MXFP4`) and halves the scale
instead (ggml_e8m0_to_fp32_half: 2**(e - 128), built from its bits, with
e = 0 and 1 giving the subnormals 2**-128 and 2**-127), so value j =
level(code) * half(e) exactly as ggml's dequantize_row_mxfp4.

The encoder is ggml's quantize_row_mxfp4_ref: e = floor(log2f(amax)) - 2 + 127
(the largest e2m1 magnitude, 6 = 1.5 * 2**2, sits at the top of amax's
octave; amax = 0 gives e = 0), then each value takes the level nearest to
x / half(e), the first of equal distances (so 0 is code 0, never 8). log2f
is taken correctly rounded (float64 log2 rounded to float32), which is what
glibc's log2f returns where it matters: just below a power of two, where
rounding up carries floor() into the next octave. Values below 2**-125
give a negative e that C's cast wraps modulo 256 on x86 (undefined in C);
the same is done here. Non-finite inputs give unspecified bytes.
"""

from __future__ import annotations

import numpy as np

from .common import QK, Format, split
from .iq_grids import KVALUES_MXFP4

_F32 = np.float32
_LEVELS = KVALUES_MXFP4.astype(_F32)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml_e8m0_to_fp32_half: uint8 e -> float32 2**(e - 128), by its bits (never inf or NaN)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(_F32)


def encode(x: np.ndarray) -> np.ndarray:
    """(..., 32) float32 -> (..., 17) blocks, byte for byte ggml's quantize_row_mxfp4_ref."""
    amax = np.fmax.reduce(np.abs(x), axis=-1, keepdims=True, initial=_F32(0))  # C's `amax < |v|` skips NaN
    safe = np.where(amax > 0, amax, _F32(1))
    octave = np.floor(np.log2(safe.astype(np.float64)).astype(_F32))
    e = np.where(amax > 0, octave - _F32(2) + _F32(127), _F32(0))
    e = (e.astype(np.int64) & 0xFF).astype(np.uint8)
    d = e8m0_half(e)
    err = np.abs(d[..., None] * _LEVELS - x[..., None])  # (..., 32, 16): kvalues[i]*d - x, as C
    codes = np.argmin(err, axis=-1).astype(np.uint8)  # first of equal errors, as C's strict `<`
    return np.concatenate([e, codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)


def decode(raw: np.ndarray) -> np.ndarray:
    """(..., 17) blocks -> (..., 32) float32: level(code) * half(e), ggml's dequantize_row_mxfp4."""
    e, qs = split(raw, (1, 16))
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return _LEVELS[codes] * e8m0_half(e)


FORMATS = (Format("mxfp4", QK, 17, decode, encode),)
