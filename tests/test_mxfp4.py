"""mxfp4 both ways: the decoder against gguf-py bit for bit, the encoder against gguf-py's quantize and
against ggml's own bytes (quantize_row_mxfp4_ref from libggml-base, and llama-quantize's MXFP4_MOE file,
in tests/fixtures/iquants/ggml.npz), and the round-trip error bound e2m1 under an e8m0 scale implies.

A fresh seed each run, printed on failure; OPDISPATCH_TEST_SEED replays one.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from opdispatch import dtypes as D
from opdispatch.quants import mxfp4

FIXTURE = Path(__file__).parent / "fixtures" / "iquants" / "ggml.npz"
MX = gguf.GGMLQuantizationType.MXFP4


def test_table_matches_gguf():
    dt = D.DTYPES["mxfp4"]
    assert D.MXFP4 is dt and dt.is_quant and (dt.block_size, dt.block_bytes) == gguf.GGML_QUANT_SIZES[MX] == (32, 17)


def test_e8m0_half_is_ggml_bits():
    """2**(e - 128) for every byte, from its bits: 0 and 1 are the subnormals 2**-128, 2**-127; 255 is 2**127."""
    e = np.arange(256, dtype=np.uint8)
    half = mxfp4.e8m0_half(e)
    np.testing.assert_array_equal(half.view(np.uint32), gguf.quants.MXFP4.e8m0_to_fp32_half(e).view(np.uint32))
    np.testing.assert_array_equal(half.astype(np.float64), np.ldexp(1.0, e.astype(np.int64) - 128))


def test_dequantize_bit_exact_with_gguf(rng):
    raw = rng.integers(0, 256, (600, 17), dtype=np.uint8)
    raw[:256, 0] = np.arange(256)  # every exponent (255 with code 7 overflows to inf, as in ggml)
    ours = D.dequantize("mxfp4", raw.reshape(-1))
    with np.errstate(all="ignore"):
        theirs = np.asarray(gguf.quants.dequantize(raw.reshape(-1), MX), np.float32)
    assert ours.shape == (600 * 32,) and not np.isnan(ours).any()
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    rows = raw.reshape(3, 200 * 17)
    np.testing.assert_array_equal(D.dequantize("mxfp4", rows, n=64), ours.reshape(3, -1)[:, :64])


def test_quantize_equals_gguf(rng):
    """gguf's vectorized quantize_row_mxfp4_ref, on rows of many scales (both log2's agree away from 2**-125)."""
    x = (rng.standard_normal((64, 512)) * 10.0 ** rng.integers(-30, 30, (64, 1))).astype(np.float32)
    x[0, :32] = 0
    x[1] = rng.integers(-12, 13, 512) / 2  # e2m1's own values and the midpoints between them: ties
    ours = D.quantize("mxfp4", x)
    theirs = gguf.quants.quantize(x, MX)
    assert ours.shape == theirs.shape == (64, 16 * 17)
    assert int((ours != theirs).sum()) == 0


@pytest.fixture(scope="module")
def ggml() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as z:
        return dict(z)


@pytest.mark.parametrize("rows, key", [("x_ref", "mxfp4"), ("x_file", "mxfp4_file")])
def test_quantize_equals_ggml(ggml, rows, key):
    """quantize_row_mxfp4_ref's bytes (x_ref holds exponents that wrap below 2**-125 and scales up to 1e30,
    x_file powers of two and values just below them), and llama-quantize --pure MXFP4_MOE's (which writes
    every 2-D weight of a dense model as mxfp4)."""
    x, expected = ggml[rows], ggml[key]
    with np.errstate(all="ignore"):
        ours = D.quantize("mxfp4", x)
    assert ours.shape == expected.shape
    assert int((ours != expected).sum()) == 0
    if rows == "x_ref":  # the wrapped exponents are really in there: floor(log2) - 2 + 127 < 0, cast to a byte
        e = expected.reshape(x.shape[0], -1, 17)[..., 0]
        tiny = (np.abs(x.reshape(*e.shape, 32)).max(-1) < 2.0**-125) & (np.abs(x.reshape(*e.shape, 32)).max(-1) > 0)
        assert tiny.any() and (e[tiny] > 128).all()


@pytest.mark.parametrize("scale", [1e-20, 1e-3, 1.0, 1e4, 1e25])
def test_round_trip_error(scale, rng):
    """With E = e - 125 (the octave of the block's |x| max, as ggml rounds log2): 6 * 2**(E-2) is the largest
    magnitude, levels lie 2**(E-1) apart at most, so |error| <= 2**(E-2) for |x| <= 1.5 * 2**E and < 2**(E-1)
    above (clipped)."""
    x = (rng.standard_normal((32, 256)) * scale).astype(np.float32)
    raw = D.quantize("mxfp4", x)
    y = D.dequantize("mxfp4", raw)
    e = raw.reshape(32, -1, 17)[..., 0].astype(np.int64)
    step = np.ldexp(1.0, e - 125)[..., None]  # 2**E per block
    xb, err = x.reshape(32, -1, 32).astype(np.float64), np.abs(y - x).reshape(32, -1, 32).astype(np.float64)
    inside = np.abs(xb) <= 1.5 * step
    assert (err[inside] <= step.repeat(32, -1)[inside] / 4).all()
    assert (err[~inside] < step.repeat(32, -1)[~inside] / 2).all()
    assert (np.abs(xb).max(-1) < 2 * step[..., 0]).all()  # E is the octave of |x| max
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    assert (((y64 - x64) ** 2).sum(-1) / (x64**2).sum(-1)).max() < 0.05
