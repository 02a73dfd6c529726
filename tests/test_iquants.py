"""The I-quants: every decoder against gguf-py's dequantize bit for bit, iq4_nl / iq4_xs's encoders against
ggml's own bytes (tests/fixtures/iquants/ggml.npz, from scripts/make_iquant_fixtures.py: llama-quantize's
files and libggml-base's quantize_row_*_ref), and their round-trip error.

Random blocks are random bytes (every index, sign and scale bit occurs) with finite f16 scales, so that
NaN != NaN cannot hide a mismatch; inf and NaN scales are compared by bits separately. A fresh seed each
run, printed on failure; OPDISPATCH_TEST_SEED replays one.
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
from opdispatch.quants import FORMATS, iquants

FIXTURE = Path(__file__).parent / "fixtures" / "iquants" / "ggml.npz"

# name: byte offset of the block's f16 d (None: iq1_m, whose d is the top nibbles of its 4 scale words)
D_AT = {
    "iq2_xxs": 0, "iq2_xs": 0, "iq3_xxs": 0, "iq1_s": 0, "iq3_s": 0, "iq2_s": 0, "iq1_m": None,
    "iq4_nl": 0, "iq4_xs": 0,
}
GRID_FORMATS = [n for n in D_AT if n not in ("iq4_nl", "iq4_xs")]
IQ1M_SCALES = 48  # block_iq1_m: qs[32], qh[16], scales[8]


def qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name.upper()]


def set_d(raw: np.ndarray, name: str, d: np.ndarray) -> None:
    """Write f16 values d (nb,) as each block's d, where the format keeps it."""
    bits = d.astype(np.float16).view(np.uint16)
    if D_AT[name] is not None:
        raw[:, D_AT[name] : D_AT[name] + 2] = bits.view(np.uint8).reshape(-1, 2)
        return
    words = raw[:, IQ1M_SCALES : IQ1M_SCALES + 8].copy().view("<u2")  # nibble k of d tops word k
    words = (words & 0x0FFF) | (((bits[:, None] >> (4 * np.arange(4))) & 0xF) << 12).astype(np.uint16)
    raw[:, IQ1M_SCALES : IQ1M_SCALES + 8] = words.astype("<u2").view(np.uint8)


def random_blocks(rng: np.random.Generator, name: str, nb: int) -> np.ndarray:
    """nb random blocks with finite f16 d: zeros, subnormals and negatives among them."""
    raw = rng.integers(0, 256, (nb, D.dtype(name).block_bytes), dtype=np.uint8)
    d = rng.uniform(-2, 2, nb) * 10.0 ** rng.integers(-7, 4, nb)
    d[: min(nb, 2)] = 0.0
    set_d(raw, name, d)
    return raw


