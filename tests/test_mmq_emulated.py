"""cuda_matmul's quantized GEMM (mmq.cu, after mmv.cu's quantize_q8_1) run on the CPU: the real sources,
compiled by g++ against tests/cuda_emu/shim.h, on the launch specs the plugin binds (specs/mmq.py).

Every CUDA thread is a fiber (shim.h: a block's threads take turns on one OS thread, switching at barriers);
__syncthreads / __syncwarp / shuffles go through barriers; cp.async copies land at the wait_group that covers
them ("lazy") or at once ("eager"), so a stage read before its wait or refilled while a warp still reads it
gives a wrong or NaN result (shared memory and outputs start poisoned, 0xFF); mma.sync m16n8k32 is emulated warp-collectively from the PTX ISA's fragment layout
(shim.h's emu_mma_s8), so a wrong fragment map shows too. The only edits to the sources are the inline
PTX swapped for host functions. Results are compared with the numpy reference by NMSE (mul_mat's bound,
5e-4) and with the reference run on b rounded to q8_1 in numpy by NMSE 1e-8: the kernel's only departure
from the reference is that rounding, so anything else shows. On the H200 the same paths run in
test_cuda_matmul.py. Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import attrs
import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.dtypes import from_float
from opdispatch.graph import Graph
from opdispatch.plugins.cuda_matmul import fusion, specs, support
from opdispatch.plugins.cuda_matmul.specs import mmq, mmq_id
from opdispatch.tensor import Tensor
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import ScratchArena, call, gxx_major, kernel_emulator, placed_arena, run_launches, write_headers
from test_mmvq_stream_emulated import q8_1_rounded

NMSE_MAX = 5e-4
NMSE_Q8_1 = 1e-8  # against the reference on b rounded to q8_1 as quantize_q8_1 rounds it

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")

#: mmq.cu's inline PTX (the mma statements, whole) and their host replacements
MMA_PTX = ("    asm volatile(\"mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
           "{%4, %5, %6, %7}, {%8, %9}, \"\n"
           "                 \"{%10, %10, %10, %10};\\n\"\n"
           "                 : \"=r\"(d[0]), \"=r\"(d[1]), \"=r\"(d[2]), \"=r\"(d[3])\n"
           "                 : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"r\"(b0), \"r\"(b1), "
           "\"r\"(0));",
           "    emu_mma_s8(d, a, b0, b1);")
MMA_K16_PTX = ("    asm volatile(\"mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, "
               "{%6}, \"\n"
               "                 \"{%7, %7, %7, %7};\\n\"\n"
               "                 : \"=r\"(d[0]), \"=r\"(d[1]), \"=r\"(d[2]), \"=r\"(d[3])\n"
               "                 : \"r\"(a0), \"r\"(a1), \"r\"(b), \"r\"(0));",
               "    emu_mma_s8_k16(d, a0, a1, b);")
SHARED = "extern __shared__ uint4 smem_u4[];"
EMU_SHARED = "uint4* smem_u4 = reinterpret_cast<uint4*>(emu_ctx->smem);"
ROUTE_SHARED = "extern __shared__ int smem[];"
LAST_FLAG = ("    __shared__ bool last;", "    static bool last;")


def _mm(dt: str, m: int, k: int, n: int, tb: str = "f32", batch: tuple = (), a_batch: tuple | None = None,
        bview: str | None = None) -> Tensor:
    a = od.input("a", (*(batch if a_batch is None else a_batch), m, k), dt)
    b = od.input("x", (*batch, k, n), tb).transpose() if bview == "T" else od.input("x", (*batch, n, k), tb)
    return ops.mul_mat(a, b)


def _residual(dt: str, m: int, k: int, n: int, batch: tuple = (), pad: int = 0) -> Tensor:
    """add(mul_mat(a, x), r): r of the product's shape (*batch, n, m), rows m + pad floats apart (a view when pad)."""
    wide = od.input("r", (*batch, n, m + pad))
    return ops.add(_mm(dt, m, k, n, batch=batch), wide.view((*batch, n, m), wide.strides) if pad else wide)


