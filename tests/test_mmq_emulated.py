"""cuda_matmul's quantized GEMM (mmq.cu, after mmv.cu's quantize_q8_1) run on the CPU: the real sources,
compiled by g++ against tests/cuda_emu/shim.h, on the launch specs the plugin binds (specs/mmq.py).

Every CUDA thread is a std::thread; __syncthreads / __syncwarp / shuffles go through barriers; cp.async
copies land at the wait_group that covers them ("lazy") or at once ("eager"), so a stage read before its
wait or refilled while a warp still reads it gives a wrong or NaN result (shared memory and outputs start
poisoned, 0xFF); mma.sync m16n8k32 is emulated warp-collectively from the PTX ISA's fragment layout
(shim.h's emu_mma_s8), so a wrong fragment map shows too. The only edits to the sources are the inline
PTX swapped for host functions. Results are compared with the numpy reference by NMSE (mul_mat's bound,
5e-4) and with the reference run on b rounded to q8_1 in numpy by NMSE 1e-8: the kernel's only departure
from the reference is that rounding, so anything else shows. On the H200 the same paths run in
test_cuda_matmul.py. Skipped without g++ 12 or newer (C++20 <barrier>, _Float16).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.dtypes import from_float
from opdispatch.graph import Graph
from opdispatch.plugins.cuda_matmul import specs, support
from opdispatch.plugins.cuda_matmul.specs import mmq
from opdispatch.tensor import Tensor
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import EMU, Arena, gxx_major, write_headers
from test_mmvq_stream_emulated import q8_1_rounded

NMSE_MAX = 5e-4
NMSE_Q8_1 = 1e-8  # against the reference on b rounded to q8_1 as quantize_q8_1 rounds it

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20 <barrier>, _Float16)")

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
LAST_FLAG = ("    __shared__ bool last;", "    static bool last;")


def _mm(dt: str, m: int, k: int, n: int, tb: str = "f32", batch: tuple = (), a_batch: tuple | None = None,
        bview: str | None = None) -> Tensor:
    a = od.input("a", (*(batch if a_batch is None else a_batch), m, k), dt)
    b = od.input("x", (*batch, k, n), tb).transpose() if bview == "T" else od.input("x", (*batch, n, k), tb)
    return ops.mul_mat(a, b)


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
    "q8_0 N40 split over batches": (lambda: _mm("q8_0", 30, 2048, 40, batch=(2,)), True, Cfg(1, 4, 4, 2, 3, 8, 4)),
    "q4_1 N12 K1152 (KB 16, a 4-block tail)": (lambda: _mm("q4_1", 24, 1152, 12), False, Cfg(1, 2, 4, 1, 3, 16, 8)),
    "q5_0 N100 (128x128, 64x32 a warp, 2 slices)": (lambda: _mm("q5_0", 50, 1024, 100), False,
                                                    Cfg(4, 4, 2, 4, 2, 8, 2)),
    "q4_0 N33 (128x16, 3 column tiles, 2 slices)": (lambda: _mm("q4_0", 45, 1024, 33), False,
                                                    Cfg(2, 2, 4, 1, 4, 8, 16)),
}
#: the sub-scaled formats (TABLE_K): every format and TABLE_K entry, K tails (KB 16: a one-super-block or
#: 8-block tail), K tiles starting inside a granule (q2_K, q3_K, q6_K, iq4_xs, mxfp4), split K
K_CASES = {
    "q4_K N9 M77 K2304 (64x16, 9 K tiles in 4 slices)": (lambda: _mm("q4_K", 77, 2304, 9), False, None),
    "q5_K N20 M33 K768 (KB 16, a one-super-block tail)": (lambda: _mm("q5_K", 33, 768, 20), False,
                                                          Cfg(1, 2, 4, 2, 4, 16, 8)),
    "q6_K N45 M19 K2048 (64x64, 4 slices)": (lambda: _mm("q6_K", 19, 2048, 45), True, None),
    "q6_K N70 M21 K4096 (128x64, 2 slices, 2 column tiles)": (lambda: _mm("q6_K", 21, 4096, 70), False, None),
    "q2_K N16 M40 K1024 (mins, 2 slices)": (lambda: _mm("q2_K", 40, 1024, 16), False, None),
    "q3_K N27 M35 K2048 (64x32)": (lambda: _mm("q3_K", 35, 2048, 27), False, None),
    "iq4_nl N11 M50 K768 (KB 16, an 8-block tail)": (lambda: _mm("iq4_nl", 50, 768, 11), False,
                                                     Cfg(1, 2, 4, 1, 3, 16, 8)),
    "iq4_xs N13 b bf16 transposed": (lambda: _mm("iq4_xs", 35, 512, 13, tb="bf16", bview="T"), False, None),
    "mxfp4 N40 M30 K1024 over batches (odd block addresses)": (lambda: _mm("mxfp4", 30, 1024, 40, batch=(2,)), True,
                                                               None),
    "q4_K broadcast batches": (lambda: _mm("q4_K", 21, 256, 11, batch=(3, 4), a_batch=(1, 2)), True, None),
}
CASES.update(K_CASES)


class ScratchArena(Arena):
    """An Arena whose scratch buffers (quantize_q8_1's b copy, mmq's partial sums and split counters) are
    carved from the same memory, by role."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.roles: dict[str, tuple[int, int]] = {}

    def scratch(self, role: str, nbytes: int, zeroed: bool = False) -> int:
        """A buffer of nbytes, zeroed if asked, else poisoned (0xFF) so that a read of a part nothing
        wrote shows."""
        at = self.top
        self.top = (self.top + nbytes + 255) // 256 * 256
        assert self.top <= self.mem.size, "arena too small for the scratch buffer"
        self.mem[at:at + nbytes] = 0 if zeroed else 0xFF
        self.roles[role] = (at, nbytes)
        return at


