"""Tests for opdispatch.dtypes: the dtype table and ggml's block-quantized formats.

The block layouts are checked against blocks packed by hand here with struct,
from ggml's block_q* struct definitions, not through quantize. quantize is
checked by hand-worked known answers, against a scalar transcription of ggml's
loops on inputs full of rounding ties, by error bounds derived from each
format, and by reproducing any block it could itself have written.

Random inputs come from a fresh seed each run, printed on failure; set
OPDISPATCH_TEST_SEED to replay one.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

from opdispatch import dtypes as D

QUANT = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]


# ---------------------------------------------------------------------------
# An independent statement of the formats (ggml-common.h / ggml-quants.c)


# name: (bits, zero, has m). Decode: (q - zero)*d + m; 5-bit codes keep their
# 5th bit in a uint32 qh; 8-bit codes are int8.
FORMATS = {
    "q4_0": (4, 8, False),
    "q4_1": (4, 0, True),
    "q5_0": (5, 16, False),
    "q5_1": (5, 0, True),
    "q8_0": (8, 0, False),
}


def pack_block(name: str, d: float, codes: list[int], m: float = 0.0) -> bytes:
    """One block, byte by byte: d (f16), [m (f16)], [qh (uint32 LE)], qs."""
    bits, _, has_m = FORMATS[name]
    out = struct.pack("<e", d) + (struct.pack("<e", m) if has_m else b"")
    if bits == 8:
        return out + struct.pack("<32b", *codes)
    if bits == 5:
        out += struct.pack("<I", sum(((q >> 4) & 1) << j for j, q in enumerate(codes)))
    return out + bytes((codes[j] & 0xF) | (codes[j + 16] & 0xF) << 4 for j in range(16))


def decode_formula(name: str, d: float, codes: list[int], m: float = 0.0) -> np.ndarray:
    """(q - zero)*d + m, exact in float64 for the moderate d and m used here, rounded once."""
    _, zero, _ = FORMATS[name]
    return np.array([(q - zero) * d + m for q in codes], dtype=np.float64).astype(np.float32)


def f16(v: float) -> float:
    return float(np.float16(v))


def random_codes(rng: np.random.Generator, name: str) -> list[int]:
    bits = FORMATS[name][0]
    lo, hi = (-128, 127) if bits == 8 else (0, 2**bits - 1)
    return [int(q) for q in rng.integers(lo, hi + 1, 32)]


def block_d(raw_block: np.ndarray) -> float:
    return float(raw_block[:2].view("<f2")[0])


# ---------------------------------------------------------------------------
# The table


TABLE = [
    ("f32", 1, 4, "float", np.float32),
    ("f16", 1, 2, "float", np.float16),
    ("bf16", 1, 2, "float", ml_dtypes.bfloat16),
    ("i8", 1, 1, "int", np.int8),
    ("i16", 1, 2, "int", np.int16),
    ("i32", 1, 4, "int", np.int32),
    ("i64", 1, 8, "int", np.int64),
    ("q4_0", 32, 18, "quant", np.uint8),
    ("q4_1", 32, 20, "quant", np.uint8),
    ("q5_0", 32, 22, "quant", np.uint8),
    ("q5_1", 32, 24, "quant", np.uint8),
    ("q8_0", 32, 34, "quant", np.uint8),
    ("q2_K", 256, 84, "quant", np.uint8),
    ("q3_K", 256, 110, "quant", np.uint8),
    ("q4_K", 256, 144, "quant", np.uint8),
    ("q5_K", 256, 176, "quant", np.uint8),
    ("q6_K", 256, 210, "quant", np.uint8),
    ("q8_K", 256, 292, "quant", np.uint8),
    ("iq4_nl", 32, 18, "quant", np.uint8),
    ("iq4_xs", 256, 136, "quant", np.uint8),
    ("iq2_xxs", 256, 66, "quant", np.uint8),
    ("iq2_xs", 256, 74, "quant", np.uint8),
    ("iq3_xxs", 256, 98, "quant", np.uint8),
    ("iq1_s", 256, 50, "quant", np.uint8),
    ("iq3_s", 256, 110, "quant", np.uint8),
    ("iq2_s", 256, 82, "quant", np.uint8),
    ("iq1_m", 256, 56, "quant", np.uint8),
    ("mxfp4", 32, 17, "quant", np.uint8),
]


@pytest.mark.parametrize("name, block_size, block_bytes, kind, np_type", TABLE)
def test_table(name, block_size, block_bytes, kind, np_type):
    dt = D.DTYPES[name]
    assert getattr(D, name.upper()) is dt
    assert (dt.name, dt.block_size, dt.block_bytes, dt.kind) == (name, block_size, block_bytes, kind)
    assert dt.numpy == np.dtype(np_type)
    assert (dt.is_float, dt.is_int, dt.is_quant) == (kind == "float", kind == "int", kind == "quant")
    assert str(dt) == name and name in repr(dt)
    assert hash(dt) == hash(D.dtype(name))


def test_table_order_and_sizes():
    assert list(D.DTYPES) == [row[0] for row in TABLE]
    for name in QUANT:  # d + [m] + [qh] + qs, from the struct definitions
        bits, _, has_m = FORMATS[name]
        assert D.DTYPES[name].block_bytes == 2 + 2 * has_m + 4 * (bits == 5) + (32 if bits == 8 else 16)


def test_dtype_lookup():
    for name, dt in D.DTYPES.items():
        assert D.dtype(name) is dt and D.dtype(dt) is dt
    assert D.dtype(np.float32) is D.F32
    assert D.dtype(np.dtype("float16")) is D.F16
    assert D.dtype(ml_dtypes.bfloat16) is D.BF16
    assert D.dtype(np.dtype(ml_dtypes.bfloat16)) is D.BF16
    for t, dt in [(np.int8, D.I8), (np.int16, D.I16), (np.int32, D.I32), (np.int64, D.I64)]:
        assert D.dtype(t) is dt and D.dtype(np.dtype(t)) is dt


@pytest.mark.parametrize("bad", ["f64", "float32", "Q4_0", np.float64, np.uint8, np.dtype("complex64"), 3])
def test_dtype_lookup_errors(bad):
    with pytest.raises(ValueError, match="known dtypes are f32, f16, bf16, .*q8_0") as err:
        D.dtype(bad)
    assert repr(bad) in str(err.value)


def test_row_bytes():
    assert D.F32.row_bytes(5) == 20
    assert D.BF16.row_bytes(7) == 14
    assert D.I64.row_bytes(3) == 24
    assert D.Q4_0.row_bytes(64) == 36
    assert D.Q8_0.row_bytes(0) == 0
    assert D.Q5_1.row_bytes(96) == 72
    with pytest.raises(ValueError, match=r"q8_0: 33 elements"):
        D.Q8_0.row_bytes(33)
    with pytest.raises(ValueError, match="q4_1"):
        D.Q4_1.row_bytes(-32)


# ---------------------------------------------------------------------------
# Layouts, against hand-packed blocks


@pytest.mark.parametrize("name", QUANT)
def test_dequantize_hand_built_blocks(rng, name):
    """Blocks written with struct decode to (q - zero)*d + m, over batch dims."""
    lead, nb = (2, 3), 4
    raw, want = bytearray(), []
    for _ in range(int(np.prod(lead)) * nb):
        d = f16(rng.choice([-1, 1]) * 2.0 ** rng.uniform(-10, 4))
        m = f16(rng.choice([-1, 1]) * 2.0 ** rng.uniform(-10, 5))
        codes = random_codes(rng, name)
        raw += pack_block(name, d, codes, m)
        want.append(decode_formula(name, d, codes, m if FORMATS[name][2] else 0.0))
    raw_arr = np.frombuffer(bytes(raw), np.uint8).reshape(*lead, nb * D.DTYPES[name].block_bytes)
    want_arr = np.concatenate(want).reshape(*lead, nb * 32)
    np.testing.assert_array_equal(D.dequantize(name, raw_arr), want_arr)
    np.testing.assert_array_equal(D.to_host_float(name, raw_arr), want_arr)


# ---------------------------------------------------------------------------
# Known answers, worked by hand from ggml's reference quantizers. Each entry:
# (x[0:8], filler for x[8:16], x[16:24], filler for x[24:32]) -> (d, m, codes).
# Values were chosen so d is exact and every product below is exact in f32.

KNOWN = {
    # absmax element 4.0 (x[7] = -4.0 ties but comes later): d = 4/-8 = -0.5, id = -2;
    # q = min(15, trunc(-2x + 8.5)): 4 -> 0.5 -> 0; -3.75 -> 16 -> clamp 15; -3.5 -> 15.5 -> 15;
    # 0.25 -> 8.0 -> 8; -0.25 -> 9; 0.75 -> 7.0 -> 7; 1.1 -> 6.3 -> 6; -4 -> 16.5 -> 15;
    # filler 1.5 -> 5.5 -> 5. Second half: 2 -> 4.5 -> 4; -2 -> 12.5 -> 12; 3.9 -> 0.7 -> 0;
    # -1.25 -> 11; 0.5 -> 7.5 -> 7; -0.5 -> 9.5 -> 9; 3 -> 2.5 -> 2; -0.1 -> 8.7 -> 8; filler -1.5 -> 11.5 -> 11.
    "q4_0": (
        ([4.0, -3.75, -3.5, 0.25, -0.25, 0.75, 1.1, -4.0], 1.5, [2.0, -2.0, 3.9, -1.25, 0.5, -0.5, 3.0, -0.1], -1.5),
        (-0.5, 0.0, [0, 15, 15, 8, 9, 7, 6, 15] + [5] * 8 + [4, 12, 0, 11, 7, 9, 2, 8] + [11] * 8),
    ),
    # min -1, max 2.75: d = 3.75/15 = 0.25, id = 4, m = -1; q = min(15, trunc(4(x+1) + 0.5)):
    # -1 -> 0; 2.75 -> 15.5 -> 15; 0.5 -> 6.5 -> 6; -0.875 -> 1.0 -> 1; 0.1 -> 4.9 -> 4;
    # 2.6 -> 14.9 -> 14; 1.125 -> 9.0 -> 9; -0.5 -> 2.5 -> 2; filler 1 -> 8.5 -> 8.
    # 2.5 -> 14.5 -> 14; -0.75 -> 1.5 -> 1; 1.875 -> 12.0 -> 12; 0.3 -> 5.7 -> 5; -0.9 -> 0.9 -> 0;
    # 2.7 -> 15.3 -> 15; 1.5 -> 10.5 -> 10; -0.125 -> 4.0 -> 4; filler -0.25 -> 3.5 -> 3.
    "q4_1": (
        ([-1.0, 2.75, 0.5, -0.875, 0.1, 2.6, 1.125, -0.5], 1.0, [2.5, -0.75, 1.875, 0.3, -0.9, 2.7, 1.5, -0.125], -0.25),
        (0.25, -1.0, [0, 15, 6, 1, 4, 14, 9, 2] + [8] * 8 + [14, 1, 12, 5, 0, 15, 10, 4] + [3] * 8),
    ),
    # absmax element -8 (x[7] = 8 ties later): d = -8/-16 = 0.5, id = 2; q = min(31, trunc(2x + 16.5)):
    # -8 -> 0.5 -> 0; 7.75 -> 32 -> clamp 31; 7.5 -> 31.5 -> 31; 0.25 -> 17.0 -> 17; -0.25 -> 16;
    # 1 -> 18.5 -> 18; 3.3 -> 23.1 -> 23; 8 -> 32.5 -> 31; filler -3 -> 10.5 -> 10.
    # -7 -> 2.5 -> 2; 5 -> 26.5 -> 26; -0.75 -> 15.0 -> 15; 2.2 -> 20.9 -> 20; -5.5 -> 5.5 -> 5;
    # 0.6 -> 17.7 -> 17; -1 -> 14.5 -> 14; 6.25 -> 29.0 -> 29; filler 2 -> 20.5 -> 20.
    "q5_0": (
        ([-8.0, 7.75, 7.5, 0.25, -0.25, 1.0, 3.3, 8.0], -3.0, [-7.0, 5.0, -0.75, 2.2, -5.5, 0.6, -1.0, 6.25], 2.0),
        (0.5, 0.0, [0, 31, 31, 17, 16, 18, 23, 31] + [10] * 8 + [2, 26, 15, 20, 5, 17, 14, 29] + [20] * 8),
    ),
    # min -2, max 5.75: d = 7.75/31 = 0.25, id = 4, m = -2; q = trunc(4(x+2) + 0.5):
    # -2 -> 0; 5.75 -> 31.5 -> 31; 0.5 -> 10.5 -> 10; 1.875 -> 16.0 -> 16; -1.875 -> 1.0 -> 1;
    # 3.3 -> 21.7 -> 21; 5.6 -> 30.9 -> 30; -1 -> 4.5 -> 4; filler 1 -> 12.5 -> 12.
    # 4 -> 24.5 -> 24; -0.5 -> 6.5 -> 6; 2.125 -> 17.0 -> 17; 0.1 -> 8.9 -> 8; 5 -> 28.5 -> 28;
    # -1.2 -> 3.7 -> 3; 3 -> 20.5 -> 20; 2 -> 16.5 -> 16; filler -0.5 -> 6.5 -> 6.
    "q5_1": (
        ([-2.0, 5.75, 0.5, 1.875, -1.875, 3.3, 5.6, -1.0], 1.0, [4.0, -0.5, 2.125, 0.1, 5.0, -1.2, 3.0, 2.0], -0.5),
        (0.25, -2.0, [0, 31, 10, 16, 1, 21, 30, 4] + [12] * 8 + [24, 6, 17, 8, 28, 3, 20, 16] + [6] * 8),
    ),
    # absmax 7.9375: d = 7.9375/127 = 0.0625, id = 16; q = roundf(16x), halves away from zero:
    # -7.9375 -> -127; 0.03125 -> 0.5 -> 1; -0.03125 -> -1; 0.15625 -> 2.5 -> 3 (rint: 2);
    # 0.1 -> 1.6 -> 2; 7.9375 -> 127; -0.15625 -> -3; 1 -> 16; filler 0.5 -> 8.
    # -1 -> -16; 2.53125 -> 40.5 -> 41 (rint: 40); -2.53125 -> -41; 0.09375 -> 1.5 -> 2;
    # -0.09375 -> -2; 3 -> 48; -0.2 -> -3.2 -> -3; 0.3 -> 4.8 -> 5; filler -0.75 -> -12.
    "q8_0": (
        ([-7.9375, 0.03125, -0.03125, 0.15625, 0.1, 7.9375, -0.15625, 1.0], 0.5,
         [-1.0, 2.53125, -2.53125, 0.09375, -0.09375, 3.0, -0.2, 0.3], -0.75),
        (0.0625, 0.0, [-127, 1, -1, 3, 2, 127, -3, 16] + [8] * 8 + [-16, 41, -41, 2, -2, 48, -3, 5] + [-12] * 8),
    ),
}


@pytest.mark.parametrize("name", QUANT)
def test_known_answer(name):
    (a, fa, b, fb), (d, m, codes) = KNOWN[name]
    x = np.array(a + [fa] * 8 + b + [fb] * 8, dtype=np.float32)
    raw = D.quantize(name, x)
    assert raw.dtype == np.uint8
    assert raw.tobytes().hex() == pack_block(name, d, codes, m).hex()
    np.testing.assert_array_equal(D.dequantize(name, raw), decode_formula(name, d, codes, m))


def test_q4_0_rounds_each_float32_step():
    """x*id is rounded to float32 before + 8.5, as the C source reads.

    absmax element -3: d = 0.375, id = float32(1/0.375) = 2.6666667461...
    x = -2.8125: x*id = -7.50000022..., which rounds to -7.5 in float32, so
    -7.5 + 8.5 = 1.0 -> code 1. Fused (an FMA, or float64 then float32) the sum
    is 0.99999978 -> code 0. Filler 1.5: 1.5*id rounds to 4.0; 12.5 -> 12.
    """
    x = np.array([-3.0, -2.8125] + [1.5] * 30, dtype=np.float32)
    assert D.quantize("q4_0", x).tobytes() == pack_block("q4_0", 0.375, [0, 1] + [12] * 30)


# ggml's scans start from amax = max = +0.0 (q4_0, q5_0) or take the first of
# equal extremes (q4_1, q5_1), which fixes the sign of a zero d or m.
ZERO_BLOCKS = [
    ("q4_0", [0.0] * 32, "0080" + "88" * 16),  # d = +0.0 / -8 = -0.0; q = trunc(8.5) = 8
    ("q4_0", [-0.0] * 32, "0080" + "88" * 16),  # ggml's max stays +0.0
    ("q5_0", [0.0] * 32, "0080" + "ff" * 4 + "00" * 16),  # q = 16: low nibbles 0, qh all ones
    ("q4_1", [-0.0] + [0.0] * 31, "0000" + "0080" + "00" * 16),  # min = max = -0.0 (first); d = +0
    ("q5_1", [0.0] * 32, "00" * 24),
    ("q8_0", [-0.0] * 32, "00" * 34),  # amax = |x| = +0.0
]


@pytest.mark.parametrize("name, x, hexbytes", ZERO_BLOCKS)
def test_zero_blocks(name, x, hexbytes):
    assert D.quantize(name, np.array(x, dtype=np.float32)).tobytes().hex() == hexbytes


# ---------------------------------------------------------------------------
# Properties over random inputs


def random_rows(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Uniform values, each block scaled by its own power of ten, so blocks differ in range."""
    x = rng.uniform(-1, 1, shape)
    scale = 10.0 ** rng.uniform(-3, 3, (*shape[:-1], shape[-1] // 32, 1))
    return (x.reshape(*shape[:-1], -1, 32) * scale).reshape(shape).astype(np.float32)


@pytest.mark.parametrize("name", QUANT)
def test_round_trip_error_bound(rng, name):
    """|dequantize(quantize(x)) - x| stays within the format's bound, block by block.

    With the exact scale d (computed here in float64 from x) and the stored
    f16 scale d16, an element coded q decodes to (q - zero)*d16 + m16, so
        err <= |x - ((q - zero)*d + min)| + |q - zero|*|d - d16| + |min - m16|.
    Rounding to the nearest code makes the first term <= |d|/2, except in the
    _0 formats where x/d lies in (zero - 1/2, zero]: the element opposite the
    absmax one, clamped to code 2*zero - 1, errs by up to |d|. |q - zero| is at
    most zero (q4_0 8, q5_0 16), 127 (q8_0) or 2**bits - 1 (q4_1, q5_1). A
    slack of 2**-20 of the block's magnitude absorbs ggml's float32 rounding.
    """
    bits, zero, affine = FORMATS[name]
    x = random_rows(rng, (3, 5, 256))
    raw = D.quantize(name, x)
    y = D.dequantize(name, raw)
    xb = x.reshape(-1, 32).astype(np.float64)
    err = np.abs(y.reshape(-1, 32) - xb)
    blocks = raw.reshape(-1, D.DTYPES[name].block_bytes)
    d16 = np.array([block_d(b) for b in blocks])[:, None]
    amax = np.abs(xb).max(axis=1, keepdims=True)
    lo = xb.min(axis=1, keepdims=True)
    if affine:
        d = (xb.max(axis=1, keepdims=True) - lo) / (2**bits - 1)
        m16 = blocks[:, 2:4].copy().view("<f2").astype(np.float64)
        bound = np.abs(d) / 2 + (2**bits - 1) * np.abs(d - d16) + np.abs(lo - m16)
    elif bits == 8:
        d = amax / 127
        bound = d / 2 + 127 * np.abs(d - d16)
    else:
        signed_max = np.take_along_axis(xb, np.argmax(np.abs(xb), axis=1)[:, None], axis=1)
        d = signed_max / -zero
        clamped = xb / d > zero - 0.5 - 1e-4
        bound = np.where(clamped, 1.0, 0.5) * np.abs(d) + zero * np.abs(d - d16)
    slack = 2.0**-20 * amax
    worst = np.max(err - bound - slack)
    assert worst <= 0, f"{name}: error exceeds the bound by {worst}"


def valid_block(rng: np.random.Generator, name: str) -> bytes:
    """A block quantize itself could write: the extreme codes present, d and m as it derives them.

    With d16 in [2**-6, 1] and |m16| in [1/4, 4], every decoded value is exact in
    float32, so re-quantizing recovers d, m and each code exactly.
    """
    bits, _, affine = FORMATS[name]
    codes = random_codes(rng, name)
    at = rng.choice(32, 2, replace=False)
    d = f16(2.0 ** rng.uniform(-6, 0))
    m = 0.0
    if bits == 8:  # d = absmax / 127: some |q| == 127; -128 never written
        codes = [max(q, -127) for q in codes]
        codes[at[0]] = int(rng.choice([-127, 127]))
    elif affine:  # d = (max - min) / (2**bits - 1): codes 0 and 2**bits - 1 present
        m = f16(rng.choice([-1, 1]) * 2.0 ** rng.uniform(-2, 2))
        codes[at[0]], codes[at[1]] = 0, 2**bits - 1
    else:  # d = absmax element / -zero: code 0 present, d of either sign
        d *= rng.choice([-1, 1])
        codes[at[0]] = 0
    return pack_block(name, d, codes, m)


def scalar_reference(name: str, block: np.ndarray) -> bytes:
    """quantize_row_*_ref for one block, one float32 scalar operation at a time, as the C reads."""
    bits, zero, affine = FORMATS[name]
    f = np.float32
    lo = f(0)
    if affine:  # min/max scans from +-FLT_MAX with strict comparisons
        lo, hi = f(np.finfo(f).max), f(-np.finfo(f).max)
        for v in block:
            lo, hi = (v if v < lo else lo), (v if v > hi else hi)
        d = (hi - lo) / f(2**bits - 1)
    elif bits == 8:
        amax = f(0)
        for v in block:
            amax = amax if amax > abs(v) else abs(v)
        d = amax / f(127)
    else:  # the first element of largest |x|, sign kept
        amax = top = f(0)
        for v in block:
            if amax < abs(v):
                amax, top = abs(v), v
        d = top / f(-zero)
    inv = f(1) / d if d else f(0)
    codes = []
    for v in block:
        t = (v - lo if affine else v) * inv
        if bits == 8:  # roundf; adding 0.5 is exact in float64
            codes.append(int(np.copysign(np.floor(abs(float(t)) + 0.5), t)))
        else:
            codes.append(min(2**bits - 1, int(t + f(zero + 0.5))))
    return pack_block(name, float(d), codes, float(lo))


def tie_rows(rng: np.random.Generator, name: str, n: int) -> np.ndarray:
    """Blocks of half-steps of a scale c = odd/16, so 1/c is inexact and x*id lands next to
    code boundaries, where float32 rounding decides: any change in the order or precision
    of ggml's float32 steps shows. d comes out as c (times 8 or 16 for q4_0, q5_0)."""
    bits, zero, affine = FORMATS[name]
    top = 127 if bits == 8 else 2**bits - 1 if affine else zero  # extreme code distance
    c = (2 * rng.integers(1, 32, (n, 1)) + 1) / 16
    if affine:  # min at offset*c, max at (offset + top)*c
        h = rng.integers(0, 2 * top + 1, (n, 32)) / 2
        h[:, 0], h[:, 1] = 0, top
        h += rng.integers(-top, 1, (n, 1))
    else:
        h = rng.integers(-2 * top, 2 * top + 1, (n, 32)) / 2
        h[:, 0] = rng.choice([-top, top], n)
    return (c * h).astype(np.float32)


@pytest.mark.parametrize("name", QUANT)
def test_quantize_matches_scalar_reference(rng, name):
    """The vectorized quantizer against a scalar transcription of ggml's loop."""
    x = np.concatenate([random_rows(rng, (32, 32)), tie_rows(rng, name, 64)])
    got = D.quantize(name, x)
    for row, block in zip(got, x):
        assert row.tobytes() == scalar_reference(name, block), block


@pytest.mark.parametrize("name", QUANT)
def test_quantize_reproduces_valid_blocks(rng, name):
    raw = np.frombuffer(b"".join(valid_block(rng, name) for _ in range(6 * 8)), np.uint8).reshape(6, -1)
    np.testing.assert_array_equal(D.quantize(name, D.dequantize(name, raw)), raw)


@pytest.mark.parametrize("name", QUANT)
def test_shapes_and_views(rng, name):
    bb = D.DTYPES[name].block_bytes
    x = random_rows(rng, (2, 3, 4, 128))
    raw = D.quantize(name, x)
    assert raw.shape == (2, 3, 4, 4 * bb) and raw.dtype == np.uint8
    assert D.dequantize(name, raw).shape == (2, 3, 4, 128)
    # rows are independent: a batch equals its rows one at a time
    np.testing.assert_array_equal(raw[1, 2, 3], D.quantize(name, x[1, 2, 3]))
    assert D.quantize(name, x[0, 0, 0, :32]).shape == (bb,)
    # strided input, and other float dtypes (rounded to f32 first)
    view = x.transpose(1, 0, 2, 3)[..., ::2, :]
    np.testing.assert_array_equal(D.quantize(name, view), D.quantize(name, np.ascontiguousarray(view)))
    np.testing.assert_array_equal(D.quantize(name, x.astype(np.float64)), raw)
    xh = x.astype(np.float16)
    np.testing.assert_array_equal(D.quantize(name, xh), D.quantize(name, xh.astype(np.float32)))
    # strided raw rows, and n: decode the first n values of longer rows
    np.testing.assert_array_equal(
        D.dequantize(name, raw.transpose(1, 0, 2, 3)), D.dequantize(name, raw).transpose(1, 0, 2, 3)
    )
    first = D.dequantize(name, raw[..., : 2 * bb + 5], n=64)
    np.testing.assert_array_equal(first, D.dequantize(name, raw)[..., :64])
    assert D.quantize(name, x[..., :0]).shape == (2, 3, 4, 0)


@pytest.mark.parametrize("name", QUANT)
def test_quantize_errors(rng, name):
    x = rng.uniform(-1, 1, (3, 33)).astype(np.float32)
    with pytest.raises(ValueError, match=rf"{name}.*\(3, 33\)"):
        D.quantize(name, x)
    with pytest.raises(ValueError, match=name):
        D.quantize(name, np.float32(1.5))
    raw = D.quantize(name, x[:, :32])
    with pytest.raises(ValueError, match=rf"{name}.*\(3, {raw.shape[1] - 1}\)"):
        D.dequantize(name, raw[:, :-1])
    with pytest.raises(ValueError, match=name):  # n not whole blocks
        D.dequantize(name, raw, n=16)
    with pytest.raises(ValueError, match=rf"{name}.*64 values"):  # n beyond the row
        D.dequantize(name, raw, n=64)
    with pytest.raises(TypeError, match=rf"{name}.*int8"):
        D.dequantize(name, raw.view(np.int8))


def test_plain_dtypes_are_not_quantized(rng):
    x = rng.uniform(-1, 1, (2, 32))
    with pytest.raises(ValueError, match="f16 is not a block-quantized dtype"):
        D.quantize("f16", x)
    with pytest.raises(ValueError, match="i32 is not a block-quantized dtype"):
        D.dequantize(D.I32, rng.integers(1, 256, (2, 4)).astype(np.uint8))


# ---------------------------------------------------------------------------
# Plain types: f16, bf16, ints


def test_f16_round_trip(rng):
    x = (rng.standard_normal(1000) * 10.0 ** rng.uniform(-6, 4, 1000)).astype(np.float32)
    h = D.from_float(D.F16, x)
    assert h.dtype == np.float16
    np.testing.assert_array_equal(h, x.astype(np.float16))
    back = D.to_host_float("f16", h)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(D.from_float(D.F16, back).view(np.uint16), h.view(np.uint16))
    # ties go to even; 65520 is halfway to 65536, so it overflows to inf
    ties = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65519.0, 65520.0, -65520.0], dtype=np.float32)
    want = np.array([1.0, 1 + 2**-9, 65504.0, np.inf, -np.inf], dtype=np.float16)
    np.testing.assert_array_equal(D.from_float("f16", ties), want)