Cfg = mmq.MmqConfig
#: name: (graph, eager copies, configuration or None for TABLE's); between them: every TABLE entry, split-K
#: (even and uneven slices, with a K tail, over batches), K tails, M / N edges, ring wrap-around, batches,
#: and the other tile shapes the sweep times
CASES = {
    "q4_0 N9 M77 K2048 (64x16, 4 slices)": (lambda: _mm("q4_0", 77, 2048, 9), False, None),
    "q8_0 N16 K768 (3 K tiles in a 4-stage ring)": (lambda: _mm("q8_0", 40, 768, 16), True, None),
    "q4_1 N20 K384 (64x32, a 4-block K tail)": (lambda: _mm("q4_1", 33, 384, 20), False, None),
    "q5_1 N70 K1088 (128x64, 2 slices, a 2-block K tail, 2 column tiles)": (lambda: _mm("q5_1", 19, 1088, 70), False,
                                                                              None),
    "q5_0 broadcast batches": (lambda: _mm("q5_0", 21, 256, 11, batch=(3, 4), a_batch=(1, 2)), True, None),
    "q8_0 b bf16 transposed": (lambda: _mm("q8_0", 35, 256, 13, tb="bf16", bview="T"), False, None),
    "q4_0 N64 M64 exact tiles": (lambda: _mm("q4_0", 64, 256, 64), False, None),
    "q4_0 N130 (128x64, 3 column tiles)": (lambda: _mm("q4_0", 40, 512, 130), False, None),
    "q4_0 N16 K2304 uneven slices (9 K tiles in 4)": (lambda: _mm("q4_0", 70, 2304, 16), False,
                                                      Cfg(1, 2, 4, 1, 3, 8, 16)),
    "q8_0 N40 split over batches": (lambda: _mm("q8_0", 30, 1024, 40, batch=(2,)), True, Cfg(1, 4, 4, 2, 3, 8, 4)),
    "q4_1 N12 K1152 (KB 16, a 4-block tail)": (lambda: _mm("q4_1", 24, 1152, 12), False, Cfg(1, 2, 4, 1, 3, 16, 8)),
    "q5_0 N100 (128x128, 64x32 a warp, 2 slices)": (lambda: _mm("q5_0", 50, 1024, 100), False,
                                                    Cfg(4, 4, 2, 4, 2, 8, 2)),
    "q4_0 N33 (128x16, 3 column tiles, 2 slices)": (lambda: _mm("q4_0", 45, 1024, 33), False,
                                                    Cfg(2, 2, 4, 1, 4, 8, 16)),
    # a residual addend added as the sums are written: by the last block of split K, or straight
    "residual q4_0 N16 M77 K2048 (4 slices)": (lambda: _residual("q4_0", 77, 2048, 16), False, None),
    "residual q8_0 N33 padded rows over batches (one slice)": (lambda: _residual("q8_0", 30, 256, 33, (2,), 7), True,
                                                               None),
}
#: the sub-scaled formats (TABLE_K): every format and TABLE_K entry, K tails (KB 16: a one-super-block or
#: 8-block tail), K tiles starting inside a granule (q2_K, q3_K, q6_K, iq4_xs, mxfp4), split K
K_CASES = {
    "q4_K N9 M77 K2304 (64x16, 9 K tiles in 4 slices)": (lambda: _mm("q4_K", 77, 2304, 9), False, None),
    "q5_K N20 M33 K768 (KB 16, a one-super-block tail)": (lambda: _mm("q5_K", 33, 768, 20), False,
                                                          Cfg(1, 2, 4, 2, 4, 16, 8)),
    "q6_K N45 M19 K2048 (64x64, 4 slices)": (lambda: _mm("q6_K", 19, 2048, 45), True, None),
    "q6_K N70 M21 K2048 (128x64, 2 slices, 2 column tiles)": (lambda: _mm("q6_K", 21, 2048, 70), False, None),
    "q2_K N16 M40 K1024 (mins, 2 slices)": (lambda: _mm("q2_K", 40, 1024, 16), False, None),
    "q3_K N27 M35 K2048 (64x32)": (lambda: _mm("q3_K", 35, 2048, 27), False, None),
    "iq4_nl N11 M50 K768 (KB 16, an 8-block tail)": (lambda: _mm("iq4_nl", 50, 768, 11), False,
                                                     Cfg(1, 2, 4, 1, 3, 16, 8)),
    "iq4_xs N13 b bf16 transposed": (lambda: _mm("iq4_xs", 35, 512, 13, tb="bf16", bview="T"), False, None),
    "mxfp4 N40 M30 K1024 over batches (odd block addresses)": (lambda: _mm("mxfp4", 30, 1024, 40, batch=(2,)), True,
                                                               None),
    "q4_K broadcast batches": (lambda: _mm("q4_K", 21, 256, 11, batch=(3, 4), a_batch=(1, 2)), True, None),
    "residual q4_K N70 M21 K1024 padded rows (2 slices, 2 column tiles)": (lambda: _residual("q4_K", 21, 1024, 70,
                                                                                          pad=3), False, None),
}
CASES.update(K_CASES)
A8 = mmq.A8_WIDE
#: the converted-tile (a8) configurations: each of specs/mmq.py's, legacy and sub-scaled formats (mins, sub-scales
#: per 16, K tiles starting inside a granule), partial row and column tiles, K tails, split (uneven slices) and
#: unsplit, batches
A8_CASES = {
    "a8 q4_0 N130 M77 K768 (128x128, 2 column tiles)": (lambda: _mm("q4_0", 77, 768, 130), False, A8),
    "a8 q8_0 N70 M40 K2304 (128x128, 9 K tiles in 4 slices)": (lambda: _mm("q8_0", 40, 2304, 70), True,
                                                              attrs.evolve(A8, splits=4)),
    "a8 q4_1 N20 K384 (128x64, a 4-block K tail)": (lambda: _mm("q4_1", 33, 384, 20), False, mmq.A8_64),
    "a8 q5_1 N75 M150 K1088 (32x64 warps, 2 slices, a 2-block tail)": (lambda: _mm("q5_1", 150, 1088, 75), False,
                                                                       attrs.evolve(mmq.A8_TALL, splits=2)),
    "a8 q5_0 broadcast batches": (lambda: _mm("q5_0", 21, 256, 11, batch=(3, 4), a_batch=(1, 2)), True, A8),
    "a8 q4_K N70 M33 K768 (KB 16, a one-super-block tail)": (lambda: _mm("q4_K", 33, 768, 70), False,
                                                             attrs.evolve(mmq.A8_64, kb=16, stages=2)),
    "a8 q6_K N45 M21 K2048 (2 slices)": (lambda: _mm("q6_K", 21, 2048, 45), True, attrs.evolve(A8, splits=2)),
    "a8 q2_K N40 M40 K1024 (mins)": (lambda: _mm("q2_K", 40, 1024, 40), False, A8),
    "a8 q3_K N27 M35 K2048": (lambda: _mm("q3_K", 35, 2048, 27), False, mmq.A8_TALL),
    "a8 q5_K N33 M19 K512": (lambda: _mm("q5_K", 19, 512, 33), False, A8),
    "a8 iq4_xs N13 b bf16 transposed": (lambda: _mm("iq4_xs", 35, 512, 13, tb="bf16", bview="T"), False, A8),
    "a8 mxfp4 N40 M30 K1024 over batches": (lambda: _mm("mxfp4", 30, 1024, 40, batch=(2,)), True, mmq.A8_64),
    "a8 iq4_nl N9 M50 K768": (lambda: _mm("iq4_nl", 50, 768, 9), False, A8),
}
CASES.update(A8_CASES)


