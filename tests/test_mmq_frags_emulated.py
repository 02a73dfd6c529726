"""mmq_wgmma's register A fragments (cuda_matmul's kernels/mmq_frags.cuh: q4_0, q8_0, q4_K, q5_K, q6_K) run on the
CPU, bit for bit against the reference dequantization rounded to bf16.

The header's real source is compiled by g++ against tests/cuda_emu/shim.h (its inline PTX, the bf16x2 conversion
and arithmetic, swapped for shim.h's exact host emulation, each swap asserted) with tests/cuda_emu/frags_main.cpp,
which lays random raw K tiles out as the kernel's raw stages hold them (rows Tile::RS bytes apart, q6_K's blocks
`lead` bytes into their granules, the rest poisoned) and calls frags<WT> for every lane (g = lane / 4, t = lane %
4), warp and K tile of each. The expected words are opdispatch.dtypes.dequantize's values rounded to bf16 (to
nearest even, ml_dtypes) placed as wgmma.cuh's m16n8k16 A fragment: register j of k16 step kk holds (row g + 8 (j %
2), k 16 kk + 2t + 8 (j / 2)) in its low half and k + 1 in its high half. What the kernel computes before that
rounding (mmq_wgmma.cu's opening comment, mmq_frags.cuh's): the K-quants the A stage's fmaf(q, d * sc, -(dmin *
min)) (q6_K's (q - 32) * (d * sc)), which is dequantize's float (its product is exact, so one rounding either
way); q8_0 fmaf(q, d, +0), dequantize's float but +0 where it has -0 (q = 0, d < 0); q4_0 bf16x2 arithmetic, d
rounded to bf16 first: bf16(bf16(q - 8) * bf16(d)), q - 8 exact, so (q - 8) * bf16(d) in float32 (exact) rounded
once. The blocks: opdispatch.quants.samples' (scales of one octave) and any finite halves for d and dmin (zeros,
subnormals, 65504, both signs). shim.h's bf16 operations are checked against exact rational arithmetic too.
On the H200 the kernel's products run in test_cuda_matmul.py. Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

import math
import subprocess
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from opdispatch import dtypes
from opdispatch.plugins.cuda_matmul import specs
from opdispatch.plugins.cuda_matmul.specs import mmq_wgmma
from opdispatch.plugins.cuda_matmul.specs.mmq import row_stride
from opdispatch.quants.samples import random_blocks
from cuda_emu.hostcode import EMU, compile_emulator, gxx_major, write_headers
from helpers import subscaled_blocks
from test_mmq_emulated import SWAPS
from test_quant_header import random_blocks as any_finite_blocks

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")

#: the plugin headers mmq_frags.cuh includes, made host C++ by test_mmq_emulated.py's swaps
HEADERS = ("mm_common.cuh", "mmv_common.cuh", "mmq_common.cuh")
FORMATS = mmq_wgmma.RS_FORMATS
ROWS = 64  # a warpgroup's rows: 4 warps
TILES = 8  # raw K tiles a format (q6_K: every lead, 0 .. 14)
VALUES = mmq_wgmma.RAW_KB * 32  # a raw K tile's values a row


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("mmq_frags")
    write_headers(build)
    for name in (*HEADERS, "mmq_frags.cuh"):
        src = specs.KERNELS_DIR.joinpath(name).read_text()
        for ptx, host in SWAPS[name]:
            assert ptx in src, f"{name} changed: update the emulation's swap of {ptx.strip()[:60]}"
            src = src.replace(ptx, host)
        assert "asm" not in src, f"{name} has inline PTX the emulation does not replace"
        (build / name).write_text(src)
    (build / "formats.inc").write_text("".join(f"FORMAT({q}, {specs.W_KIND[q]})\n" for q in mmq_wgmma.WGMMA_FORMATS))
    (build / "frags_main.cpp").write_text((EMU / "frags_main.cpp").read_text())  # its includes: the build's copies
    return compile_emulator(build / "frags_main.cpp", build / "frags")


def _run(driver: Path, *args: str) -> str:
    done = subprocess.run([str(driver), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"frags {' '.join(args)}: exit {done.returncode}\n{done.stderr}"
    return done.stdout


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16, to nearest even (ml_dtypes), as uint32 bit patterns."""
    assert not np.isnan(x).any()
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)


