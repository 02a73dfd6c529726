"""cuda_matmul's convert_norm and convert_glu (kernels/convert.cu: the launches that write a fused rms_norm's or glu's
result as the 16-bit b of the GEMMs after them) run on the CPU: their real source, compiled by g++ against the host
emulation of CUDA (tests/cuda_emu/shim.h, kernel_main.cpp the driver), on the launch specs the plugin binds
(specs/gemm.py's norm_conversion and glu_conversion).

The destination starts poisoned (0xFF: NaN in f16 and bf16), so a value left unwritten shows. convert_norm is held
to the float64 rms_norm(x) * w rounded to the 16-bit type within one unit in the last place (the kernel's sum of
squares and rsqrtf are float32); convert_glu bit for bit to the reference glu computed in float32 and rounded once,
but for at most one ulp where the activation's exp differs from numpy's. On the H200 the fused groups run in
tests/test_cuda_matmul_b16.py.

Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.plugins.cuda_matmul import specs
from opdispatch.plugins.cuda_matmul.specs.gemm import (ConvertGluArgs, ConvertNormArgs, glu_conversion,
                                                       norm_conversion)
from cuda_emu.hostcode import ScratchArena, gxx_major, run_launches
from test_mmq_emulated import build_emulator

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")

NP16 = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
#: the kernels run here and their argument records (an instance takes as many arguments as its record names)
RECORDS = {"convert_norm": ConvertNormArgs, "convert_glu": ConvertGluArgs}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """convert.cu and its headers, host-ready, built with a call for each convert_norm and convert_glu instance."""
    arity = {name: len(RECORDS[name.split("<")[0]].names()) for name in specs.CONVERT_NAMES
             if name.split("<")[0] in RECORDS}
    assert len(arity) == 6
    return build_emulator(tmp_path_factory.mktemp("convert_emu"), ("convert.cu",), arity)


def _ulps(got: np.ndarray, want: np.ndarray) -> int:
    """The most units in the last place between two arrays of one 16-bit type (the bits as an ordered integer:
    +0 and -0 alike, neighbors across zero one apart)."""
    def ordered(x: np.ndarray) -> np.ndarray:
        bits = x.view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)

    return int(np.abs(ordered(got) - ordered(want)).max())


@pytest.mark.parametrize("td", ["f16", "bf16"])
@pytest.mark.parametrize(("rows", "k", "pad"), [(5, 2048, 0), (3, 2304, 64), (2, 96, 0), (1, 4100, 4)])
def test_convert_norm_emulated(td: str, rows: int, k: int, pad: int, emulator: Path, tmp_path: Path,
                               rng: np.random.Generator) -> None:
    """rms_norm(x) * w as contiguous 16-bit rows: rows of x `pad` floats apart past K (a view), K below, at and
    past a round of 8 values a thread (2048: the second round re-reads the row), several rows a launch."""
    wide = od.input("x", (rows, k + pad))
    x = wide.view((rows, k), wide.strides)
    w = od.input("w", (k,))
    xs = (rng.standard_normal((rows, k + pad)) * rng.uniform(0.1, 30, (rows, 1))).astype(np.float32)
    ws = rng.uniform(-2, 2, k).astype(np.float32)
    arena = ScratchArena(xs.nbytes + ws.nbytes + 2 * rows * k + (1 << 16))
    arena.place(wide, xs)
    arena.place(w, ws)
    dst = arena.scratch("b", rows * k * 2)
    spec = norm_conversion(x, w, 1e-5, td, arena.ptr, dst)
    assert (spec.grid, spec.block) == ((rows,), specs.CONVERT_BLOCK)
    arena.mem = run_launches([spec], arena, False, emulator, tmp_path)
    got = arena.mem[dst:dst + rows * k * 2].view(NP16[td]).reshape(rows, k)
    v = xs[:, :k].astype(np.float64)
    want = (v / np.sqrt((v * v).mean(axis=1, keepdims=True) + 1e-5) * ws).astype(NP16[td])
    assert np.isfinite(got.astype(np.float32)).all(), "an output left unwritten"
    assert _ulps(got, want) <= 1


@pytest.mark.parametrize("td", ["f16", "bf16"])
@pytest.mark.parametrize(("kind", "shape", "offset"), [("swiglu", (7, 1024), 0), ("geglu", (3, 333), 0),
                                                      ("swiglu_oai", (5, 256), 0), ("reglu", (4, 512), 4)])
def test_convert_glu_emulated(td: str, kind: str, shape: tuple, offset: int, emulator: Path, tmp_path: Path,
                              rng: np.random.Generator) -> None:
    """act(gate) * up as contiguous 16-bit values: float4 loads where the count and both addresses allow (an
    up tensor 4 bytes off a 16-byte boundary, or an odd count, takes the scalar instance), several kinds."""
    g, u = od.input("g", shape), od.input("u", shape)
    y = ops.glu_split(g, u, kind, alpha=1.5, limit=2.0)
    gs, us = (rng.uniform(-4, 4, shape).astype(np.float32) for _ in range(2))
    n = gs.size
    arena = ScratchArena(3 * gs.nbytes + (1 << 16))
    arena.place(g, gs)
    arena.top += offset  # up off a 16-byte boundary
    arena.place(u, us)
    dst = arena.scratch("b", n * 2)
    spec = glu_conversion(y, td, arena.ptr, dst)
    assert spec.kernel.endswith("true>" if n % 4 == 0 and offset == 0 else "false>"), spec.kernel
    arena.mem = run_launches([spec], arena, False, emulator, tmp_path)
    got = arena.mem[dst:dst + n * 2].view(NP16[td]).reshape(shape)
    (ref,) = od.compile(y, "cpu").run({g: gs, u: us})
    assert np.isfinite(got.astype(np.float32)).all(), "an output left unwritten"
    assert _ulps(got, ref.astype(NP16[td])) <= 1