def _node(y: Tensor) -> Tensor:
    return next(n for n in Graph.build(y).nodes if n.op == "mul_mat")


def _launches(y: Tensor, arena: ScratchArena, cfg: mmq.MmqConfig | None) -> list:
    """The launches of mul_mat `y` on mmq with `cfg`, or of the fused mul_mat_add `y` (its add), in `arena`."""
    node = _node(y)
    if y.op != "add":
        return mmq.mmq_specs(node, arena.ptr, arena.scratch, cfg)
    assert fusion.check(None, [node, y], Graph.build(y)) is True
    (bias,) = fusion.parts([node, y])[1]
    return mmq.mmq_specs(node, arena.ptr, arena.scratch, cfg, out=y, bias=bias, bias_col=fusion.bias_col(node, bias))


def _specs(y: Tensor, cfg: mmq.MmqConfig | None) -> list:
    """The launches of `y` on mmq (fake addresses)."""
    a = ScratchArena(1 << 24)
    graph = Graph.build(y)
    for t in (*graph.leafs, *graph.nodes):
        a.place(t, None)
    return _launches(y, a, cfg)




@pytest.fixture(autouse=True)
def mmq_any_n(monkeypatch: pytest.MonkeyPatch) -> None:
    """The selection table takes mmq for every column count above the mat-vecs' (by default it stops at
    support.MMQ_MAX_N, and gives 9 .. support.MMQ_SMALL_MAX_N columns to mmq_small), so that every TABLE entry
    is reached; and mmq_id for every mul_mat_id with many tokens (by default mmq_wgmma_id takes those of its formats
    above support.MMQ_WGMMA_ID_MIN_MEAN pairs an expert, such as the 128 x 128 converted-tile case's)."""
    monkeypatch.setattr(support, "MMQ_MAX_N", 2**31)
    monkeypatch.setattr(support, "MMQ_WGMMA_MIN_N", 2**31)  # mmq_wgmma only where mmq declines
    monkeypatch.setattr(support, "MMQ_SMALL_MAX_N", support.MMV_MAX_N)
    monkeypatch.setattr(support, "MMQ_WGMMA_ID_TYPES", ())