def expected_values(name: str, raw: np.ndarray) -> np.ndarray:
    """The bf16 bits (.., VALUES) the fragments of raw K tiles `raw` (.., block bytes) must hold, from
    dtypes.dequantize and the kernel's arithmetic before the rounding (the module's docstring)."""
    shape = raw.shape[:-1]
    deq = dtypes.dequantize(name, raw.reshape(-1))
    if name == "q4_0":
        unit = raw.copy()
        unit[..., 0:2] = np.array([1.0], np.float16).view(np.uint8)  # d = 1: the codes minus 8
        codes = dtypes.dequantize(name, unit.reshape(-1)).reshape(*shape, 32)
        d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)  # (.., 1)
        assert np.array_equal((codes * d).reshape(-1).view(np.uint32), deq.view(np.uint32)), "q4_0's codes and d"
        d_bf16 = d.astype(ml_dtypes.bfloat16).astype(np.float32)
        values = codes * d_bf16  # exact: 4 by 8 bits
    elif name == "q8_0":
        values = deq + np.float32(0)  # fmaf(q, d, +0): -0 becomes +0
    else:
        values = deq
    return bf16_bits(values).reshape(*shape[:-1], -1)


def fragments(bits: np.ndarray, warps: int) -> np.ndarray:
    """The m16n8k16 A fragments (tiles, SUBS, warps, 32 lanes, 4 k16 steps, 4 registers) of bf16 values `bits`
    (tiles, rows, VALUES), each K tile of BK values in its place."""
    subs, bk = mmq_wgmma.RAW_KB * 32 // mmq_wgmma.BK, mmq_wgmma.BK
    i, k, w, lane, kk, j = np.ix_(range(bits.shape[0]), range(subs), range(warps), range(32), range(4), range(4))
    g, t = lane // 4, lane % 4
    row = 16 * w + g + 8 * (j % 2)
    col = bk * k + 16 * kk + 2 * t + 8 * (j // 2)
    return bits[i, row, col] | bits[i, row, col + 1] << 16


def _tiles(name: str, rng: np.random.Generator) -> np.ndarray:
    """TILES raw K tiles of ROWS rows of `name` (TILES, ROWS, blocks, block bytes): the first half
    samples.random_blocks' blocks, the others any finite d and dmin."""
    dt = dtypes.dtype(name)
    blocks = VALUES // dt.block_size
    n = TILES * ROWS * blocks
    half = n // 2
    other = subscaled_blocks(rng, name, n - half) if dt.block_size == 256 else any_finite_blocks(name, n - half, rng)
    raw = np.concatenate([random_blocks(rng, name, half), other])
    return raw.reshape(TILES, ROWS, blocks, dt.block_bytes)


def test_layout(driver: Path) -> None:
    """RS_FORMAT is specs' RS_FORMATS, and each RS format's geometry is the one the plugin and dtypes know."""
    lines = [ln.split() for ln in _run(driver, "layout").splitlines()]
    got = {ln[0]: [int(v) for v in ln[1:]] for ln in lines}
    assert list(got) == list(mmq_wgmma.WGMMA_FORMATS)
    assert tuple(q for q, v in got.items() if v[0]) == mmq_wgmma.RS_FORMATS
    for name in FORMATS:
        _, qk, nbytes, raw, rs, bk, subs = got[name]
        dt = dtypes.dtype(name)
        assert (qk, nbytes) == (dt.block_size, dt.block_bytes), name
        assert raw == VALUES // qk * nbytes, name
        assert rs == row_stride(name, mmq_wgmma.RAW_KB), name
        assert (bk, subs * bk) == (mmq_wgmma.BK, VALUES), name


@pytest.mark.parametrize("name", FORMATS)
def test_fragments_are_dequantize(name: str, driver: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    raw = _tiles(name, rng)
    raw.tofile(tmp_path / "in.bin")
    _run(driver, "build", name, str(ROWS), str(tmp_path / "in.bin"), str(tmp_path / "out.bin"))
    want = fragments(expected_values(name, raw), ROWS // 16)
    got = np.fromfile(tmp_path / "out.bin", np.uint32).reshape(want.shape)
    bad = np.argwhere(got != want)
    if bad.size:
        at = tuple(bad[0])
        i, k, w, lane, kk, j = at
        g, t = lane // 4, lane % 4
        row, col = 16 * w + g + 8 * (j % 2), mmq_wgmma.BK * k + 16 * kk + 2 * t + 8 * (j // 2)
        lo_hi = [f"{_bf16_text(v & 0xFFFF)}, {_bf16_text(v >> 16)}" for v in (int(got[at]), int(want[at]))]
        pytest.fail(f"{name}: {len(bad)} of {got.size} fragment words differ, the first raw K tile {i}, K tile {k}, "
                    f"warp {w}, lane {lane} (g {g}, t {t}), k16 step {kk}, register {j}: row {row}'s values {col} and "
                    f"{col + 1} of the raw K tile: {int(got[at]):#010x} ({lo_hi[0]}) != {int(want[at]):#010x} "
                    f"({lo_hi[1]})")


def _bf16_text(h: int) -> str:
    return str(np.uint16(h).view(ml_dtypes.bfloat16))


# -- shim.h's bf16 operations against exact rational arithmetic ------------------------------------------------

def _bf16_of(x: Fraction, negative_zero: bool = False) -> int:
    """The bf16 bits of exact x rounded to nearest even (subnormals kept, overflow to infinity)."""
    if x == 0:
        return 0x8000 if negative_zero else 0
    sign, a = (0x8000 if x < 0 else 0), abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e = e - 1 if Fraction(2) ** e > a else e  # 2^e <= a < 2^(e + 1)
    quantum = Fraction(2) ** (max(e, -126) - 7)
    n, rest = divmod(a, quantum)
    n = int(n) + (rest > quantum / 2 or (rest == quantum / 2 and int(n) % 2 == 1))
    if n * quantum >= 2**128:
        return sign | 0x7F80
    return sign | int(np.float32(float(n * quantum)).view(np.uint32)) >> 16


def _special(r: float) -> int:
    return 0x7FFF if math.isnan(r) else (0x8000 if r < 0 else 0) | 0x7F80


def _bf(h: int) -> float:
    return float(np.uint32(h << 16).view(np.float32))


def _fma(a: int, b: int, c: int) -> int:
    x, y, z = _bf(a), _bf(b), _bf(c)
    if not all(map(math.isfinite, (x, y, z))):
        return _special(x * y + z)
    p = Fraction(x) * Fraction(y)
    s = p + Fraction(z)
    p_neg = math.copysign(1.0, x) * math.copysign(1.0, y) < 0
    return _bf16_of(s, negative_zero=p == 0 and z == 0 and p_neg and math.copysign(1.0, z) < 0)


def _mul(a: int, b: int) -> int:
    x, y = _bf(a), _bf(b)
    if not (math.isfinite(x) and math.isfinite(y)):
        return _special(x * y)
    return _bf16_of(Fraction(x) * Fraction(y), negative_zero=math.copysign(1.0, x) * math.copysign(1.0, y) < 0)


def _cvt(f: int) -> int:
    x = float(np.uint32(f).view(np.float32))
    return _bf16_of(Fraction(x), negative_zero=math.copysign(1.0, x) < 0) if math.isfinite(x) else _special(x)


def _halves_of(h: np.ndarray) -> np.ndarray:
    """(n, 2) bf16 bit patterns as (n,) u32 pairs, the first the low half."""
    return (h[:, 0] | h[:, 1] << 16).astype(np.uint32)


def _pairs(rng: np.random.Generator, n: int, exp: tuple[int, int]) -> np.ndarray:
    """n u32 of two bf16 halves with exponent fields in [exp), random signs and mantissas."""
    return _halves_of(rng.integers(*exp, (n, 2)) << 7 | rng.integers(0, 128, (n, 2)) | rng.integers(0, 2, (n, 2)) << 15)


def _midpoints(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 3) u32 triples whose every half has a * b exactly halfway between two bf16 and c far smaller, of
    either sign: where a sum rounded twice (to double, then to bf16) would tie and round to even."""
    a = rng.integers(120, 135, 512 * n) << 7 | rng.integers(0, 128, 512 * n) | rng.integers(0, 2, 512 * n) << 15
    b = rng.integers(120, 135, 512 * n) << 7 | rng.integers(0, 128, 512 * n) | rng.integers(0, 2, 512 * n) << 15
    p = (a.astype(np.uint32) << 16).view(np.float32) * (b.astype(np.uint32) << 16).view(np.float32)  # exact
    mid = np.flatnonzero(p.view(np.uint32) & 0xFFFF == 0x8000)[:2 * n]
    assert mid.size == 2 * n
    c = rng.integers(1, 40, 2 * n) << 7 | rng.integers(0, 128, 2 * n) | rng.integers(0, 2, 2 * n) << 15
    return np.stack([_halves_of(x.reshape(n, 2)) for x in (a[mid], b[mid], c)], 1)


def _bf16_cases(rng: np.random.Generator) -> np.ndarray:
    """(n, 3) u32 triples: any bits (NaN, inf, subnormals); moderate exponents with c near -a * b (cancellation);
    a * b halfway between two bf16 and c tiny; products in the subnormal range; q4_pair's operands; float32
    ties and subnormals."""
    n = 300
    anybits = rng.integers(0, 2**32, (n, 3), dtype=np.uint64).astype(np.uint32)
    a, b = _pairs(rng, n, (100, 155)), _pairs(rng, n, (100, 155))
    prod = np.stack([(a >> s & 0xFFFF).astype(np.uint32) << 16 for s in (0, 16)], 1).view(np.float32) * \
        np.stack([(b >> s & 0xFFFF).astype(np.uint32) << 16 for s in (0, 16)], 1).view(np.float32)
    near = (-prod).view(np.uint32) >> 16  # -a * b truncated to bf16, then moved by -2 .. 2 ulps
    near = (near.astype(np.int64) + rng.integers(-2, 3, near.shape)).astype(np.uint32) & 0xFFFF
    cancel = np.stack([a, b, _halves_of(near)], 1)
    tiny = np.stack([_pairs(rng, n, (1, 60)), _pairs(rng, n, (1, 70)), _pairs(rng, n, (0, 3))], 1)
    nib = rng.integers(0, 16, (n, 2)).astype(np.uint32)
    q4 = np.stack([_halves_of(0x4300 | nib), np.full(n, 0x3F803F80, np.uint32), np.full(n, 0xC308C308, np.uint32)], 1)
    q4_mul = np.stack([_pairs(rng, n, (127, 131)), _pairs(rng, n, (90, 150)), np.zeros(n, np.uint32)], 1)
    ties = rng.integers(0, 2**32, (n, 3), dtype=np.uint64).astype(np.uint32)
    ties[:, 0] = ties[:, 0] & 0xFFFF0000 | 0x8000  # halfway between two bf16
    ties[:, 1] &= 0x807FFFFF  # float32 subnormals
    return np.concatenate([anybits, cancel, _midpoints(rng, n), tiny, q4, q4_mul, ties]).astype(np.uint32)


def test_shim_bf16_ops_are_exact(driver: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    """shim.h's cvt.rn.bf16x2.f32, fma.rn.bf16x2 and mul.rn.bf16x2: each half the exact result rounded once to
    nearest even (subnormals kept, overflow to infinity), a NaN the canonical 0x7fff."""
    x = _bf16_cases(rng)
    x.tofile(tmp_path / "in.bin")
    _run(driver, "bf16", str(tmp_path / "in.bin"), str(tmp_path / "out.bin"))
    y = np.fromfile(tmp_path / "out.bin", np.uint32).reshape(x.shape)
    for n, ((a, b, c), (cvt, fma, mul)) in enumerate(zip(x.tolist(), y.tolist())):
        want = (_cvt(a) << 16 | _cvt(b),
                _fma(a >> 16, b >> 16, c >> 16) << 16 | _fma(a & 0xFFFF, b & 0xFFFF, c & 0xFFFF),
                _mul(a >> 16, b >> 16) << 16 | _mul(a & 0xFFFF, b & 0xFFFF))
        assert (cvt, fma, mul) == want, (f"case {n}: a {a:#010x} b {b:#010x} c {c:#010x}: cvt, fma, mul "
                                         f"{cvt:#010x} {fma:#010x} {mul:#010x} != {want[0]:#010x} {want[1]:#010x} "
                                         f"{want[2]:#010x}")
