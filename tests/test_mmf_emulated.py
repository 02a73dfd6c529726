"""cuda_matmul's mmf kernel (tensor-core f16/bf16 mat-mul for few columns) run on the CPU: its real source,
compiled by g++ against the host emulation of CUDA (tests/cuda_emu/shim.h, with kernel_main.cpp as the
driver), on the launch specs the plugin binds.

mma.sync m16n8k16 is emulated as a warp collective that assembles A, B and C from the lanes' fragments
by the PTX ISA's layouts (shim.h's emu_mma_m16n8k16), so a lane that loads the wrong weights or the
wrong b words, or a k order that differs between A and B, gives a wrong sum. Shared memory and outputs
start poisoned (0xFF: NaN floats), so an output left unwritten or a read of b before it is staged shows.
Results are compared with the numpy reference by NMSE (mul_mat's bound, 5e-4) and with the reference
run on b rounded to a's type (the kernel's only rounding; its products are exact and its sums f32) by
NMSE 1e-9. With several splits of K the counters (a zeroed scratch) must be back to 0 afterwards, ready
for the next launch or graph replay. On the H200 the same shapes run in test_cuda_matmul.py.

Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.dtypes import from_float, to_host_float
from opdispatch.graph import Graph
from opdispatch.hookspecs import Device
from opdispatch.plugins.cuda_matmul import fusion, specs, support
from opdispatch.plugins.cuda_matmul.specs import mmf
from opdispatch.tensor import Tensor
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import ScratchArena, call, gxx_major, kernel_emulator, placed_arena, run_launches, write_headers
from helpers import biased, gate_up_glu, residual

NMSE_MAX = 5e-4
NMSE_ROUNDED = 1e-9  # against the reference on b rounded to a's type, as the kernel rounds it
VIEWS = ("view", "reshape", "permute", "transpose")
#: a small GPU, so that split_k splits K over a few blocks
DEVICE = Device("cuda0", "cuda", "an emulated sm_90 GPU of 4 SMs",
                {"cc": (9, 0), "sm_count": 4, "smem_per_block": 48 * 1024, "smem_per_block_optin": 227 * 1024,
                 "smem_per_sm": 228 * 1024, "warp_size": 32})
#: the mma statement of each weight type, swapped for shim.h's emulation
MMA_PTX = re.compile(r'asm\("mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)\.\1\.f32 .*?\);', re.S)

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")


def _mm(dt: str, m: int, k: int, n: int, batch: tuple = (), a_batch: tuple | None = None,
        bview: str | None = None) -> Tensor:
    a = od.input("a", (*(batch if a_batch is None else a_batch), m, k), dt)
    if bview == "T":
        b = od.input("x", (*batch, k, n)).transpose()
    else:
        b = od.input("x", (*batch, n, k))
    return ops.mul_mat(a, b)


#: name: graph; each covers a part of the kernel (splits and row groups as split_k gives them on DEVICE:
#: 8 blocks of 8 warps)
CASES = {
    "bf16 N16 one split": lambda: _mm("bf16", 77, 64, 16),
    "f16 N9 K40 (a partial unit)": lambda: _mm("f16", 45, 40, 9),
    "bf16 N2 K200 (a partial group)": lambda: _mm("bf16", 45, 200, 2),
    "f16 N2 persistent (2 tiles a warp), M tail": lambda: _mm("f16", 1100, 72, 2),
    "bf16 N5 one tile": lambda: _mm("bf16", 19, 96, 5),
    "bf16 N12 K1024 four splits": lambda: _mm("bf16", 77, 1024, 12),
    "f16 N16 K2056 six splits, the last partial": lambda: _mm("f16", 33, 2056, 16),
    "bf16 N9 K2080 persistent, two splits, M tail": lambda: _mm("bf16", 600, 2080, 9),
    "bf16 broadcast batches, splits": lambda: _mm("bf16", 19, 512, 10, batch=(2, 3), a_batch=(1, 3)),
    "f16 b transposed (element loads)": lambda: _mm("f16", 21, 64, 16, bview="T"),
    "bias bf16 N13, splits": lambda: biased("bf16", 45, 1024, 13),
    "residual bf16 N16, splits": lambda: residual("bf16", 45, 1024, 16),
    "residual f16 N9 padded rows over batches, one split": lambda: residual("f16", 33, 96, 9, batch=(2,), pad=5),
    "glu f16 N16 bias swiglu_oai, splits": lambda: gate_up_glu("f16", 70, 512, 16, True, "swiglu_oai"),
    "glu bf16 N11 geglu": lambda: gate_up_glu("bf16", 33, 96, 11, False, "geglu"),
    "glu bf16 N16 persistent, two splits": lambda: gate_up_glu("bf16", 600, 2080, 16, False, "swiglu"),
}
def _nodes(y: Tensor) -> list[Tensor]:
    return [n for n in Graph.build(y).nodes if n.op not in VIEWS]


def _specs(y: Tensor, arena: ScratchArena) -> list[KernelSpec]:
    nodes = _nodes(y)
    if len(nodes) == 1:
        return mmf.mmf_specs(nodes[0], nodes[0], arena.ptr, arena.scratch, device=DEVICE)
    assert fusion.check(DEVICE, nodes, Graph.build(y)) is True
    return mmf.mmf_fused_specs(nodes, arena.ptr, arena.scratch, DEVICE)


@pytest.fixture(autouse=True)
def mmf_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The selection table takes mmf for 9..16 columns (whatever support.MMF_MIN_N, still to be set on the
    H200, says), so that the fusion rules accept mmf's groups."""
    monkeypatch.setattr(support, "MMF_MIN_N", support.MMV_MAX_N + 1)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mmf.cu and its headers, host-ready (the mma statements and the dynamic shared memory swapped for
    shim.h's), built with a call for every instance."""
    build = tmp_path_factory.mktemp("mmf_emu")
    write_headers(build)
    (build / "mm_common.cuh").write_text(mmf.MMF_CU.with_name("mm_common.cuh").read_text())
    src = mmf.MMF_CU.read_text()
    src, swaps = MMA_PTX.subn(r"emu_mma_m16n8k16_\1(d, a0, a1, a2, a3, b0, b1);", src)
    assert swaps == 2, "mmf.cu's mma statements changed: update the emulation's swap"
    shared = "extern __shared__ uint4 mmf_smem[];"
    assert shared in src
    src = src.replace(shared, "uint4* mmf_smem = reinterpret_cast<uint4*>(emu_ctx->smem);")
    assert "asm" not in src, "mmf.cu has inline PTX the emulation does not replace"
    return kernel_emulator(build, src, "".join(call(k, len(mmf.MmfArgs.names())) for k in specs.MMF_NAMES))


def _feeds(y: Tensor, rng: np.random.Generator) -> dict[Tensor, np.ndarray]:
    return {t: rng.uniform(-1, 1, t.shape).astype(np.float32) for t in Graph.build(y).inputs}


def _emulate(y: Tensor, feeds: dict, emulator: Path, tmp_path: Path) -> tuple[np.ndarray, KernelSpec, ScratchArena]:
    """The output of the one mmf launch the plugin binds for `y` (its memory poisoned first), run by the
    emulator, the launch, and the arena after it."""
    graph = Graph.build(y)
    arena = ScratchArena(sum(t.base.nbytes + 256 for t in (*graph.leafs, *graph.nodes)) + (4 << 20))
    for leaf in graph.leafs:
        arena.place(leaf, from_float(leaf.dtype.name, feeds[leaf]))
    for n in graph.nodes:
        arena.place(n, None)
    (spec,) = _specs(y, arena)
    arena.mem = run_launches([spec], arena, False, emulator, tmp_path)
    out = _nodes(y)[-1]
    at = arena.ptr(out)
    return arena.mem[at:at + out.nbytes].view(np.float32).reshape(out.shape), spec, arena


@pytest.mark.parametrize("case", list(CASES))
def test_mmf_emulated(case: str, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    y = CASES[case]()
    feeds = _feeds(y, rng)
    got, spec, arena = _emulate(y, feeds, emulator, tmp_path)
    what = f"{case}: {spec.kernel} grid {spec.grid} smem {spec.smem} ks {spec.args.ks} splits {spec.args.splits}"
    (ref,) = od.compile(y, "cpu").run(feeds)
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (unwritten, or b read before it was staged)"
    assert nmse(got, ref) <= NMSE_MAX, f"{what}: NMSE {nmse(got, ref):.3g}"
    prod = _nodes(y)[0]
    a, b = prod.srcs
    x = b if b in feeds else b.base  # the input b views
    rounded = to_host_float(a.dtype.name, from_float(a.dtype.name, feeds[x]))
    (model,) = od.compile(y, "cpu").run({**feeds, x: rounded})
    assert nmse(got, model) <= NMSE_ROUNDED, f"{what}: NMSE {nmse(got, model):.3g} against b rounded to {a.dtype}"
    if int(spec.args.splits) > 1:
        at, nbytes = arena.roles["mmf counters"]
        assert not arena.mem[at:at + nbytes].any(), f"{what}: counters not back to 0"


def _tiles_a_warp(spec: KernelSpec) -> int:
    """The most warp tiles a warp of the launch streams (mmf.cu's grid: row groups * splits)."""
    a = spec.args
    tiles = -(-int(a.M) // mmf.TILE_ROWS)
    return -(-tiles // (spec.grid[0] // int(a.splits) * mmf.WARPS))


def test_cases_cover_the_kernel() -> None:
    """The cases reach one and several splits with and without GLU, persistent warps (more than one tile)
    with one split and several, with and without GLU, both tile counts and both weight types, and a residual
    addend (bias_col > 0) with one split and several."""
    seen = set()
    residual_splits = set()
    for make in CASES.values():
        y = make()
        (spec,) = _specs(y, placed_arena(y, sum(t.base.nbytes + 256 for t in Graph.build(y).leafs) + (4 << 20)))
        seen.add((int(spec.args.splits) > 1, _tiles_a_warp(spec) > 1, spec.kernel))
        if int(spec.args.bias_col) > 0:
            residual_splits.add(int(spec.args.splits) > 1)
    kernels = {k for *_, k in seen}
    assert {s for s, _, _ in seen} == {False, True}
    assert {(s, p) for s, p, _ in seen} >= {(False, True), (True, True)}
    assert any("EPI_GLU" in k for s, _, k in seen if s) and any("EPI_GLU" in k for s, _, k in seen if not s)
    assert any("EPI_GLU" in k for _, p, k in seen if p)
    assert {"W_F16", "W_BF16"} <= {k.split("<")[1].split(",")[0] for k in kernels}
    assert {k.split(",")[1].strip() for k in kernels} == {"1", "2"}
    assert residual_splits == {False, True}