#: mmq_frags.cuh's inline PTX (whole statements) and shim.h's host replacements
FRAGS_PTX = (
    ('asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));', "r = emu_cvt_bf16x2(hi, lo);"),
    ('asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(t) : "r"(x), "r"(0x3f803f80u), "r"(0xc308c308u));',
     "t = emu_fma_bf16x2(x, 0x3f803f80u, 0xc308c308u);"),
    ('asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(v) : "r"(t), "r"(d2));', "v = emu_mul_bf16x2(t, d2);"),
)
#: mmq_wgmma.cu's own inline PTX: the A stages' 8-byte stores, setmaxnreg (the host's registers are its own)
WGMMA_PTX = (
    ('asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(saddr), "r"(a), "r"(b) : "memory");',
     "memcpy(emu_ctx->smem + saddr, &a, 4), memcpy(emu_ctx->smem + saddr + 4, &b, 4);"),
    ('asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\\n" ::"n"(R));', ""),
    ('asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\\n" ::"n"(R));', ""),
)
#: each kernel file the emulations copy: the swaps that make it host C++ (the inline PTX, the dynamic shared memory)
SWAPS: dict[str, tuple[tuple[str, str], ...]] = {
    "mm_common.cuh": (),
    "mmv_common.cuh": (),
    "mmq_common.cuh": (MMA_PTX, MMA_K16_PTX),
    "mmq_tile.cuh": (),
    "mmv.cu": (),
    "mmq.cu": ((SHARED, EMU_SHARED),),
    "mmv_id.cu": ((ROUTE_SHARED, "int* smem = reinterpret_cast<int*>(emu_ctx->smem);"),),
    "mmq_id.cu": ((SHARED, EMU_SHARED),),
    "mmq_small.cu": ((SHARED, EMU_SHARED),),
    "convert.cu": (),
    "mmq_frags.cuh": FRAGS_PTX,
    "mmq_wgmma.cu": (*WGMMA_PTX, (SHARED, EMU_SHARED)),
}


def launch_arity(graphs: Iterable[tuple[Tensor, Callable[[Tensor, ScratchArena], list]]],
                 nbytes: int = 1 << 26) -> dict[str, int]:
    """build_emulator's instances: each kernel's argument count over the launches of `graphs` (an output, and what
    gives its launches in an arena holding its graph's tensors)."""
    arity = {}
    for y, launches in graphs:
        arity.update({s.kernel: len(s.arg_values) for s in launches(y, placed_arena(y, nbytes))})
    return arity


def build_emulator(build: Path, kernels: tuple[str, ...], arity: dict[str, int]) -> Path:
    """tests/cuda_emu/kernel_main.cpp compiled in `build` for the instances `arity` names (name: its argument
    count) of the kernel files `kernels` (SWAPS' keys), with the shared headers made host C++."""
    write_headers(build)
    common = (build / "common.cuh").read_text()
    assert LAST_FLAG[0] in common, "common.cuh changed: update the emulation's swap of last_block's flag"
    (build / "common.cuh").write_text(common.replace(*LAST_FLAG))
    for name in ("mm_common.cuh", "mmv_common.cuh", "mmq_common.cuh", "mmq_tile.cuh", *kernels):
        src = specs.KERNELS_DIR.joinpath(name).read_text()
        for ptx, host in SWAPS[name]:
            assert ptx in src, f"{name} changed: update the emulation's swap of {ptx.strip()[:60]}"
            src = src.replace(ptx, host)
        assert "asm" not in src, f"{name} has inline PTX the emulation does not replace"
        (build / name).write_text(src)
    return kernel_emulator(build, "".join(f'#include "{k}"\n' for k in kernels),
                           "".join(call(n, arity[n]) for n in sorted(arity)))


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arity = {s.kernel: len(s.arg_values) for make, _, cfg in CASES.values() for s in _specs(make(), cfg)}
    return build_emulator(tmp_path_factory.mktemp("mmq_emu"), ("mmv.cu", "mmq.cu"), arity)


