"""The K-quants' dequantize (q2_K .. q6_K) against gguf-py's, bit for bit.

gguf.quants is an independent vectorized transcription of ggml's
dequantize_row_q*_K; random bytes make every code, scale and min occur, and
the f16 fields get finite random values so that NaN != NaN cannot hide a
mismatch (inf and NaN scales are covered separately, by their bits).

Random inputs come from a fresh seed each run, printed on failure; set
OPDISPATCH_TEST_SEED to replay one.
"""

from __future__ import annotations

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
def test_quantize_is_not_offered(name):
    with pytest.raises(NotImplementedError, match=f"quantize to {name}"):
        D.quantize(name, np.zeros(256, np.float32))
    with pytest.raises(NotImplementedError):
        D.from_float(name, np.zeros(256, np.float32))


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