def ref(name: str, raw: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(gguf.quants.dequantize(raw, qtype(name)), dtype=np.float32)


@pytest.mark.parametrize("name", list(D_AT))
def test_table_matches_gguf(name):
    dt = D.DTYPES[name]
    assert getattr(D, name.upper()) is dt and dt.is_quant and dt.numpy == np.uint8 and FORMATS[name].name == name
    assert (dt.block_size, dt.block_bytes) == gguf.GGML_QUANT_SIZES[qtype(name)]


@pytest.mark.parametrize("name", list(D_AT))
def test_dequantize_bit_exact_with_gguf(name, seed):
    rng = np.random.default_rng(seed)
    raw = random_blocks(rng, name, 400)
    ours = D.dequantize(name, raw.reshape(-1))
    assert ours.dtype == np.float32 and ours.shape == (400 * D.dtype(name).block_size,)
    assert np.isfinite(ours).all() and (ours != 0).any()
    np.testing.assert_array_equal(ours.view(np.uint32), ref(name, raw.reshape(-1)).view(np.uint32))


@pytest.mark.parametrize("name", list(D_AT))
def test_dequantize_rows_and_n(name, seed):
    """Leading axes are kept; n decodes the first n values of each row, as ggml's k."""
    rng = np.random.default_rng(seed)
    dt = D.dtype(name)
    rows = random_blocks(rng, name, 2 * 3 * 3).reshape(2, 3, 3 * dt.block_bytes)
    full = D.dequantize(name, rows)
    assert full.shape == (2, 3, 3 * dt.block_size)
    np.testing.assert_array_equal(full.reshape(-1).view(np.uint32), ref(name, rows.reshape(-1)).view(np.uint32))
    np.testing.assert_array_equal(D.dequantize(name, rows, n=2 * dt.block_size), full[..., : 2 * dt.block_size])
    with pytest.raises(ValueError, match=f"whole {dt.block_bytes}-byte blocks"):
        D.dequantize(name, rows[..., :-1])


@pytest.mark.parametrize("name", list(D_AT))
def test_non_finite_scales_match_gguf_bits(name, seed):
    """inf and NaN in d give what the float32 expressions give (as in ggml): compared by bits, NaN where both are."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(rng, name, 4)
    set_d(raw, name, np.array([np.inf, -np.inf, np.nan, np.nan]))
    ours = D.dequantize(name, raw.reshape(-1))
    theirs = ref(name, raw.reshape(-1))
    assert not np.isfinite(ours).any()
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    ok = ~np.isnan(ours)
    np.testing.assert_array_equal(ours[ok].view(np.uint32), theirs[ok].view(np.uint32))


@pytest.mark.parametrize("name", GRID_FORMATS)
def test_grid_formats_only_dequantize(name):
    assert FORMATS[name].encode is None
    with pytest.raises(NotImplementedError, match=f"quantize to {name}"):
        D.quantize(name, np.zeros(256, np.float32))


# -- encoders against ggml's bytes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ggml() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as z:
        return dict(z)


def test_iq4_xs_equals_llama_quantize(ggml):
    """llama-quantize --pure IQ4_XS runs quantize_iq4_xs without an imatrix: quantize_row_iq4_xs_ref."""
    x, expected = ggml["x_file"], ggml["iq4_xs"]
    assert expected.shape == (x.shape[0], x.shape[1] // 256 * 136)
    ours = D.quantize("iq4_xs", x)
    assert int((ours != expected).sum()) == 0
    # the fixture reaches the corner cases: an all-zero block (d = -0.0) and zero sub-blocks
    assert (expected[:, :2].view("<u2") == 0x8000).any()


def test_iq4_nl_file_encoder_equals_llama_quantize(ggml):
    """llama-quantize writes IQ4_NL with quantize_iq4_nl (ntry = 7), not the _ref row function."""
    x, expected = ggml["x_file"], ggml["iq4_nl_file"]
    with np.errstate(all="ignore"):  # as dtypes.quantize: ggml overflows silently in its search
        ours = iquants.encode_iq4_nl_file(x.reshape(x.shape[0], -1, 32)).reshape(expected.shape)
    assert int((ours != expected).sum()) == 0
    assert (ours != D.quantize("iq4_nl", x)).any()  # the two searches differ, so this test tells them apart


def test_iq4_nl_equals_ggml_ref_row(ggml):
    """quantize_row_iq4_nl_ref (ntry = -1), byte for byte wherever ggml defines its bytes.

    A block whose |x| stays below 1e-15 gets d = 0 and keeps the codes the C's stack array held
    (undefined); ours are 8, level 1. Every other byte, and every d, must be equal.
    """
    x, expected = ggml["x_ref"], ggml["iq4_nl"]
    with np.errstate(all="ignore"):
        ours = D.quantize("iq4_nl", x).reshape(x.shape[0], -1, 18)
    expected = expected.reshape(ours.shape)
    dead = np.abs(x.reshape(ours.shape[0], -1, 32)).max(axis=-1) < np.float32(1e-15)
    assert dead.any() and (~dead).sum() > 300
    np.testing.assert_array_equal(ours[..., :2], expected[..., :2])
    assert int((ours[~dead] != expected[~dead]).sum()) == 0
    assert (ours[dead][:, 2:] == 0x88).all() and (ours[dead][:, :2].view("<u2") == 0).all()


# -- round trips ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["iq4_nl", "iq4_xs"])
@pytest.mark.parametrize("dist", ["normal", "uniform", "student"])
def test_round_trip_error(name, dist, rng):
    """|dequantize(quantize(x)) - x| <= 0.2 * the block's |x| max (the measured worst is ~0.15), row NMSE < 0.03,
    for scales where d stays a normal f16 (below, ggml's iq4_xs d underflows to 0)."""
    bs = D.dtype(name).block_size
    draw = {"normal": rng.standard_normal, "uniform": lambda s: rng.uniform(-1, 1, s),
            "student": lambda s: rng.standard_t(2, s)}[dist]
    x = (draw((64, 1024)) * 10.0 ** rng.integers(-2, 4, (64, 1))).astype(np.float32)
    raw = D.quantize(name, x)
    assert raw.shape == (64, 1024 // bs * D.dtype(name).block_bytes)
    y = D.dequantize(name, raw)
    err = np.abs(y - x).reshape(64, -1, bs).max(axis=-1)
    amax = np.abs(x).reshape(64, -1, bs).max(axis=-1)
    assert (err <= 0.2 * amax).all(), float((err / amax).max())
    assert (((y - x) ** 2).sum(-1) / (x**2).sum(-1)).max() < 0.03


@pytest.mark.parametrize("name", ["iq4_nl", "iq4_xs"])
def test_quantize_shapes_and_zeros(name, rng):
    bs, bb = D.dtype(name).block_size, D.dtype(name).block_bytes
    with pytest.raises(ValueError, match=f"whole blocks of {bs} values"):
        D.quantize(name, np.zeros((2, bs + 1), np.float32))
    raw = D.quantize(name, np.zeros((2, 3, 2 * bs), np.float32))
    assert raw.shape == (2, 3, 2 * bb) and (D.dequantize(name, raw) == 0).all()
    x = rng.standard_normal((3, bs)).astype(np.float32)
    np.testing.assert_array_equal(D.from_float(name, x), D.quantize(name, x))


# -- what the CUDA plugins make of the new dtypes ---------------------------------------------------------


@pytest.mark.parametrize("name", list(D_AT) + ["mxfp4"])
def test_cuda_copies_and_concat(name):
    """concat and the copies take any dtype and reach cuda_misc: it copies every format its device traits
    decode (quant_k.cuh: iq4_nl, iq4_xs, mxfp4; quant_iq.cuh: the grid I-quants), in any layout but mxfp4's
    odd-sized blocks, and concats none of them."""
    bs = D.dtype(name).block_size
    a, b = od.input("a", (2, bs), name), od.input("b", (3, bs), name)
    assert support.concat_ok(None, ops.concat(a, b, 0)) == "concat moves the 32-value block formats only"
    assert support.copy_ok(None, ops.cont(a)) is True
    permuted = support.copy_ok(None, ops.cont(od.input("c", (3, 2, bs), name).permute(1, 0, 2)))
    assert permuted is True if name != "mxfp4" else "copied between contiguous tensors only" in permuted