def _node(y: Tensor) -> Tensor:
    return next(n for n in Graph.build(y).nodes if n.op == "mul_mat")


def _names(y: Tensor, cfg: mmq.MmqConfig | None) -> list[str]:
    node = _node(y)
    a = ScratchArena(1 << 24)
    return [s.kernel for s in mmq.mmq_specs(node, lambda t: 512, a.scratch, cfg)]


def call(name: str, nargs: int) -> str:
    """instances.inc's entry for instance `name` of a kernel of nargs parameters."""
    args = ", ".join(f"a[{i}]" for i in range(nargs))
    return f'    {{"{name}", [](const Arg* a) {{ {name}({args}); }}}},\n'


@pytest.fixture(autouse=True)
def mmq_any_n(monkeypatch: pytest.MonkeyPatch) -> None:
    """The selection table takes mmq for every column count above the mat-vecs' (by default it stops at
    support.MMQ_MAX_N, and gives 9 .. support.MMQ_SMALL_MAX_N columns to mmq_small), so that every TABLE entry
    is reached."""
    monkeypatch.setattr(support, "MMQ_MAX_N", 2**31)
    monkeypatch.setattr(support, "MMQ_SMALL_MAX_N", support.MMV_MAX_N)


def host_sources(build: Path, *kernels: Path) -> None:
    """The shared headers, mmq_common.cuh, mmv.cu (quantize_q8_1) and `kernels` into `build`, host-ready: the mma
    statements and dynamic shared memory swapped for shim.h's emulation (each swap asserted), and od::last_block's
    flag, a block's shared variable, a static here, where blocks run one after another."""
    write_headers(build)
    common = (build / "common.cuh").read_text()
    assert LAST_FLAG[0] in common, "common.cuh changed: update the emulation's swap of last_block's flag"
    (build / "common.cuh").write_text(common.replace(*LAST_FLAG))
    for header in ("mm_common.cuh", "mmv_common.cuh", "mmv.cu"):
        (build / header).write_text(specs.KERNELS_DIR.joinpath(header).read_text())
    mq = specs.KERNELS_DIR.joinpath("mmq_common.cuh").read_text()
    assert MMA_PTX[0] in mq and MMA_K16_PTX[0] in mq, "mmq_common.cuh changed: update the emulation's swaps"
    (build / "mmq_common.cuh").write_text(mq.replace(MMA_PTX[0], MMA_PTX[1]).replace(MMA_K16_PTX[0], MMA_K16_PTX[1]))
    for cu in kernels:
        src = cu.read_text()
        assert SHARED in src, f"{cu.name} changed: update the emulation's swap of its shared memory"
        (build / cu.name).write_text(src.replace(SHARED, "uint4* smem_u4 = reinterpret_cast<uint4*>(emu_ctx->smem);"))
    for name in ("mm_common.cuh", "mmv_common.cuh", "mmv.cu", "mmq_common.cuh", *(cu.name for cu in kernels)):
        assert "asm" not in (build / name).read_text(), f"{name} has inline PTX the emulation does not replace"
    (build / "kernel.cu").write_text('#include "mmv.cu"\n' + "".join(f'#include "{cu.name}"\n' for cu in kernels))
    (build / "main.cpp").write_text((EMU / "kernel_main.cpp").read_text())


