"""The K-quants (q2_K .. q6_K, and q8_K): dequantize against gguf-py's, quantize against ggml's bytes.

gguf.quants is an independent vectorized transcription of ggml's
dequantize_row_q*_K; random bytes make every code, scale and min occur, and
the f16 fields get finite random values so that NaN != NaN cannot hide a
mismatch (inf and NaN scales are covered separately, by their bits).

gguf-py has no K-quant quantizer: the encoders are checked against bytes
written by llama.cpp's llama-quantize --pure (ggml's quantize_row_q*_K_ref)
and, for q8_K, by ggml's quantize_row_q8_K_ref itself, on rows of many kinds
(tests/fixtures/kquants, made by scripts/make_kquant_fixtures.py); then by
round trips with per-type error bounds, and on edge blocks by what the C does.

Random inputs come from a fresh seed each run, printed on failure; set
OPDISPATCH_TEST_SEED to replay one.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import opdispatch as od
from opdispatch import dtypes as D
from opdispatch import ops
from opdispatch.plugins.cuda_misc import support

# name: byte offsets of the block's f16 fields (d, and dmin where there is one), from block_q*_K
HALVES = {"q2_K": (80, 82), "q3_K": (108,), "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,)}


def qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name.upper()]


def random_blocks(rng: np.random.Generator, name: str, nb: int) -> np.ndarray:
    """nb random blocks (nb, block_bytes) with finite f16 scales, subnormals, zeros and negatives among them."""
    raw = rng.integers(0, 256, (nb, D.dtype(name).block_bytes), dtype=np.uint8)
    for at in HALVES[name]:
        h = rng.uniform(-2, 2, nb) * 10.0 ** rng.integers(-7, 4, nb)
        h[: min(nb, 2)] = 0.0
        raw[:, at : at + 2] = h.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return raw


def ref(name: str, raw: np.ndarray) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, qtype(name)), dtype=np.float32)


@pytest.mark.parametrize("name", list(HALVES))
def test_table_matches_gguf(name):
    dt = D.DTYPES[name]
    assert getattr(D, name.upper()) is dt and dt.is_quant and dt.numpy == np.uint8
    assert (dt.block_size, dt.block_bytes) == gguf.GGML_QUANT_SIZES[qtype(name)]


@pytest.mark.parametrize("name", list(HALVES))
def test_dequantize_bit_exact_with_gguf(name, seed):
    rng = np.random.default_rng(seed)
    raw = random_blocks(rng, name, 300)
    ours = D.dequantize(name, raw.reshape(-1))
    assert ours.dtype == np.float32 and ours.shape == (300 * 256,)
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours.view(np.uint32), ref(name, raw.reshape(-1)).view(np.uint32))


@pytest.mark.parametrize("name", list(HALVES))
def test_dequantize_rows_and_n(name, seed):
    """Leading axes are kept; n decodes the first n values of each row, as ggml's k."""
    rng = np.random.default_rng(seed)
    bb = D.dtype(name).block_bytes
    rows = random_blocks(rng, name, 2 * 3 * 3).reshape(2, 3, 3 * bb)
    full = D.dequantize(name, rows)
    assert full.shape == (2, 3, 768)
    np.testing.assert_array_equal(full.reshape(-1).view(np.uint32), ref(name, rows.reshape(-1)).view(np.uint32))
    np.testing.assert_array_equal(D.dequantize(name, rows, n=512), full[..., :512])
    assert D.to_host_float(name, rows).tobytes() == full.tobytes()
    with pytest.raises(ValueError, match="whole number of 256-element blocks"):
        D.dequantize(name, rows, n=300)
    with pytest.raises(ValueError, match=f"whole {bb}-byte blocks"):
        D.dequantize(name, rows[..., :-1])


