"""What the block-format modules share: the `Format` record and float32 helpers that follow C."""

from __future__ import annotations

from typing import Callable, Optional

import attrs
import numpy as np

QK = 32  # values per block of the legacy formats (q4_0 .. q8_0)
QK_K = 256  # values per super-block of the K-quants
F16 = np.dtype("<f2")  # d and m are little-endian IEEE halves inside a block

#: float32 blocks (..., block_size) -> raw blocks (..., block_bytes)
Encode = Callable[[np.ndarray], np.ndarray]
#: raw blocks (..., block_bytes) -> float32 blocks (..., block_size)
Decode = Callable[[np.ndarray], np.ndarray]


@attrs.frozen
class Format:
    """One block format: geometry, and how whole blocks turn into values and back.

    `decode` and `encode` take and give one block per row of their last axis
    (numpy broadcasting over the leading axes); `opdispatch.dtypes` reshapes
    rows of blocks into that form. encode None: opdispatch does not quantize
    to it (`quantize` raises NotImplementedError, naming the format).
    """

    name: str
    block_size: int
    block_bytes: int
    decode: Decode
    encode: Optional[Encode] = None


def first(x: np.ndarray, where: np.ndarray) -> np.ndarray:
    """The first element of each block where `where` holds, keeping the block axis.

    ggml scans a block with strict comparisons, so the first of tied
    candidates wins; that decides the sign of a zero, hence the bytes of d, m.
    """
    return np.take_along_axis(x, np.argmax(where, axis=-1, keepdims=True), axis=-1)


def roundf(v: np.ndarray) -> np.ndarray:
    """C roundf in float32: halves go away from zero (np.rint sends them to even)."""
    t = np.trunc(v)
    return np.where(np.abs(v - t) == np.float32(0.5), t + np.sign(v), np.rint(v))


def split(raw: np.ndarray, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """Consecutive fields of each block, by byte count."""
    return np.split(raw, np.cumsum(sizes)[:-1], axis=-1)


def halves(b: np.ndarray) -> np.ndarray:
    """Little-endian f16 fields (..., 2n bytes) -> their float32 values (..., n)."""
    return b.view(F16).astype(np.float32)


_ROUND_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding it leaves round-to-nearest-even(v) in the low mantissa


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int, bit for bit: float32 v + 1.5*2**23, low 23 bits of the sum, minus 2**22 (int32).

    It is round half to even for |v| <= 4194303 (ggml asserts that only in
    debug builds); beyond, it wraps as the C does, so huge inputs get ggml's codes.
    """
    bits = (np.asarray(v, np.float32) + _ROUND_MAGIC).view(np.int32)
    return (bits & np.int32(0x007FFFFF)) - np.int32(0x00400000)


def f16_round(v: np.ndarray) -> np.ndarray:
    """float32 -> nearest f16 -> float32: GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v)), what a stored d reads back as."""
    return np.asarray(v, np.float32).astype(F16).astype(np.float32)


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 (...,) -> the little-endian f16 bytes (..., 2) ggml stores for it (round to nearest even)."""
    return np.asarray(v, np.float32).astype(F16)[..., None].view(np.uint8)
