"""Dtype table and ggml's block-quantized formats, on the host (numpy only).

Quantized tensors are stored exactly as ggml stores them (so GGUF weights load
without conversion): a row of K values is K // block_size blocks of
`block_bytes` raw bytes (32 values a block, 256 for the K-quants), held on the
host as ``np.uint8`` arrays of shape ``(..., K // block_size * block_bytes)``.
`quantize` reproduces ggml's reference quantizers (``quantize_row_*_ref`` in
ggml-quants.c) byte for byte for the 32-value formats (the K-quants have none
here yet), and `dequantize` its ``dequantize_row_*`` for all: both evaluate
ggml's float32 expressions one IEEE operation at a time, as the C source reads.
A build that fuses ``x*id + 8.5f`` into one FMA (GCC with -march=native does)
writes other q4_0/q5_0 codes where x*id sits next to a half-integer: common for
values on a coarse grid, rare for real weights; gguf-py's quants.py notes the
same. Non-finite inputs give unspecified codes, as in ggml, where they are
undefined behaviour.

bf16 values live in ``ml_dtypes.bfloat16`` arrays; f32 -> bf16 uses ggml's own
bit formula (round to nearest even, NaN made quiet) so even NaN payloads match.
"""

from __future__ import annotations

import functools
from typing import Literal

import attrs
import ml_dtypes
import numpy as np

__all__ = [
    "DType", "DTYPES", "dtype", "quantize", "dequantize", "to_host_float", "from_float",
    "F32", "F16", "BF16", "I8", "I16", "I32", "I64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
]

QK = 32  # values per block of the legacy formats (q4_0 .. q8_0)
QK_K = 256  # values per super-block of the K-quants
_F16 = np.dtype("<f2")  # d and m are little-endian IEEE halves inside a block


@attrs.frozen
class DType:
    """One element type: its name, its host storage, and its block geometry.

    Plain types are blocks of one element (block_bytes == itemsize), so byte
    arithmetic is the same for every type: see `row_bytes`.
    """

    name: str
    block_size: int
    block_bytes: int
    kind: str = attrs.field(validator=attrs.validators.in_(("float", "int", "quant")))
    numpy: np.dtype

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind == "int"

    @property
    def is_quant(self) -> bool:
        return self.kind == "quant"

    def row_bytes(self, n: int) -> int:
        """Bytes of n contiguous elements; a quantized row must hold whole blocks."""
        if n < 0 or n % self.block_size:
            raise ValueError(
                f"{self.name}: {n} elements is not a whole number of {self.block_size}-element blocks"
            )
        return n // self.block_size * self.block_bytes

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DType({self.name!r})"


_U8 = np.dtype(np.uint8)
F32 = DType("f32", 1, 4, "float", np.dtype(np.float32))
F16 = DType("f16", 1, 2, "float", np.dtype(np.float16))
BF16 = DType("bf16", 1, 2, "float", np.dtype(ml_dtypes.bfloat16))
I8 = DType("i8", 1, 1, "int", np.dtype(np.int8))
I16 = DType("i16", 1, 2, "int", np.dtype(np.int16))
I32 = DType("i32", 1, 4, "int", np.dtype(np.int32))
I64 = DType("i64", 1, 8, "int", np.dtype(np.int64))
Q4_0 = DType("q4_0", QK, 18, "quant", _U8)
Q4_1 = DType("q4_1", QK, 20, "quant", _U8)
Q5_0 = DType("q5_0", QK, 22, "quant", _U8)
Q5_1 = DType("q5_1", QK, 24, "quant", _U8)
Q8_0 = DType("q8_0", QK, 34, "quant", _U8)
Q2_K = DType("q2_K", QK_K, 84, "quant", _U8)
Q3_K = DType("q3_K", QK_K, 110, "quant", _U8)
Q4_K = DType("q4_K", QK_K, 144, "quant", _U8)
Q5_K = DType("q5_K", QK_K, 176, "quant", _U8)
Q6_K = DType("q6_K", QK_K, 210, "quant", _U8)