def _emulate(y: Tensor, feeds: dict, eager: bool, cfg: mmq.MmqConfig | None, emulator: Path,
             tmp_path: Path) -> tuple[np.ndarray, str]:
    """The output of the launches the plugin binds for mul_mat `y`, or the fused mul_mat_add `y` (quantize_q8_1,
    then mmq with `cfg`), run in turn by the emulator on one memory, the output poisoned first; and a description
    of the launches. Asserts that split K left its counters at zero for the next launch."""
    graph = Graph.build(y)
    node = _node(y)
    b = node.srcs[1]
    arena = ScratchArena(sum(t.base.nbytes + 256 for t in (*graph.leafs, *graph.nodes))
                         + 40 * b.base.nbytes + 17 * node.nbytes + (1 << 16))
    for leaf in graph.leafs:
        arena.place(leaf, from_float(leaf.dtype.name, feeds[leaf]))
    for n in graph.nodes:
        arena.place(n, None)
    launches = _launches(y, arena, cfg)
    assert [s.kernel.split("<")[0] for s in launches] == ["quantize_q8_1", "mmq"]
    mem = run_launches(launches, arena, eager, emulator, tmp_path)
    at = arena.ptr(y)
    got = mem[at:at + y.nbytes].view(np.float32).reshape(y.shape)
    args = launches[1].args
    what = "; ".join(f"{s.kernel} grid {s.grid} block {s.block} smem {s.smem}" for s in launches)
    what += f"; splits {args.splits}"
    if args.splits > 1:
        at, nbytes = arena.roles["mmq split counters"]
        assert not mem[at:at + nbytes].any(), f"{what}: split counters not back to zero"
    return got, what


def _marked(names: list[str]) -> list:
    """The cases as parameters, the converted-tile (a8) ones marked slow: support's table selects none of their
    configurations (mmq_sweep.py times them), so CI's default run leaves them to `pytest -m slow`."""
    return [pytest.param(n, marks=pytest.mark.slow) if n.startswith("a8 ") else n for n in names]


