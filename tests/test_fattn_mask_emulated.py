"""cuda_attention's fattn_mask_flags (kernels/fattn_mask.cu: which tiles of a flash-attention prefill its mask skips,
leaves alone or reads) run on the CPU: its real source compiled by g++ against the host emulation of CUDA
(tests/cuda_emu/shim.h), on the launch spec the plugin binds (specs/flash.py's prefill plan), for masks whose rows
take its 16-byte loads and masks whose rows do not (the 2-byte loads), against the flags numpy finds. The flags
start poisoned (0xFF), so a flag left unwritten shows. On the H200 the prefill kernels that read the flags run in
test_cuda_attention.py.

Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.devices import H200, facts
from opdispatch.plugins.cuda_attention.specs import flash
from cuda_emu.hostcode import ScratchArena, call, gxx_major, host_ready, kernel_emulator, run_launches, write_headers

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")

NEG_INF, NEG_ZERO = np.float16(-np.inf), np.float16(-0.0)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("fattn_mask_emu")
    write_headers(build)
    kernel = host_ready(flash.MASK_CU)
    return kernel_emulator(build, kernel, call(flash.MASK_FLAGS, len(flash.MaskFlagsArgs.names())))


def _mask_values(rng: np.random.Generator, heads: int, tq: int, tk: int) -> np.ndarray:
    """(heads, tq, tk) f16: causal (-inf above the diagonal, 0 on and below it), then in some places a tile's worth
    of random values, a lone finite value among -inf, a lone nonzero among zeros, and zeros of either sign."""
    m = np.where(np.arange(tk)[None, :] > np.arange(tq)[:, None] + (tk - tq), NEG_INF, np.float16(0))
    m = np.repeat(m[None], heads, axis=0).astype(np.float16)
    for h in range(heads):
        r, c = rng.integers(0, tq - 40), rng.integers(0, tk - 40)
        m[h, r:r + 40, c:c + 40] = rng.standard_normal((40, 40)).astype(np.float16)
        for _ in range(6):
            m[h, rng.integers(0, tq), rng.integers(0, tk)] = rng.choice([np.float16(1.5), NEG_ZERO, NEG_INF])
    return m


def _want(m: np.ndarray, bm: int, bn: int) -> np.ndarray:
    """The flags numpy finds: (heads, q tiles, kv tiles) of 0 (every value -inf), 2 (every one zero) or 1."""
    heads, tq, tk = m.shape
    out = np.empty((heads, -(-tq // bm), -(-tk // bn)), np.uint8)
    for h, i, j in np.ndindex(out.shape):
        t = m[h, i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
        out[h, i, j] = 0 if np.all(t == NEG_INF) else (2 if np.all(t == 0) else 1)
    return out


@pytest.mark.parametrize(("tq", "tk", "row"), [
    (300, 1000, 1000),  # rows 2000 bytes apart: 16-byte loads, the last key tile 40 columns
    (300, 1001, 1001),  # rows 2002 bytes apart: 2-byte loads
    (257, 1001, 1008),  # a view whose rows are 2016 bytes apart: 16-byte loads but for the last key tile (41)
    (70, 64, 72),  # one key tile, a query tile of 6 rows
])
@pytest.mark.parametrize("heads", [1, 2])
def test_fattn_mask_flags_emulated(tq: int, tk: int, row: int, heads: int, emulator: Path, tmp_path: Path,
                                   rng: np.random.Generator) -> None:
    base = od.input("m", (1, heads, tq, row), "f16")
    mask = base.view((1, heads, tq, tk), base.strides)
    q = od.input("q", (1, 4, tq, 64))
    k, v = (od.input(name, (1, 2, tk, 64), "f16") for name in ("k", "v"))
    node = ops.flash_attn_ext(q, k, v, mask, 0.125)
    values = np.full((1, heads, tq, row), np.float16(7.0), np.float16)  # the padding past tk: finite, nonzero
    values[0, :, :, :tk] = _mask_values(rng, heads, tq, tk)
    plan = flash.flash_plan(node, facts(H200))
    (flags_bytes,) = (w.nbytes for w in plan.workspaces)
    arena = ScratchArena(values.nbytes + flags_bytes + 4096)
    arena.place(base, values)
    flags_at = arena.scratch("flags", flags_bytes)
    spec = plan.specs(lambda t: arena.ptr(mask) if t is mask else 0, [flags_at], arena)[0]
    assert spec.kernel == flash.MASK_FLAGS
    bm, bn = int(spec.args.bm), int(spec.args.bn)
    want = _want(values[0, :, :, :tk], bm, bn)
    assert spec.grid == (want.shape[2], want.shape[1], heads)
    assert want[0].size < 4 or {0, 1, 2} <= set(np.unique(want))  # the masks of many tiles reach every flag
    mem = run_launches([spec], arena, False, emulator, tmp_path)
    got = mem[flags_at:flags_at + want.size].reshape(want.shape)
    np.testing.assert_array_equal(got, want)