DTYPES: dict[str, DType] = {
    t.name: t
    for t in (F32, F16, BF16, I8, I16, I32, I64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
}
# Quantized data is raw uint8, so a numpy dtype only ever names a plain type.
_BY_NUMPY: dict[np.dtype, DType] = {t.numpy: t for t in DTYPES.values() if not t.is_quant}


def dtype(x: str | DType | np.dtype | type) -> DType:
    """Look up a DType by opdispatch name, DType, or numpy dtype (float32, bfloat16, int8...).

    Strings are opdispatch names only: numpy's own "i8" means int64, ours int8.
    """
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        found = DTYPES.get(x)
    else:
        try:
            found = _BY_NUMPY.get(np.dtype(x))
        except (TypeError, ValueError):
            found = None
    if found is None:
        raise ValueError(f"unknown dtype {x!r}: known dtypes are {', '.join(DTYPES)}")
    return found


# ---------------------------------------------------------------------------
# Block-quantized formats


@attrs.frozen
class _Codec:
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


_CODECS: dict[str, _Codec] = {
    "q4_0": _Codec(bits=4, scale_from="signed_absmax", divisor=-8, zero=8),
    "q4_1": _Codec(bits=4, scale_from="range", divisor=15, zero=0),
    "q5_0": _Codec(bits=5, scale_from="signed_absmax", divisor=-16, zero=16),
    "q5_1": _Codec(bits=5, scale_from="range", divisor=31, zero=0),
    "q8_0": _Codec(bits=8, scale_from="absmax", divisor=127, zero=0),
}


def _quant(dt: DType | str) -> DType:
    dt = dtype(dt)
    if not dt.is_quant:
        quants = ", ".join(t.name for t in DTYPES.values() if t.is_quant)
        raise ValueError(f"{dt} is not a block-quantized dtype (one of {quants})")
    return dt


def _first(x: np.ndarray, where: np.ndarray) -> np.ndarray:
    """The first element of each block where `where` holds, keeping the block axis.

    ggml scans a block with strict comparisons, so the first of tied
    candidates wins; that decides the sign of a zero, hence the bytes of d, m.
    """
    return np.take_along_axis(x, np.argmax(where, axis=-1, keepdims=True), axis=-1)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf in float32: halves go away from zero (np.rint sends them to even)."""
    t = np.trunc(v)
    return np.where(np.abs(v - t) == np.float32(0.5), t + np.sign(v), np.rint(v))


def _encode(c: _Codec, x: np.ndarray) -> np.ndarray:
    """float32 blocks (..., 32) -> raw blocks (..., block_bytes), ggml's f32 steps one by one."""
    m = None
    if c.scale_from == "range":
        m = _first(x, x == x.min(axis=-1, keepdims=True))
        ref = _first(x, x == x.max(axis=-1, keepdims=True)) - m
    elif c.scale_from == "absmax":
        ref = np.abs(x).max(axis=-1, keepdims=True)
    else:
        amax = np.abs(x).max(axis=-1, keepdims=True)
        # an all-zero block keeps ggml's starting max of +0.0, whatever x's zeros' signs
        ref = np.where(amax > 0, _first(x, np.abs(x) == amax), np.float32(0))
    d = ref / np.float32(c.divisor)
    inv = np.where(d != 0, np.float32(1) / d, np.float32(0))
    v = (x if m is None else x - m) * inv

    parts = {"d": d.astype(_F16).view(np.uint8)}
    if m is not None:
        parts["m"] = m.astype(_F16).view(np.uint8)
    if c.bits == 8:
        parts["qs"] = _roundf(v).astype(np.int8).view(np.uint8)
    else:
        q = np.minimum(np.trunc(v + np.float32(c.zero + 0.5)), np.float32(2**c.bits - 1))
        q = q.astype(np.uint8)
        # byte j holds code j (low nibble) and code j + 16 (high nibble)
        parts["qs"] = (q[..., : QK // 2] & 0x0F) | ((q[..., QK // 2 :] & 0x0F) << 4)
        if c.bits == 5:  # 5th bit of code j -> bit j of a little-endian uint32
            parts["qh"] = np.packbits((q >> 4) & 1, axis=-1, bitorder="little")
    return np.concatenate([parts[name] for name, _ in c.fields], axis=-1)


def _decode(c: _Codec, raw: np.ndarray) -> np.ndarray:
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
    y = (q.astype(np.float32) - np.float32(c.zero)) * parts["d"].view(_F16).astype(np.float32)
    if c.affine:
        y = y + parts["m"].view(_F16).astype(np.float32)
    return y


# ---------------------------------------------------------------------------
# K-quants: super-blocks of 256 values in sub-blocks of 16 (q2_K, q3_K, q6_K)
# or 32 (q4_K, q5_K), each sub-block with its own integer scale (and min) times
# the super-block's f16 d (and dmin). Layouts as ggml-common.h's block_q*_K;
# the decoders evaluate ggml's dequantize_row_q*_K float32 expressions in its
# order: (d*sc)*q - (dmin*m), so the values match bit for bit.

_SHIFT2 = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]  # four 2-bit fields of a byte, low first
_SHIFT1 = np.arange(8, dtype=np.uint8)[:, None]  # eight 1-bit fields of a byte, low first


def _split(raw: np.ndarray, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """Consecutive fields of each block, by byte count."""
    return np.split(raw, np.cumsum(sizes)[:-1], axis=-1)


def _halves(b: np.ndarray) -> np.ndarray:
    return b.view(_F16).astype(np.float32)


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
    scales, qs, d, dmin = _split(raw, (16, 64, 2, 2))
    q = _crumbs(qs.reshape(*qs.shape[:-1], 2, 32)).astype(np.float32)
    dl = _halves(d) * (scales & 0x0F).astype(np.float32)
    ml = _halves(dmin) * (scales >> 4).astype(np.float32)
    return _per_sub(dl, q) - np.repeat(ml, 16, axis=-1)


def _decode_q3_k(raw: np.ndarray) -> np.ndarray:
    """hmask[32] (3rd bits), qs[64] (low 2 bits), scales[12] (16 six-bit scales, offset 32), d.

    A code is its low 2 bits minus 4 where its hmask bit is clear. Scale i has
    its low 4 bits in nibble i // 8 of byte i % 8 and its top 2 bits in
    crumb i // 4 of byte 8 + i % 4.
    """
    hmask, qs, sc, d = _split(raw, (32, 64, 12, 2))
    low = _crumbs(qs.reshape(*qs.shape[:-1], 2, 32)).astype(np.int8)
    q = (low - 4 * (1 - _bits(hmask)).astype(np.int8)).astype(np.float32)
    lo4 = np.concatenate([sc[..., :8] & 0x0F, sc[..., :8] >> 4], axis=-1)
    hi2 = ((sc[..., None, 8:12] >> _SHIFT2) & 3).reshape(*sc.shape[:-1], 16)
    scale = ((lo4 | (hi2 << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    return _per_sub(_halves(d) * scale, q)


def _decode_q4_k(raw: np.ndarray) -> np.ndarray:
    """d, dmin, scales[12] (8 six-bit scales and mins, see _scale_min_k4), qs[128] (4-bit codes)."""
    d, dmin, sc, qs = _split(raw, (2, 2, 12, 128))
    scale, mins = _scale_min_k4(sc)
    q = _nibbles_k4(qs).astype(np.float32)
    return _per_sub(_halves(d) * scale, q) - np.repeat(_halves(dmin) * mins, 32, axis=-1)


def _decode_q5_k(raw: np.ndarray) -> np.ndarray:
    """q4_K's fields plus qh[32] before qs: the 5th bit of value 32s + l is bit s of qh[l]."""
    d, dmin, sc, qh, qs = _split(raw, (2, 2, 12, 32, 128))
    scale, mins = _scale_min_k4(sc)
    q = (_nibbles_k4(qs) | (_bits(qh) << 4)).astype(np.float32)
    return _per_sub(_halves(d) * scale, q) - np.repeat(_halves(dmin) * mins, 32, axis=-1)


def _decode_q6_k(raw: np.ndarray) -> np.ndarray:
    """ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d; codes offset 32.

    In half n, ql's 64 bytes give values 128n + m (low nibble) and 128n + 64 + m
    (high nibble); qh's 32 bytes give values 128n + 32j + l their top bits as
    crumb j of byte l.
    """
    ql, qh, sc, d = _split(raw, (128, 64, 16, 2))
    b = ql.reshape(*ql.shape[:-1], 2, 1, 64)
    low = np.concatenate([b & 0x0F, b >> 4], axis=-2).reshape(*ql.shape[:-1], QK_K)
    q = ((low | (_crumbs(qh.reshape(*qh.shape[:-1], 2, 32)) << 4)).astype(np.int8) - np.int8(32))
    return _per_sub(_halves(d) * sc.view(np.int8).astype(np.float32), q.astype(np.float32))


_K_DECODERS = {
    "q2_K": _decode_q2_k, "q3_K": _decode_q3_k, "q4_K": _decode_q4_k, "q5_K": _decode_q5_k, "q6_K": _decode_q6_k,
}


def quantize(dt: DType | str, x: np.ndarray) -> np.ndarray:
    """float (..., K) -> uint8 (..., K // 32 * block_bytes), byte-exact with ggml's quantize_row_*_ref.

    x is rounded to float32 first, the type ggml quantizes from. The K-quants
    have no quantizer here yet (dequantize only).
    """
    dt = _quant(dt)
    if dt.name not in _CODECS:
        raise NotImplementedError(f"quantize to {dt}: not implemented (opdispatch only dequantizes it)")
    c = _CODECS[dt.name]
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK:
        raise ValueError(
            f"quantize to {dt}: the last axis must be whole blocks of {QK} values, got shape {x.shape}"
        )
    lead, nb = x.shape[:-1], x.shape[-1] // QK
    with np.errstate(all="ignore"):  # d == 0 and non-finite input follow ggml silently
        raw = _encode(c, x.reshape(*lead, nb, QK))
    return raw.reshape(*lead, nb * dt.block_bytes)


def dequantize(dt: DType | str, raw: np.ndarray, n: int | None = None) -> np.ndarray:
    """uint8 (..., nbytes) -> float32 (..., values), as ggml's dequantize_row_*.

    n (optional) is how many values each row holds, as ggml's k argument: the
    first row_bytes(n) bytes of each row are decoded and any bytes after them
    ignored. Without n the whole last axis is decoded and must be whole blocks.
    """
    dt = _quant(dt)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise TypeError(f"dequantize {dt}: expected raw uint8 blocks, got {raw.dtype} of shape {raw.shape}")
    nbytes = raw.shape[-1] if raw.ndim else 0
    if n is None:
        if raw.ndim == 0 or nbytes % dt.block_bytes:
            raise ValueError(
                f"dequantize {dt}: the last axis must be whole {dt.block_bytes}-byte blocks, "
                f"got shape {raw.shape}"
            )
        n = nbytes // dt.block_bytes * dt.block_size
    elif dt.row_bytes(n) > nbytes:
        raise ValueError(
            f"dequantize {dt}: {n} values take {dt.row_bytes(n)} bytes a row, got shape {raw.shape}"
        )
    lead, nb = raw.shape[:-1], n // dt.block_size
    blocks = np.ascontiguousarray(raw[..., : nb * dt.block_bytes]).reshape(*lead, nb, dt.block_bytes)
    decode = _K_DECODERS.get(dt.name) or functools.partial(_decode, _CODECS[dt.name])
    with np.errstate(all="ignore"):  # inf/NaN scales decode to inf/NaN, as in ggml
        return decode(blocks).reshape(*lead, n)


# ---------------------------------------------------------------------------
# Conversions between host storage and float values


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16 on the bits: round to nearest even, NaN made quiet.

    ml_dtypes' cast rounds the same but rewrites NaN payloads and warns on them.
    """
    u = x.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16  # uint32 wraps, as in C
    bits = np.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, rounded)
    return bits.astype(np.uint16).view(ml_dtypes.bfloat16)


def to_host_float(dt: DType | str, arr: np.ndarray) -> np.ndarray:
    """Host storage of dt -> values, as a new C-contiguous array.

    Floats give float32, quantized rows (raw uint8) their dequantized float32,
    integers stay integers of their own dtype (an i64 does not fit a float).
    """
    dt = dtype(dt)
    if dt.is_quant:
        return dequantize(dt, arr)
    arr = np.asarray(arr)
    if arr.dtype != dt.numpy:
        raise TypeError(f"to_host_float: {dt} is stored as {dt.numpy}, got {arr.dtype} of shape {arr.shape}")
    return arr.astype(np.float32 if dt.is_float else dt.numpy, order="C")


def from_float(dt: DType | str, values: np.ndarray) -> np.ndarray:
    """Values -> host storage of dt (a new C-contiguous array), rounded as ggml's copy from f32.

    Values are rounded to float32 first (ggml holds them so), then: f16/bf16
    round to nearest even (overflow gives inf), integers truncate toward zero
    like C's cast (ggml_cpu_fp32_to_i32), quantized types go through
    `quantize`. Integer values bound for an integer type are cast directly,
    so large ones keep every digit.
    """
    dt = dtype(dt)
    values = np.asarray(values)
    if dt.is_int and values.dtype.kind in "biu":
        return values.astype(dt.numpy, order="C")
    x = values.astype(np.float32, order="C")
    if dt.is_quant:
        return quantize(dt, x)
    if dt == BF16:
        return _f32_to_bf16(x)
    with np.errstate(over="ignore", invalid="ignore"):  # inf, and out-of-range ints as C leaves them
        return x.astype(dt.numpy)