@pytest.mark.parametrize("case", _marked(list(CASES)))
def test_mmq_emulated(case: str, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    make, eager, cfg = CASES[case]
    y = make()
    assert support.choose(_node(y)).path == "mmq"
    graph = Graph.build(y)
    feeds = {t: rng.uniform(-1, 1, t.shape).astype(np.float32) for t in graph.inputs}
    got, launch = _emulate(y, feeds, eager, cfg, emulator, tmp_path)
    (ref,) = od.compile(y, "cpu").run(feeds)
    what = f"{case}: {launch}"
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (unwritten, or read before landing)"
    assert nmse(got, ref) <= NMSE_MAX, f"{what}: NMSE {nmse(got, ref):.3g}"
    b = _node(y).srcs[1]
    if b in feeds and b.dtype.name == "f32":  # a plain f32 b: the kernel's rounding of it, exactly
        (model,) = od.compile(y, "cpu").run({**feeds, b: q8_1_rounded(feeds[b])})
        assert nmse(got, model) <= NMSE_Q8_1, f"{what}: NMSE {nmse(got, model):.3g} against b rounded to q8_1"


def test_cases_cover_the_table() -> None:
    """The cases reach every entry of both tables, every format, split K (uneven slices, a K tail, batches)
    and unsplit."""
    def cfg_of(make, cfg):  # noqa: ANN001, ANN202
        node = _node(make())
        return node.srcs[0].dtype.name, cfg or mmq.mmq_config(node.srcs[0].dtype.name, node.shape[-2])

    used = {cfg_of(make, cfg) for make, _, cfg in CASES.values()}
    for dt in mmq.MMQ_FORMATS:
        assert dt in {d for d, _ in used}, f"no case for {dt}"
    assert {cfg for _, cfg in mmq.TABLE} <= {c for d, c in used if d in specs.LEGACY_NAMES}
    assert {cfg for _, cfg in mmq.TABLE_K} <= {c for d, c in used if d not in specs.LEGACY_NAMES}
    splits = [mmq.mmq_splits(cfg_of(make, cfg)[1], _node(make()).srcs[0].shape[-1]) for make, _, cfg in CASES.values()]
    assert 1 in splits and max(splits) >= 4


def test_a8_cases_cover_the_candidates() -> None:
    """The converted-tile cases reach every a8 template the sweep times, legacy and sub-scaled formats (q2_K's mins,
    q3_K / q6_K's halves), split and unsplit."""
    cfgs = [cfg for _, _, cfg in A8_CASES.values()]
    assert {c.template for cands in mmq.CANDIDATES.values() for c in cands if c.a8} <= {c.template for c in cfgs}
    dts = {_node(make()).srcs[0].dtype.name for make, _, _ in A8_CASES.values()}
    assert {"q4_0", "q8_0", "q4_1", "q2_K", "q3_K", "q6_K", "q4_K"} <= dts
    splits = {mmq.mmq_splits(cfg, _node(make()).srcs[0].shape[-1]) for make, _, cfg in A8_CASES.values()}
    assert 1 in splits and max(splits) >= 4


def test_splits_stay_within_k() -> None:
    """Every slice of a launch holds two K tiles at least, or the launch has one slice."""
    for _, cfg in (*mmq.TABLE, *mmq.TABLE_K):
        for k in (32, 256, 512, 2048, 14336):
            nkt = -(-k // 32 // cfg.kb)
            s = mmq.mmq_splits(cfg, k)
            assert 1 <= s <= cfg.splits and (s == 1 or nkt // s >= 2)


# -- mmq_id: mul_mat_id on the quantized GEMM (moe_route's tile table, quantize_q8_1, then mmq_id) ----------------


def _moe(dt: str, e: int, m: int, k: int, t: int, u: int, ub: int, bias: bool = False) -> Tensor:
    """mul_mat_id of (e, m, k) experts for x (t, ub, k) and ids (t, u), and an add_id of (e, m) biases if `bias`."""
    ids = od.input("ids", (t, u), "i32")
    y = ops.mul_mat_id(od.input("as", (e, m, k), dt), od.input("x", (t, ub, k)), ids)
    return ops.add_id(y, od.input("bias", (e, m)), ids) if bias else y


def _ids(kind: str, rng: np.random.Generator, t: int, u: int, e: int) -> np.ndarray:
    """Expert ids (t, u): u distinct experts a token drawn from all e ("random"), from the first u + 1 only
    ("few": the others have no pair), or every pair on expert e - 1 ("one", for u == 1)."""
    if kind == "one":
        return np.full((t, u), e - 1, np.int32)
    pool = e if kind == "random" else u + 1
    return np.argsort(rng.random((t, pool)), axis=-1)[:, :u].astype(np.int32)


#: name: (graph, ids kind, eager copies, configuration or None for mmq_id_config's): both configurations of
#: mmq_id_config (64 x 32 tiles up to SMALL_MEAN pairs an expert, 128 x 64 above), unused experts, all pairs on one
#: expert, Ub 1 and Ub == U, partial row tiles, a legacy format, K-quants with sub-scales, a fused add_id; the
#: converted-tile (a8) K loop
ID_CASES = {
    "q4_0 E8 U2 T40 Ub1 M77 (64x32 tiles, random ids)": (lambda: _moe("q4_0", 8, 77, 256, 40, 2, 1), "random", False, None),
    "q8_0 E4 U1 T40 (every pair on one expert: two tiles)": (lambda: _moe("q8_0", 4, 33, 256, 40, 1, 1), "one", True, None),
    "q4_K E8 U4 T24 Ub=U (experts 5..7 unused)": (lambda: _moe("q4_K", 8, 40, 512, 24, 4, 4), "few", False, None),
    "q6_K E4 U2 T40 Ub=U K2048 (128x64 tiles)": (lambda: _moe("q6_K", 4, 40, 2048, 40, 2, 2), "random", False, None),
    "q5_1 E4 U2 T20 K64 add_id bias": (lambda: _moe("q5_1", 4, 24, 64, 20, 2, 1, bias=True), "random", False, None),
    "mxfp4 E4 U3 T16 Ub=U (odd block addresses)": (lambda: _moe("mxfp4", 4, 30, 512, 16, 3, 3), "few", True, None),
    "a8 q4_0 E4 U2 T80 M150 (128x128 tiles)": (lambda: _moe("q4_0", 4, 150, 512, 80, 2, 1), "random", False,
                                               mmq.A8_WIDE),
    "a8 q6_K E4 U2 T40 Ub=U add_id bias": (lambda: _moe("q6_K", 4, 40, 2048, 40, 2, 2, bias=True), "random", True,
                                          mmq.A8_64),
}


def _id_node(y: Tensor) -> Tensor:
    return next(n for n in Graph.build(y).nodes if n.op == "mul_mat_id")


def _id_specs(y: Tensor, arena: ScratchArena, cfg: mmq.MmqConfig | None) -> list:
    """The launches of mul_mat_id `y` (or of its add_id group) on mmq_id with `cfg`, in `arena`."""
    node = _id_node(y)
    bias = y.srcs[1] if y.op == "add_id" else None
    return mmq_id.mmq_id_specs(node, y, arena.ptr, arena.scratch, arena.guard, bias=bias, cfg=cfg)


@pytest.fixture(scope="module")
def id_emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arity = launch_arity((make(), lambda y, arena, cfg=cfg: _id_specs(y, arena, cfg))
                         for make, _, _, cfg in ID_CASES.values())
    return build_emulator(tmp_path_factory.mktemp("mmq_id_emu"), ("mmv.cu", "mmv_id.cu", "mmq_id.cu"), arity)


def check_route(words: np.ndarray, ids: np.ndarray, e: int, bn: int, tiles: int) -> None:
    """moe_route's table (int32 words) against the ids: the experts used in order, their pairs' starts and counts,
    each expert's pairs (as a set), and the tile table: each used expert's pairs cut in tiles of bn, in order,
    at most `tiles` of them."""
    flat = ids.reshape(-1)
    pairs = flat.size
    count = np.bincount(flat, minlength=e)
    used = np.flatnonzero(count)
    s = int(words[0])
    assert s == len(used), f"{s} experts used, not {len(used)}"
    starts = np.concatenate(([0], np.cumsum(count[used])[:-1]))
    assert words[1:1 + s].tolist() == used.tolist()
    assert words[1 + e:1 + e + s].tolist() == starts.tolist()
    assert words[1 + 2 * e:1 + 2 * e + s].tolist() == count[used].tolist()
    listed = words[1 + 3 * e:1 + 3 * e + pairs]
    for x, at, c in zip(used, starts, count[used]):
        assert sorted(listed[at:at + c].tolist()) == np.flatnonzero(flat == x).tolist(), f"expert {x}'s pairs"
    n_tiles = int(words[1 + 3 * e + pairs])
    want = [(int(x), int(at + f * bn), int(min(bn, c - f * bn)))
            for x, at, c in zip(used, starts, count[used]) for f in range(-(-c // bn))]
    assert n_tiles == len(want) <= tiles, f"{n_tiles} tiles, {len(want)} wanted, at most {tiles}"
    got = words[2 + 3 * e + pairs:2 + 3 * e + pairs + 3 * n_tiles].reshape(-1, 3)
    assert [tuple(r) for r in got.tolist()] == want


def id_arena(y: Tensor, kind: str, rng: np.random.Generator, scratch: int) -> tuple[dict, ScratchArena]:
    """Feeds of mul_mat_id `y`'s graph (uniform in [-1, 1), its ids of `kind`: _ids) and an arena holding them, its
    nodes poisoned and room for `scratch` bytes of scratch buffers besides the routing table's."""
    graph = Graph.build(y)
    ids = _id_node(y).srcs[2]
    e, (t, u) = _id_node(y).srcs[0].shape[0], ids.shape
    feeds = {leaf: rng.uniform(-1, 1, leaf.shape).astype(np.float32) for leaf in graph.inputs}
    feeds[ids] = _ids(kind, rng, t, u, e)
    arena = ScratchArena(sum(x.base.nbytes + 256 for x in (*graph.leafs, *graph.nodes)) + scratch
                         + 4 * (8 * t * u + 4 * e) + (1 << 16))
    for leaf in graph.leafs:
        arena.place(leaf, from_float(leaf.dtype.name, feeds[leaf]))
    for n in graph.nodes:
        arena.place(n, None)
    return feeds, arena


@pytest.mark.parametrize("case", _marked(list(ID_CASES)))
def test_mmq_id_emulated(case: str, id_emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    """moe_route, quantize_q8_1 and mmq_id as the plugin binds them, run in turn by the emulator on one memory
    (outputs and scratch poisoned): the routing table exactly, every output written, and the result against
    the reference (mul_mat_id's bound) and against it on b rounded to q8_1 (the kernel's only rounding)."""
    make, kind, eager, cfg = ID_CASES[case]
    y = make()
    node = _id_node(y)
    as_, b, ids = node.srcs
    e, (t, u) = as_.shape[0], ids.shape
    assert support.choose(node).path == "mmq_id", support.mmq_id_ok(node)
    feeds, arena = id_arena(y, kind, rng, 40 * b.base.nbytes)
    launches = _id_specs(y, arena, cfg)
    assert [s.kernel.split("<")[0] for s in launches] == ["moe_route", "quantize_q8_1", "mmq_id"]
    mem = run_launches(launches, arena, eager, id_emulator, tmp_path)
    args = launches[2].args
    bn = int(launches[0].args.tile_n)
    assert bn == (cfg or mmq_id.mmq_id_config(as_.dtype.name, t * u, e)).bn
    at = int(launches[0].args.route)
    words = mem[at:at + 4 * mmq_id.mmv.route_words(e, t * u, int(args.max_tiles))].view(np.int32)
    check_route(words, feeds[ids], e, bn, int(args.max_tiles))
    assert arena.word(mem)[0] == 0, "an expert id reported out of range"
    at = arena.ptr(y)
    got = mem[at:at + y.nbytes].view(np.float32).reshape(y.shape)
    what = f"{case}: " + "; ".join(f"{s.kernel} grid {s.grid} block {s.block} smem {s.smem}" for s in launches)
    assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} outputs not written"
    (ref,) = od.compile(y, "cpu").run(feeds)
    assert nmse(got, ref) <= NMSE_MAX, f"{what}: NMSE {nmse(got, ref):.3g}"
    (model,) = od.compile(y, "cpu").run({**feeds, b: q8_1_rounded(feeds[b])})
    assert nmse(got, model) <= NMSE_Q8_1, f"{what}: NMSE {nmse(got, model):.3g} against b rounded to q8_1"


#: (experts, tokens, slots, tile columns, ids kind) of the routing-only runs: the target's shape (64 experts, 8 used,
#: 512 tokens), few tokens, every pair on one expert, half the experts unused
ROUTES = [(64, 512, 8, 64, "random"), (8, 9, 2, 32, "random"), (16, 300, 1, 64, "one"), (32, 100, 4, 32, "few")]


@pytest.mark.parametrize(("e", "t", "u", "bn", "kind"), ROUTES)
def test_route_tile_table_emulated(e: int, t: int, u: int, bn: int, kind: str, id_emulator: Path, tmp_path: Path,
                                   rng) -> None:  # noqa: ANN001
    """moe_route alone on larger routings: its table (scratch poisoned first) exactly as check_route says, within
    the bound the grid is sized by."""
    y = _moe("q4_0", e, 32, 256, t, u, 1)
    node = _id_node(y)
    ids = node.srcs[2]
    arena = ScratchArena(4 * (t * u * 6 + 4 * e) + node.nbytes + (1 << 16))
    feeds = _ids(kind, rng, t, u, e)
    arena.place(ids, feeds)
    arena.place(node, None)
    tiles = mmq_id.max_tiles(t * u, e, bn)
    spec = mmq_id.mmv.route_spec(node, node, arena.ptr, arena.scratch, arena.guard, tile_n=bn, tiles=tiles)
    mem = run_launches([spec], arena, False, id_emulator, tmp_path)
    at = int(spec.args.route)
    check_route(mem[at:at + 4 * mmq_id.mmv.route_words(e, t * u, tiles)].view(np.int32), feeds, e, bn, tiles)