def build_emulator(build: Path, calls: str) -> Path:
    """The emulator of build's kernel.cu with `calls` (instances.inc's entries), compiled by g++."""
    (build / "instances.inc").write_text(calls)
    exe = build / "emu"
    cmd = ["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", "-w", "-I", str(build),
           str(build / "main.cpp"), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr[-4000:]}"
    return exe


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("mmq_emu")
    host_sources(build, specs.MMQ_CU)
    names = sorted({n for make, _, cfg in CASES.values() for n in _names(make(), cfg)})
    arity = {"quantize_q8_1": len(mmq.mmv.QuantizeArgs.__attrs_attrs__), "mmq": len(mmq.MmqArgs.__attrs_attrs__)}
    return build_emulator(build, "".join(call(n, arity[n.split("<")[0]]) for n in names))


def run_specs(emulator: Path, arena: Arena, launches: list, eager: bool, tmp_path: Path) -> np.ndarray:
    """The arena's memory after the emulator ran `launches` (KernelSpecs) in turn on it."""
    mem_file = tmp_path / "mem.bin"
    arena.mem.tofile(mem_file)
    for spec in launches:
        grid = tuple(spec.grid) + (1,) * (3 - len(spec.grid))
        cmd = [str(emulator), str(mem_file), spec.kernel, *map(str, grid), str(spec.block),
               *(str(v.item()) for v in spec.arg_values)]
        env = {**os.environ, "EMU_SMEM": str(spec.smem), "EMU_EAGER": str(int(eager))}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, f"{spec.kernel}: {done.stderr}"
    return np.fromfile(mem_file, np.uint8)


def _emulate(y: Tensor, feeds: dict, eager: bool, cfg: mmq.MmqConfig | None, emulator: Path,
             tmp_path: Path) -> tuple[np.ndarray, str]:
    """The output of the launches the plugin binds for mul_mat `y` (quantize_q8_1, then mmq with `cfg`), run in
    turn by the emulator on one memory, the output poisoned first; and a description of the launches. Asserts
    that split K left its counters at zero for the next launch."""
    graph = Graph.build(y)
    node = _node(y)
    b = node.srcs[1]
    arena = ScratchArena(sum(t.base.nbytes + 256 for t in (*graph.leafs, *graph.nodes))
                         + 40 * b.base.nbytes + 17 * node.nbytes + (1 << 16))
    for leaf in graph.leafs:
        arena.place(leaf, from_float(leaf.dtype.name, feeds[leaf]))
    for n in graph.nodes:
        arena.place(n, None)
    launches = mmq.mmq_specs(node, arena.ptr, arena.scratch, cfg)
    assert [s.kernel.split("<")[0] for s in launches] == ["quantize_q8_1", "mmq"]
    mem = run_specs(emulator, arena, launches, eager, tmp_path)
    at = arena.ptr(node)
    got = mem[at:at + node.nbytes].view(np.float32).reshape(node.shape)
    args = launches[1].args
    what = "; ".join(f"{s.kernel} grid {s.grid} block {s.block} smem {s.smem}" for s in launches)
    what += f"; splits {args.splits}"
    if args.splits > 1:
        at, nbytes = arena.roles["mmq split counters"]
        assert not mem[at:at + nbytes].any(), f"{what}: split counters not back to zero"
    return got, what


@pytest.mark.parametrize("case", list(CASES))
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


def test_splits_stay_within_k() -> None:
    """Every slice of a launch holds two K tiles at least, or the launch has one slice."""
    for _, cfg in (*mmq.TABLE, *mmq.TABLE_K):
        for k in (32, 256, 512, 2048, 14336):
            nkt = -(-k // 32 // cfg.kb)
            s = mmq.mmq_splits(cfg, k)
            assert 1 <= s <= cfg.splits and (s == 1 or nkt // s >= 2)
