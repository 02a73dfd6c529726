"""core/backends/cuda/quant.cuh, the device's one definition of the block formats, against
opdispatch.dtypes: each format's geometry (block size, bytes, field offsets, code bits, zero,
scale rule), every way the kernels decode a block (one value, a pair, a block, 8 values of a row,
cuda_matmul's units and register words) bit-equal in f32 with `dtypes.dequantize` on random valid
blocks, encode8 byte-equal with `dtypes.quantize`, and the q8_1 rounding equal to its numpy model;
quant_k.cuh's formats (K-quants, iq4_nl, iq4_xs, mxfp4): decode and load_unit bit-equal with the host's
decoders (gguf-py's for the formats opdispatch.dtypes lacks), dot32 equal to the dot of the values.

The header's real source runs on the CPU: compiled by g++ against tests/cuda_emu/shim.h
(common.cuh's inline PTX swapped by tests/cuda_emu/hostcode.py), encode8's warp of 32 threads as
fibers (shim.h). Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

from opdispatch import dtypes
from opdispatch.quants import legacy
from cuda_emu.hostcode import EMU, compile_emulator, gxx_major, q8_1_reference, write_headers
from helpers import SUBSCALED_HALVES, SUBSCALED_SIZES, subscaled_blocks

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")

FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
#: quant.cuh's enum class Scale, in order
SCALES = ("signed_absmax", "absmax", "range")
#: the decodes the driver runs, in its output order
DECODES = ("decode", "decode_pair", "decode_block", "fetch8+decode8", "load_unit", "decode_words at 0",
           "decode_words at 2")
NBLOCKS = 257


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("quant_header")
    write_headers(build)
    return compile_emulator(EMU / "quant_main.cpp", build / "quant")


def _run(driver: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([str(driver), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"quant {' '.join(args)}: exit {done.returncode}\n{done.stderr}"
    return done


def _finite_halves(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random f16 bit patterns that are finite (zeros and subnormals included), as bytes."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # inf/NaN exponent -> subnormal
    return bits.astype("<u2").view(np.uint8).reshape(n, 2)


def random_blocks(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """n valid blocks of format `name`: any code bytes, finite scales and offsets."""
    fields = dict(_offsets(name))
    raw = rng.integers(0, 256, (n, dtypes.dtype(name).block_bytes), dtype=np.uint8)
    for f in ("d", "m"):
        if f in fields:
            raw[:, fields[f]:fields[f] + 2] = _finite_halves(rng, n)
    return raw


def _offsets(name: str) -> list[tuple[str, int]]:
    """(field, byte offset) of a block of `name`, from opdispatch.dtypes' field list."""
    out, at = [], 0
    for field, size in legacy.CODECS[name].fields:
        out.append((field, at))
        at += size
    return out


def test_layout_matches_dtypes(driver: Path) -> None:
    lines = _run(driver, "layout").stdout.split("\n")
    got = {ln.split()[0]: [int(v) for v in ln.split()[1:]] for ln in lines if ln}
    assert sorted(got) == sorted(FORMATS)
    for name in FORMATS:
        qk, nbytes, bits, scale, div, zero, d, m, qh, qs, qmax = got[name]
        dt, codec = dtypes.dtype(name), legacy.CODECS[name]
        offsets = dict(_offsets(name))
        assert (qk, nbytes) == (dt.block_size, dt.block_bytes), name
        assert (bits, SCALES[scale], div, zero, qmax) == (codec.bits, codec.scale_from, codec.divisor, codec.zero,
                                                           2 ** codec.bits - 1), name
        assert {"d": d, "m": m, "qh": qh, "qs": qs} == {f: offsets.get(f, -1) for f in ("d", "m", "qh", "qs")}, name