@pytest.mark.parametrize("name", list(HALVES))
def test_non_finite_scales_match_gguf_bits(name, seed):
    """inf and NaN in d give what the float32 expressions give (as in ggml): compared by bits, NaN where both are."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(rng, name, 4)
    at = HALVES[name][0]
    raw[:2, at : at + 2] = np.array([np.inf, -np.inf], np.float16).view(np.uint8).reshape(2, 2)
    raw[2:, at : at + 2] = np.array([np.nan, np.nan], np.float16).view(np.uint8).reshape(2, 2)
    ours = D.dequantize(name, raw.reshape(-1))
    with np.errstate(all="ignore"):
        theirs = ref(name, raw.reshape(-1))
    assert not np.isfinite(ours[:256]).all()
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    ok = ~np.isnan(ours)
    np.testing.assert_array_equal(ours[ok], theirs[ok])


@pytest.mark.parametrize("name", list(HALVES))
def test_cuda_copies_take_k_quants_and_concat_declines(name):
    """Ops that take any dtype reach the CUDA plugin: its copies move K-quant blocks (same dtype, any
    layout), its concat moves the 32-value formats only."""
    a, b = od.input("a", (2, 256), name), od.input("b", (3, 256), name)
    assert support.concat_ok(None, ops.concat(a, b, 0)) == "concat moves the 32-value block formats only"
    assert support.copy_ok(None, ops.cont(a)) is True
    assert support.copy_ok(None, ops.cont(od.input("c", (3, 2, 256), name).permute(1, 0, 2))) is True
    q = od.input("q", (2, 32), "q4_0")
    assert support.concat_ok(None, ops.concat(q, q, 0)) is True and support.copy_ok(None, ops.cont(q)) is True


def test_cuda_copies_decline_q8_k():
    """q8_K (an activation format, no device traits) is moved by no CUDA kernel."""
    a = od.input("a", (2, 256), "q8_K")
    assert support.copy_ok(None, ops.cont(a)) == "no kernel moves this block format"


FIXTURES = Path(__file__).parent / "fixtures" / "kquants"
ENCODED = [*HALVES, "q8_K"]
#: NMSE (sum of squared errors / sum of squares) of dequantize(quantize(x)) on standard normal values,
#: measured about 0.088, 0.023, 0.0051, 0.0013, 0.00031, 4.9e-5; bounds about 15% above
NMSE = {"q2_K": 0.10, "q3_K": 0.027, "q4_K": 0.006, "q5_K": 0.0016, "q6_K": 0.00038, "q8_K": 6e-5}
#: the bounds below a spread of 0.1, where q6_K's super-block scale d (an f16, about the spread / 1000) is
#: subnormal, as in ggml: at a spread of 1e-3 its NMSE is 4.1e-4 to 4.3e-4 (30 seeds)
NMSE_TINY = {**NMSE, "q6_K": 0.0005}


def nmse(y: np.ndarray, x: np.ndarray) -> float:
    return float(((y.astype(np.float64) - x) ** 2).sum() / (x.astype(np.float64) ** 2).sum())


def test_q8_k_in_table():
    dt = D.DTYPES["q8_K"]
    assert dt.is_quant and (dt.block_size, dt.block_bytes) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]


@pytest.mark.parametrize("name", ENCODED)
def test_quantize_matches_ggml_bytes(name):
    """Every fixture row (normal, heavy-tailed, constant, zero, tiny, huge, outliers, ties...) byte for byte."""
    f = np.load(FIXTURES / f"{name}.npz")
    x, raw, kind = f["x"], f["raw"], f["kind"]
    assert x.dtype == np.float32 and raw.shape == (len(x), D.dtype(name).block_bytes) and len(set(kind)) >= 20
    ours = D.quantize(name, x)
    bad = np.flatnonzero((ours != raw).any(axis=1))
    assert not len(bad), f"{name}: rows {bad} ({', '.join(kind[bad])}) differ from ggml's bytes"
    # the same rows as one long row (several super-blocks): blocks are independent
    assert D.quantize(name, x.reshape(-1)).tobytes() == raw.tobytes()


@pytest.mark.parametrize("name", ENCODED)
def test_round_trip_error_bound(name, rng):
    e = rng.uniform(-3, 3)
    x = rng.standard_normal((64, 1024)).astype(np.float32) * np.float32(10.0 ** e)
    raw = D.quantize(name, x)
    assert raw.dtype == np.uint8 and raw.shape == (64, 4 * D.dtype(name).block_bytes)
    assert nmse(D.dequantize(name, raw), x) < (NMSE if e >= -1 else NMSE_TINY)[name]


@pytest.mark.parametrize("name", ENCODED)
def test_leading_axes_and_bad_shapes(name, rng):
    # 96 super-blocks: with 12 (a (2, 3, 512) input) q8_K's NMSE passed its bound in about 1 seed of 300 (CI, session
    # 30); at 96 every format's bound is 10 or more standard deviations of its NMSE above the mean
    x = rng.standard_normal((2, 24, 512)).astype(np.float32)
    raw = D.quantize(name, x)
    assert raw.shape == (2, 24, 2 * D.dtype(name).block_bytes)
    assert raw.tobytes() == D.quantize(name, x.reshape(-1, 256)).tobytes()
    y = D.dequantize(name, raw)
    assert y.shape == x.shape and nmse(y, x) < NMSE[name]
    assert D.from_float(name, x.astype(np.float64)).tobytes() == raw.tobytes()
    for bad in (np.zeros(300, np.float32), np.zeros((2, 128), np.float32), np.float32(1)):
        with pytest.raises(ValueError, match=f"quantize to {name}: the last axis must be whole blocks of 256"):
            D.quantize(name, bad)


@pytest.mark.parametrize("name", ENCODED)
def test_many_blocks_in_chunks(name, rng):
    """More super-blocks than one encoding pass takes give the bytes of each block alone."""
    x = rng.standard_normal((4099, 256)).astype(np.float32)
    raw = D.quantize(name, x)
    picks = rng.choice(len(x), 5, replace=False)
    for i in (0, 4095, 4096, 4098, *picks):
        assert raw[i].tobytes() == D.quantize(name, x[i]).tobytes()


@pytest.mark.parametrize("name", ENCODED)
def test_edge_blocks(name, rng):
    """Zeros, constants, tiny and huge magnitudes, one outlier: what ggml's code gives them."""
    # every search gives codes 0 and scale (and min) 0 on zeros, so every field is 0 (q8_K's bsums too)
    assert not D.quantize(name, np.zeros(256, np.float32)).any()
    assert not D.quantize(name, np.full(256, -0.0, np.float32)).any()
    for c in (rng.uniform(0.1, 10), -rng.uniform(0.1, 10), 3e4):
        y = D.dequantize(name, D.quantize(name, np.full(256, c, np.float32)))
        assert np.abs(y - np.float32(c)).max() <= 1e-3 * abs(c), (c, y[:4])
    tiny = rng.standard_normal(256).astype(np.float32) * np.float32(1e-20)
    y = D.dequantize(name, D.quantize(name, tiny))
    if name == "q8_K":  # a float32 d: tiny values keep their 8 bits
        assert np.abs(y - tiny).max() <= np.abs(tiny).max() / 254
    else:  # below the searches' 1e-15 (q3_K, q6_K) or f16's range (the others): all zero
        assert not y.any()
    x = rng.standard_normal((8, 256)).astype(np.float32)
    at = rng.integers(0, 256, 8)
    x[np.arange(8), at] = np.float32(500) * rng.choice([-1, 1], 8)
    y = D.dequantize(name, D.quantize(name, x))
    np.testing.assert_allclose(y[np.arange(8), at], x[np.arange(8), at], rtol=1e-3)


