"""ggml's 32-value block formats: q4_0, q4_1, q5_0, q5_1, q8_0 (one shared codec).

`encode` reproduces ggml's ``quantize_row_*_ref`` byte for byte and `decode`
its ``dequantize_row_*``: both evaluate ggml's float32 expressions one IEEE
operation at a time, as the C source reads. A build that fuses ``x*id + 8.5f``
into one FMA (GCC with -march=native does) writes other q4_0/q5_0 codes where
x*id sits next to a half-integer: common for values on a coarse grid, rare for
real weights; gguf-py's quants.py notes the same. Non-finite inputs give
unspecified codes, as in ggml, where they are undefined behaviour.
"""

from __future__ import annotations

import functools
from typing import Literal

import attrs
import numpy as np

from .common import F16, QK, Format, first, roundf


@attrs.frozen
class Codec:
    """What differs between ggml's 32-value block formats; one shared codec runs them all.

    scale_from picks the value the scale d is derived from (d = that / divisor):
      "signed_absmax": the element of largest |x|, sign kept (q4_0, q5_0). The
          divisor is negative so that element lands on code 0 exactly, which
          buys one extra level on its side;
      "absmax": max |x| (q8_0);
      "range": max - min, with min stored as m (q4_1, q5_1: x = q*d + m).
    Codes of bits < 8 are unsigned, q = min(2**bits - 1, trunc((x - m)*id +
    zero + 0.5)) with id = 1/d and m = 0 unless affine, decoded as
    (q - zero)*d + m. 8-bit codes are int8, q = roundf(x*id): halves away from zero.
    """

    bits: Literal[4, 5, 8]
    scale_from: Literal["signed_absmax", "absmax", "range"]
    divisor: int
    zero: int

    @property
    def affine(self) -> bool:
        return self.scale_from == "range"

    @property
    def fields(self) -> tuple[tuple[str, int], ...]:
        """(name, bytes) of one block, in ggml's struct order: d, [m], [qh], qs."""
        return (
            (("d", 2),)
            + ((("m", 2),) if self.affine else ())
            + ((("qh", 4),) if self.bits == 5 else ())
            + (("qs", QK // 2 if self.bits < 8 else QK),)
        )


CODECS: dict[str, Codec] = {
    "q4_0": Codec(bits=4, scale_from="signed_absmax", divisor=-8, zero=8),
    "q4_1": Codec(bits=4, scale_from="range", divisor=15, zero=0),
    "q5_0": Codec(bits=5, scale_from="signed_absmax", divisor=-16, zero=16),
    "q5_1": Codec(bits=5, scale_from="range", divisor=31, zero=0),
    "q8_0": Codec(bits=8, scale_from="absmax", divisor=127, zero=0),
}


def encode(c: Codec, x: np.ndarray) -> np.ndarray:
    """float32 blocks (..., 32) -> raw blocks (..., block_bytes), ggml's f32 steps one by one."""
    m = None
    if c.scale_from == "range":
        m = first(x, x == x.min(axis=-1, keepdims=True))
        ref = first(x, x == x.max(axis=-1, keepdims=True)) - m
    elif c.scale_from == "absmax":
        ref = np.abs(x).max(axis=-1, keepdims=True)
    else:
        amax = np.abs(x).max(axis=-1, keepdims=True)
        # an all-zero block keeps ggml's starting max of +0.0, whatever x's zeros' signs
        ref = np.where(amax > 0, first(x, np.abs(x) == amax), np.float32(0))
    d = ref / np.float32(c.divisor)
    inv = np.where(d != 0, np.float32(1) / d, np.float32(0))
    v = (x if m is None else x - m) * inv

    parts = {"d": d.astype(F16).view(np.uint8)}
    if m is not None:
        parts["m"] = m.astype(F16).view(np.uint8)
    if c.bits == 8:
        parts["qs"] = roundf(v).astype(np.int8).view(np.uint8)
    else:
        q = np.minimum(np.trunc(v + np.float32(c.zero + 0.5)), np.float32(2**c.bits - 1))
        q = q.astype(np.uint8)
        # byte j holds code j (low nibble) and code j + 16 (high nibble)
        parts["qs"] = (q[..., : QK // 2] & 0x0F) | ((q[..., QK // 2 :] & 0x0F) << 4)
        if c.bits == 5:  # 5th bit of code j -> bit j of a little-endian uint32
            parts["qh"] = np.packbits((q >> 4) & 1, axis=-1, bitorder="little")
    return np.concatenate([parts[name] for name, _ in c.fields], axis=-1)


def decode(c: Codec, raw: np.ndarray) -> np.ndarray:
    """Raw blocks (..., block_bytes) -> float32 (..., 32): (q - zero)*d, plus m if affine."""
    parts, at = {}, 0
    for name, size in c.fields:
        parts[name], at = raw[..., at : at + size], at + size
    qs = parts["qs"]
    if c.bits == 8:
        q = qs.view(np.int8)
    else:
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        if c.bits == 5:
            q = q | (np.unpackbits(parts["qh"], axis=-1, bitorder="little") << 4)
    y = (q.astype(np.float32) - np.float32(c.zero)) * parts["d"].view(F16).astype(np.float32)
    if c.affine:
        y = y + parts["m"].view(F16).astype(np.float32)
    return y


FORMATS = tuple(
    Format(name, QK, sum(size for _, size in c.fields), functools.partial(decode, c), functools.partial(encode, c))
    for name, c in CODECS.items()
)