def test_bf16_round_trip(rng):
    # every finite float32 bit pattern class: normals, subnormals, both signs
    u = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    x = u.view(np.float32)
    finite = np.isfinite(x)
    b = D.from_float(D.BF16, x)
    assert b.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(b[finite].view(np.uint16), x[finite].astype(ml_dtypes.bfloat16).view(np.uint16))
    # NaN stays NaN, quiet, sign kept (ggml_compute_fp32_to_bf16)
    nan_bits = b[np.isnan(x)].view(np.uint16)
    assert np.all((nan_bits & 0x7FC0) == 0x7FC0)
    np.testing.assert_array_equal(nan_bits >> 15, (u[np.isnan(x)] >> 31).astype(np.uint16))
    back = D.to_host_float(D.BF16, b)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(D.from_float(D.BF16, back).view(np.uint16), b.view(np.uint16))
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4e38], dtype=np.float32)
    want = np.array([1.0, 1 + 2**-6, -1.0, np.inf], dtype=np.float32)
    np.testing.assert_array_equal(D.to_host_float("bf16", D.from_float("bf16", ties)), want)


def test_from_float_ints_truncate():
    x = np.array([-1.7, 1.7, 2.5, -2.5, 3.99, -0.5], dtype=np.float32)
    for dt in (D.I8, D.I16, D.I32, D.I64):
        got = D.from_float(dt, x)
        assert got.dtype == dt.numpy
        np.testing.assert_array_equal(got, [-1, 1, 2, -2, 3, 0])
    big = np.array([2**40 + 1, -(2**40) - 3], dtype=np.int64)  # integers are cast directly, not via f32
    np.testing.assert_array_equal(D.from_float("i64", big), big)