def test_q8_k_is_its_definition(rng):
    """d = max/-127 (max: the first value of largest |x|), qs = round-half-even(x*(-127/max)), bsums: sums of 16."""
    x = rng.standard_normal((50, 256)).astype(np.float32) * np.float32(10.0 ** rng.uniform(-4, 4))
    x[0, 7] = -np.abs(x[0]).max() * 2  # a negative max: d > 0
    x[1, [3, 9]] = np.abs(x[1]).max() * 2 * np.array([1, -1], np.float32)  # a tie: the first wins, d < 0
    raw = D.quantize("q8_K", x)
    d = raw[:, :4].copy().view("<f4")[:, 0]
    qs = raw[:, 4:260].view(np.int8)
    bsums = raw[:, 260:].copy().view("<i2")
    mx = x[np.arange(50), np.abs(x).argmax(axis=1)]
    iscale = np.float32(-127) / mx
    np.testing.assert_array_equal(d, np.float32(1) / iscale)
    assert d[0] > 0 and d[1] < 0
    np.testing.assert_array_equal(qs, np.minimum(127, np.rint(iscale[:, None] * x)).astype(np.int8))
    np.testing.assert_array_equal(bsums, qs.reshape(50, 16, 16).sum(axis=-1))
    assert np.abs(qs).max() == 127
    np.testing.assert_array_equal(D.dequantize("q8_K", raw), d[:, None] * qs.astype(np.float32))
