"""The dtype table, and ggml's block-quantized formats on the host (numpy only).

Quantized tensors are stored exactly as ggml stores them (so GGUF weights load
without conversion): a row of K values is K // block_size blocks of
`block_bytes` raw bytes (32 or 256 values a block, by format), held on the
host as ``np.uint8`` arrays of shape ``(..., K // block_size * block_bytes)``.
Each format is defined once, in `opdispatch.quants` (its layout, its decoder
and, where opdispatch has one, its encoder); `quantize` and `dequantize` here
serve them all, byte for byte ggml's ``quantize_row_*_ref`` and
``dequantize_row_*``.

bf16 values live in ``ml_dtypes.bfloat16`` arrays; f32 -> bf16 uses ggml's own
bit formula (round to nearest even, NaN made quiet) so even NaN payloads match.
"""

from __future__ import annotations

import attrs
import ml_dtypes
import numpy as np

from .quants import FORMATS

__all__ = [
    "DType", "DTYPES", "dtype", "quantize", "dequantize", "to_host_float", "from_float",
    "F32", "F16", "BF16", "I8", "I16", "I32", "I64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
    "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ3_S", "IQ2_S", "IQ1_M", "MXFP4",
]


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
_QUANTS = {name: DType(name, f.block_size, f.block_bytes, "quant", _U8) for name, f in FORMATS.items()}
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (_QUANTS[n] for n in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"))
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = (_QUANTS[n] for n in ("q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "q8_K"))
IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M, MXFP4 = (
    _QUANTS[n] for n in ("iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s", "iq3_s", "iq2_s", "iq1_m", "mxfp4")
)

DTYPES: dict[str, DType] = {t.name: t for t in (F32, F16, BF16, I8, I16, I32, I64)} | _QUANTS
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


def _quant(dt: DType | str) -> DType:
    dt = dtype(dt)
    if not dt.is_quant:
        quants = ", ".join(t.name for t in DTYPES.values() if t.is_quant)
        raise ValueError(f"{dt} is not a block-quantized dtype (one of {quants})")
    return dt


def encodable(dt: DType | str) -> bool:
    """Can float values be written in `dt`: not a block format opdispatch only dequantizes (the grid I-quants)."""
    dt = dtype(dt)
    return not dt.is_quant or FORMATS[dt.name].encode is not None


def quantize(dt: DType | str, x: np.ndarray) -> np.ndarray:
    """float (..., K) -> uint8 (..., K // block_size * block_bytes), byte-exact with ggml's quantize_row_*_ref.

    x is rounded to float32 first, the type ggml quantizes from. A format
    opdispatch only dequantizes raises NotImplementedError.
    """
    dt = _quant(dt)
    fmt = FORMATS[dt.name]
    if fmt.encode is None:
        raise NotImplementedError(f"quantize to {dt}: not implemented (opdispatch only dequantizes it)")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % dt.block_size:
        raise ValueError(
            f"quantize to {dt}: the last axis must be whole blocks of {dt.block_size} values, got shape {x.shape}"
        )
    lead, nb = x.shape[:-1], x.shape[-1] // dt.block_size
    with np.errstate(all="ignore"):  # d == 0 and non-finite input follow ggml silently
        raw = fmt.encode(x.reshape(*lead, nb, dt.block_size))
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
    with np.errstate(all="ignore"):  # inf/NaN scales decode to inf/NaN, as in ggml
        return FORMATS[dt.name].decode(blocks).reshape(*lead, n)


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
