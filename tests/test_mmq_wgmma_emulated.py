"""cuda_matmul's quantized GEMM on Hopper's wgmma (mmq_wgmma.cu, after convert.cu's conversion of b to bf16; and
mmq_wgmma_id after mmv_id.cu's moe_route) run on the CPU: the real sources, compiled by g++ against
tests/cuda_emu/shim.h, on the launch specs the plugin binds (specs/mmq_wgmma.py).

The emulation (tests/cuda_emu/shim.h): every CUDA thread a fiber; mbarriers counting arrivals phase by phase;
wgmma.mma_async a warpgroup collective in the 128-byte swizzle's addressing (the A fragments exchanged at issue).
Each case runs under one of two schedules: eager copies (landing at issue) with the block's last warps (the
copying warpgroup) run as far ahead as their barriers let them and the products computed at the wait that retires
them, so that a stage handed back before its products are retired is refilled under them; or lazy copies (landing
at the wait_group that covers them) with the products computed at issue, so that a stage signalled before its copies
have landed is read poisoned. Both faults, put in the kernel by hand, failed these tests (session 35). A fragment map
or a swizzle that does not match, a barrier phase off by one or a hand-over that deadlocks shows as a wrong sum, a
NaN (shared memory and outputs start poisoned) or an abort. The RS formats run the warp-specialized loop (a copying
warpgroup, mbarriers), the others the A-stage loop; both tiles, split K (the last block's sums on the computing warps'
named barrier). Outputs are compared with the numpy reference by NMSE (the GPU tests' bound: b and the weights rounded
to bf16). Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.devices import H200
from opdispatch.dtypes import from_float
from opdispatch.graph import Graph
from opdispatch.plugins.cuda_matmul.specs import mmq_wgmma
from opdispatch.tensor import Tensor
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import ScratchArena, gxx_major, placed_arena, run_launches
from test_mmq_emulated import _id_node, _moe, build_emulator, id_arena, launch_arity

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")

NMSE_MAX = 3e-5  # test_cuda_matmul.py's WGMMA_NMSE
NARROW, WIDE = mmq_wgmma.NARROW, mmq_wgmma.WIDE
#: an H200 of 2 SMs: split K cuts K in few slices, so a block runs many K tiles and the producer must wait for the
#: stages the computing warps hand back (on the H200 the small cases' slices are B_STAGES K tiles or fewer)
TWO_SMS = attrs.evolve(H200, props={**H200.props, "sm_count": 2})


def _mm(dt: str, m: int, k: int, n: int, batch: tuple = ()) -> Tensor:
    return ops.mul_mat(od.input("a", (*batch, m, k), dt), od.input("x", (*batch, n, k)))


#: name: (graph, tile, eager copies): the warp-specialized loop (q4_0, q8_0, q4_K, q6_K) and the A-stage loop (q4_1,
#: iq4_xs) at partial row and column tiles, split K (3 and 4 slices) and not, both tiles, batches; K whole raw K
#: tiles, as mmq's row conditions (whole 16-byte granules a row) make it for these formats
CASES = {
    "q4_0 M77 N129 K1024 narrow (4 slices)": (lambda: _mm("q4_0", 77, 1024, 129), NARROW, False),
    "q4_0 M200 N300 K2048 wide (2 column tiles, 4 slices)": (lambda: _mm("q4_0", 200, 2048, 300), WIDE, True),
    "q4_0 M77 N129 K256 wide (one raw K tile, not split)": (lambda: _mm("q4_0", 77, 256, 129), WIDE, False),
    "q8_0 M130 N40 K768 narrow (3 raw K tiles, 3 slices)": (lambda: _mm("q8_0", 130, 768, 40), NARROW, False),
    "q4_K M64 N256 K768 wide (3 slices)": (lambda: _mm("q4_K", 64, 768, 256), WIDE, False),
    "q6_K M70 N20 K2048 narrow over batches": (lambda: _mm("q6_K", 70, 2048, 20, (3,)), NARROW, True),
    # long K loops (2 SMs: 1 or 2 slices), the stages reused many times; eager copies and the producer scheduled
    # first, so that a stage handed back before its products are retired is refilled under them
    "q4_0 M100 N200 K4096 wide on 2 SMs (16 K tiles a block)": (lambda: _mm("q4_0", 100, 4096, 200), WIDE, True),
    "q4_K M70 N90 K2048 narrow on 2 SMs": (lambda: _mm("q4_K", 70, 2048, 90), NARROW, True),
    # lazy copies, the threads in turn: a stage signalled before its copies have landed is read poisoned
    "q8_0 M64 N128 K4096 narrow on 2 SMs (lazy copies)": (lambda: _mm("q8_0", 64, 4096, 128), NARROW, False),
    "q4_1 M77 N129 K512 narrow (A stages)": (lambda: _mm("q4_1", 77, 512, 129), NARROW, False),
    "iq4_xs M40 N300 K512 wide (A stages)": (lambda: _mm("iq4_xs", 40, 512, 300), WIDE, False),
}


def _node(y: Tensor) -> Tensor:
    return next(n for n in Graph.build(y).nodes if n.op == "mul_mat")


def _launches(y: Tensor, arena: ScratchArena, tile: mmq_wgmma.WgmmaTile, case: str = "") -> list:
    return mmq_wgmma.wgmma_specs(_node(y), arena.ptr, arena.scratch, TWO_SMS if "2 SMs" in case else None, tile)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arity = launch_arity((make(), lambda y, arena, tile=tile, case=case: _launches(y, arena, tile, case))
                         for case, (make, tile, _) in CASES.items())
    return build_emulator(tmp_path_factory.mktemp("mmq_wgmma_emu"), ("convert.cu", "mmq_frags.cuh", "mmq_wgmma.cu"),
                          arity)


@pytest.mark.parametrize("case", list(CASES))
def test_mmq_wgmma_emulated(case: str, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    make, tile, eager = CASES[case]
    y = make()
    graph = Graph.build(y)
    feeds = {t: rng.uniform(-1, 1, t.shape).astype(np.float32) for t in graph.inputs}
    node = _node(y)
    arena = ScratchArena(sum(t.base.nbytes + 256 for t in (*graph.leafs, *graph.nodes))
                         + mmq_wgmma.b_bytes(int(np.prod(node.srcs[1].shape[:-1])), node.srcs[1].shape[-1])
                         + 8 * node.nbytes + (1 << 16))  # b's bf16 rows, split K's partial sums
    for leaf in graph.leafs:
        arena.place(leaf, from_float(leaf.dtype.name, feeds[leaf]))
    for n in graph.nodes:
        arena.place(n, None)
    launches = _launches(y, arena, tile, case)
    assert [s.kernel.split("<")[0] for s in launches] == ["convert", "mmq_wgmma"]
    main = launches[1]
    rs = node.srcs[0].dtype.name in mmq_wgmma.RS_FORMATS
    assert main.block == tile.threads(node.srcs[0].dtype.name) == 128 * (tile.warpgroups + rs)
    # eager copies with the producer run ahead (a stage refilled too early shows), or lazy copies with the products
    # computed at issue (a stage read before its copies have landed shows)
    mem = run_launches(launches, arena, eager, emulator, tmp_path, shuffle=7, last_first=eager,
                       wgmma_at_issue=not eager)
    at = arena.ptr(y)
    got = mem[at:at + y.nbytes].view(np.float32).reshape(y.shape)
    what = f"{case}: {main.kernel} grid {main.grid} block {main.block} splits {main.args.splits}"
    if main.args.splits > 1:
        at, nbytes = arena.roles["mmq_wgmma split counters"]
        assert not mem[at:at + nbytes].any(), f"{what}: split counters not back to zero"
    (ref,) = od.compile(y, "cpu").run(feeds)
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (unwritten, or read before landing)"
    assert nmse(got, ref) <= NMSE_MAX, f"{what}: NMSE {nmse(got, ref):.3g}"


def test_cases_cover_both_loops_and_split_k() -> None:
    """The cases reach the warp-specialized loop and the A-stage one, both tiles, split K and an unsplit launch."""
    seen = set()
    for case, (make, tile, _) in CASES.items():
        y = make()
        main = _launches(y, placed_arena(y), tile, case)[1]
        dt = _node(y).srcs[0].dtype.name
        seen.add((dt in mmq_wgmma.RS_FORMATS, tile.bn, main.args.splits > 1))
    assert {rs for rs, _, _ in seen} == {True, False} and {bn for _, bn, _ in seen} == {128, 256}
    assert {split for _, _, split in seen} == {True, False}


# -- mmq_wgmma_id: mul_mat_id with many tokens (moe_route's tile table, b converted to bf16, then mmq_wgmma_id) -----

#: name: (graph, ids kind, tile, eager copies): the warp-specialized loop on gathered b rows (q4_0, q4_K with a fused
#: add_id) and the A-stage one (q4_1), tiles of 128 and 64 pairs, unused experts, Ub 1 and Ub == U
ID_CASES = {
    "q4_0 E8 U2 T150 Ub1 M77 K512 (random ids)": (lambda: _moe("q4_0", 8, 77, 512, 150, 2, 1), "random", NARROW, True),
    "q4_K E4 U2 T100 Ub=U add_id bias (64-pair tiles)": (lambda: _moe("q4_K", 4, 40, 512, 100, 2, 2, bias=True),
                                                         "random", mmq_wgmma.ID_TILES[1], False),
    "q8_0 E8 U2 T90 (experts 3..7 unused)": (lambda: _moe("q8_0", 8, 64, 768, 90, 2, 1), "few", NARROW, False),
    "q4_1 E4 U2 T80 (A stages)": (lambda: _moe("q4_1", 4, 50, 256, 80, 2, 1), "random", NARROW, False),
}


def _id_launches(y: Tensor, arena: ScratchArena, tile: mmq_wgmma.WgmmaTile) -> list:
    bias = y.srcs[1] if y.op == "add_id" else None
    return mmq_wgmma.wgmma_id_specs(_id_node(y), y, arena.ptr, arena.scratch, arena.guard, bias=bias, tile=tile)


@pytest.fixture(scope="module")
def id_emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arity = launch_arity((make(), lambda y, arena, tile=tile: _id_launches(y, arena, tile))
                         for make, _, tile, _ in ID_CASES.values())
    return build_emulator(tmp_path_factory.mktemp("mmq_wgmma_id_emu"),
                          ("mmv.cu", "mmv_id.cu", "convert.cu", "mmq_frags.cuh", "mmq_wgmma.cu"), arity)


@pytest.mark.parametrize("case", list(ID_CASES))
def test_mmq_wgmma_id_emulated(case: str, id_emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    """moe_route, the conversion and mmq_wgmma_id as the plugin binds them, run in turn by the emulator on one memory
    (outputs and scratch poisoned), against the reference."""
    make, kind, tile, eager = ID_CASES[case]
    y = make()
    as_, b, _ = _id_node(y).srcs
    feeds, arena = id_arena(y, kind, rng, 4 * b.base.nbytes)  # b's bf16 rows
    launches = _id_launches(y, arena, tile)
    assert [s.kernel.split("<")[0] for s in launches] == ["moe_route", "convert", "mmq_wgmma_id"]
    main = launches[2]
    rs = as_.dtype.name in mmq_wgmma.RS_FORMATS
    assert main.block == tile.threads(as_.dtype.name) == 128 * (tile.warpgroups + rs)
    mem = run_launches(launches, arena, eager, id_emulator, tmp_path, last_first=eager, wgmma_at_issue=not eager)
    at = arena.ptr(y)
    got = mem[at:at + y.nbytes].view(np.float32).reshape(y.shape)
    (ref,) = od.compile(y, "cpu").run(feeds)
    what = f"{case}: {main.kernel} grid {main.grid} block {main.block}"
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (unwritten, or read before landing)"
    assert nmse(got, ref) <= NMSE_MAX, f"{what}: NMSE {nmse(got, ref):.3g}"