@pytest.mark.parametrize("name", FORMATS)
def test_decodes_are_dequantize(name: str, driver: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    raw = random_blocks(name, NBLOCKS, rng)
    raw.tofile(tmp_path / "in.bin")
    _run(driver, "decode", name, str(tmp_path / "in.bin"), str(tmp_path / "out.bin"))
    got = np.fromfile(tmp_path / "out.bin", np.float32).reshape(len(DECODES), NBLOCKS * 32)
    ref = dtypes.dequantize(name, raw.reshape(-1))
    for how, values in zip(DECODES, got):
        bad = np.flatnonzero(values.view(np.uint32) != ref.view(np.uint32))
        assert bad.size == 0, (f"{name} {how}: {bad.size} values differ from dtypes.dequantize, the first at "
                               f"{bad[0]} (block {bad[0] // 32}): {values[bad[0]]!r} != {ref[bad[0]]!r}")


def _encode_cases(rng: np.random.Generator) -> np.ndarray:
    """Blocks of values (n, 32) that reach encode8's corners, then random ones: zeros of both signs
    (the sign of a zero d or m), ties of the largest magnitude, values on a coarse grid (codes next
    to a half-integer), a constant block, and a count not a multiple of 4 (inactive lanes)."""
    zero = np.zeros(32, np.float32)
    negzero = np.full(32, -0.0, np.float32)
    ties = np.where(np.arange(32) % 2 == 0, np.float32(3.0), np.float32(-3.0))
    grid = (rng.integers(-16, 17, 32) / np.float32(4)).astype(np.float32)
    const = np.full(32, np.float32(0.7))
    special = np.stack([zero, negzero, ties, -ties, grid, const])
    grids = (rng.integers(-8, 9, (40, 32)) / np.float32(2)).astype(np.float32)
    scales = rng.choice(np.float32([1e-3, 1.0, 1e3]), (151, 1))
    randoms = (rng.standard_normal((151, 32)) * scales).astype(np.float32)
    return np.concatenate([special, grids, randoms]).astype(np.float32)  # 197 blocks


@pytest.mark.parametrize("name", FORMATS)
def test_encode8_is_quantize(name: str, driver: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    x = _encode_cases(rng)
    assert len(x) % 4 != 0  # the last warp has inactive lanes
    x.tofile(tmp_path / "in.bin")
    _run(driver, "encode", name, str(tmp_path / "in.bin"), str(tmp_path / "out.bin"))
    got = np.fromfile(tmp_path / "out.bin", np.uint8).reshape(len(x), -1)
    ref = dtypes.quantize(name, x).reshape(len(x), -1)
    bad = np.flatnonzero((got != ref).any(axis=1))
    assert bad.size == 0, f"{name}: {bad.size} blocks differ from dtypes.quantize, the first {bad[0]}: {x[bad[0]]}"


def test_q8_1_rounding(driver: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    """q8_1::scale and q8_1::code: the codes and d of the numpy model, d * sum(codes) as the mat-vecs
    use it, and a NaN value makes its block's d NaN (so every dot product with it is NaN)."""
    x = np.concatenate([np.zeros((1, 32), np.float32), (rng.integers(-254, 255, (20, 32)) / np.float32(2)),
                        rng.standard_normal((100, 32)) * np.float32(3)]).astype(np.float32)
    nan_block = rng.standard_normal((1, 32)).astype(np.float32)
    nan_block[0, 5] = np.nan
    np.concatenate([x, nan_block]).tofile(tmp_path / "in.bin")
    _run(driver, "q8_1", str(tmp_path / "in.bin"), str(tmp_path / "out.bin"))
    n = len(x) + 1
    out = np.fromfile(tmp_path / "out.bin", np.uint8)
    codes = out[:n * 32 * 4].view(np.int32).reshape(n, 32)
    d, s = out[n * 32 * 4:].view(np.float32).reshape(2, n)
    ref_codes, ref_d = q8_1_reference(x.reshape(-1))
    assert np.array_equal(codes[:-1], ref_codes)
    assert np.array_equal(d[:-1].view(np.uint32), ref_d.view(np.uint32))
    assert np.array_equal(s[:-1], ref_d * ref_codes.sum(axis=1).astype(np.float32))
    assert np.isnan(d[-1]) and np.isnan(s[-1])


# -- quant_k.cuh: the K-quants, iq4_nl, iq4_xs, mxfp4 ----------------------------------------------

#: quant_k.cuh's formats; iq4_nl, iq4_xs and mxfp4 are checked against gguf-py's decoders directly
KFORMATS = tuple(SUBSCALED_SIZES)
KCODES = {"q2_K": (16, 80), "q4_K": (16, 144), "q5_K": (16, 176)}  # the formats with mins


def _ktype(name: str) -> "gguf.GGMLQuantizationType":
    return gguf.GGMLQuantizationType[name.upper()]


def kreference(name: str, raw: np.ndarray) -> np.ndarray:
    """The host's values of raw blocks: opdispatch.dtypes where it has the format, else gguf-py."""
    if name in dtypes.DTYPES:
        return dtypes.dequantize(name, raw.reshape(-1))
    return np.asarray(gguf.quants.dequantize(raw.reshape(-1), _ktype(name)), np.float32).reshape(-1)


def test_klayout_matches_ggml(driver: Path) -> None:
    lines = _run(driver, "klayout").stdout.split("\n")
    got = {ln.split()[0]: [int(v) for v in ln.split()[1:]] for ln in lines if ln}
    assert sorted(got) == sorted(KFORMATS)
    for name, (qk, nbytes, sub, m) in got.items():
        assert (qk, nbytes) == gguf.GGML_QUANT_SIZES[_ktype(name)] == SUBSCALED_SIZES[name], name
        if name in dtypes.DTYPES:
            assert (qk, nbytes) == (dtypes.dtype(name).block_size, dtypes.dtype(name).block_bytes), name
        assert (m >= 0) == (name in KCODES), f"{name}: M marks the formats with mins"
        assert m < 0 or m == SUBSCALED_HALVES[name][1], name
        assert qk % sub == 0 and sub in (16, 32), name


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # mxfp4's largest scales: inf
@pytest.mark.parametrize("name", KFORMATS)
def test_kdecodes_are_dequantize(name: str, driver: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    """decode and load_unit equal the host's dequantize bit for bit (gguf-py's where opdispatch has none)."""
    raw = subscaled_blocks(rng, name, NBLOCKS)
    raw.tofile(tmp_path / "in.bin")
    _run(driver, "kdecode", name, str(tmp_path / "in.bin"), str(tmp_path / "out.bin"))
    ref = kreference(name, raw)
    got = np.fromfile(tmp_path / "out.bin", np.float32).reshape(2, ref.size)
    assert name == "mxfp4" or np.isfinite(ref).all()
    for how, values in zip(("decode", "load_unit"), got):
        bad = np.flatnonzero(values.view(np.uint32) != ref.view(np.uint32))
        qk = ref.size // NBLOCKS
        assert bad.size == 0, (f"{name} {how}: {bad.size} values differ from the host's, the first at {bad[0]} "
                               f"(block {bad[0] // qk}): {values[bad[0]]!r} != {ref[bad[0]]!r}")


@pytest.mark.parametrize("name", KFORMATS)
def test_kdot32_is_the_dot_of_the_values(name: str, driver: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    """dot32 of each 32 values with q8_1 codes (d, d * sum) is sum(value * code * d) up to float32
    rounding of its few products: within 4e-6 of the sum of the magnitudes of the terms it adds
    (each value's scaled code and min separately, as the cancellation between them is the format's)."""
    nb = 97
    raw = subscaled_blocks(rng, name, nb, e_range=(100, 150))
    values = kreference(name, raw).astype(np.float64)
    units = values.size // 32
    codes = rng.integers(-127, 128, (units, 32)).astype(np.int32)
    codes[0] = 127  # the extremes of the dp4a sums
    codes[1] = -127
    db = (rng.uniform(0.5, 2, units) * 10.0 ** rng.integers(-4, 2, units)).astype(np.float32)
    ds = np.stack([db, db * codes.sum(axis=1).astype(np.float32)], axis=1).astype(np.float32)
    raw.tofile(tmp_path / "in.bin")
    with open(tmp_path / "b.bin", "wb") as f:
        codes.tofile(f)
        ds.tofile(f)
    _run(driver, "kdot", name, str(tmp_path / "in.bin"), str(tmp_path / "b.bin"), str(tmp_path / "out.bin"))
    got = np.fromfile(tmp_path / "out.bin", np.float32).astype(np.float64)
    terms = values.reshape(units, 32) * codes * db[:, None].astype(np.float64)
    scale = np.abs(terms).sum(axis=1)
    if name in KCODES:  # a block with all codes 0 decodes to minus its mins
        lo, hi = KCODES[name]
        zeroed = raw.copy()
        zeroed[:, lo:hi] = 0
        mins = kreference(name, zeroed).astype(np.float64).reshape(units, 32)
        scale += 2 * np.abs(mins * codes * db[:, None].astype(np.float64)).sum(axis=1)
    err = np.abs(got - terms.sum(axis=1))
    bad = np.flatnonzero(~(err <= 4e-6 * scale + 1e-30))
    assert bad.size == 0, (f"{name}: {bad.size} of {units} dot32s off, the first unit {bad[0]}: {got[bad[0]]!r} != "
                           f"{terms[bad[0]].sum()!r} (scale {scale[bad[0]]!r})")