def test_from_float_floats_round_via_f32(rng):
    x = rng.uniform(-1, 1, 100)  # float64
    np.testing.assert_array_equal(D.from_float("f32", x), x.astype(np.float32))
    np.testing.assert_array_equal(D.from_float("f16", x), x.astype(np.float32).astype(np.float16))
    q = D.from_float("q8_0", x.reshape(2, 50)[:, :32])
    np.testing.assert_array_equal(q, D.quantize("q8_0", x.reshape(2, 50)[:, :32].astype(np.float32)))
    for name in ("f16", "bf16", "i32"):  # broadcast views in, fresh C-contiguous storage out
        got = D.from_float(name, np.broadcast_to(x[:8], (3, 8)))
        assert got.flags.c_contiguous
        np.testing.assert_array_equal(got, D.from_float(name, np.tile(x[:8], (3, 1))))


def test_to_host_float(rng):
    ints = rng.integers(-1000, 1000, (3, 4)).astype(np.int16)
    got = D.to_host_float("i16", ints)
    assert got.dtype == np.int16 and got is not ints
    np.testing.assert_array_equal(got, ints)
    x = rng.uniform(-1, 1, (3, 4)).astype(np.float32)
    got = D.to_host_float(D.F32, x)
    assert got.dtype == np.float32 and got is not x
    np.testing.assert_array_equal(got, x)
    with pytest.raises(TypeError, match="f16 is stored as float16, got float32"):
        D.to_host_float("f16", x)
    with pytest.raises(TypeError, match="q4_0"):
        D.to_host_float("q4_0", x)
