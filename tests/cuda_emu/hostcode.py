"""The shared CUDA headers as host C++ for the emulated tests, and what those tests share.

common.cuh's inline PTX is swapped for shim.h's host functions, each swap asserted, so that an
edit of the PTX fails here by name instead of compiling something else; the other shared headers
(activations.cuh, quant.cuh) hold no PTX and are copied as they are, but wgmma.cuh (sm_90a-only, which no
emulated kernel includes). q8_1_reference is quant.cuh's
q8_1 rounding in numpy float32, which both the header test and the mmvq_stream emulation check.
`Arena` is the emulated device memory the kernel emulations share, with an error word; `ScratchArena` one that
also hands out scratch buffers. `run_launches` runs launch specs on a kernel_main.cpp emulator over an arena's memory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from opdispatch.backends.cuda.args import IndexCheck
from opdispatch.dtypes import from_float
from opdispatch.graph import Graph
from opdispatch.tensor import Tensor

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = ROOT / "core" / "backends" / "cuda"
EMU = Path(__file__).resolve().parent

#: (inline PTX in common.cuh, its host replacement from shim.h)
_SWAPS = (
    ('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));', "f = emu_h2f(h);"),
    ('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));', "h = emu_f2h(f);"),
    ('asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));', "r = a != a || b != b ? NAN : fmaxf(a, b);"),
    ('asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));', "d = emu_prmt(a, b, s);"),
    ('asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));', "d = emu_dp4a_us(a, b, c);"),
    ('asm volatile("griddepcontrol.wait;" ::: "memory");', ""),  # one kernel at a time here
    ('asm volatile("griddepcontrol.launch_dependents;" ::: "memory");', ""),
    ('asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));',
     "a = emu_smem_addr(p);"),
    ('asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" ::"r"(saddr), "l"(src) : "memory");',
     "emu_cp16(saddr, src);"),
    ('asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" ::"r"(saddr), "l"(src), "r"(bytes) : "memory");',
     "emu_cp16z(saddr, src, bytes);"),
    ('asm volatile("cp.async.commit_group;\\n" ::: "memory");', "emu_commit();"),
    ('asm volatile("cp.async.wait_group %0;\\n" ::"n"(N) : "memory");', "emu_wait(N);"),
    # the bulk copies run here too (shim.h's emu_bulk: they land when their barrier's phase completes)
    ("#define OD_BULK 0", "#define OD_BULK 1"),
    ('asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\\n" ::"r"(bar), "r"(count) : "memory");',
     "emu_mbar_init(bar, count);"),
    ('asm volatile("fence.mbarrier_init.release.cluster;\\n" ::: "memory");', ""),
    ('asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\\n" ::"r"(bar), "r"(bytes) : "memory");',
     "emu_mbar_expect_tx(bar, bytes);"),
    ('asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\\n"\n'
     '                 ::"r"(saddr), "l"(src), "r"(bytes), "r"(bar) : "memory");', "emu_bulk(saddr, src, bytes, bar);"),
    ('asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\\n" ::"r"(bar) : "memory");', "emu_mbar_arrive(bar);"),
    ('asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\\n" ::"r"(bar) : "memory");',
     "emu_cp_mbar_arrive(bar);"),
    ('asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");', "emu_named_barrier(THREADS);"),
    ('asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\\n"\n'
     '                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");', "done = emu_mbar_try_wait(bar, parity);"),
    ('asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"\n'
     '                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)\n                 : "r"(addr));',
     "emu_ldsm_x4(addr, r0, r1, r2, r3, false);"),
    ('asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"\n'
     '                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)\n                 : "r"(addr));',
     "emu_ldsm_x4(addr, r0, r1, r2, r3, true);"),
)


def gxx_major() -> int:
    """g++'s major version, 0 without g++."""
    gxx = shutil.which("g++")
    if gxx is None:
        return 0
    out = subprocess.run([gxx, "-dumpversion"], capture_output=True, text=True).stdout.strip()
    return int(out.split(".")[0]) if out.split(".")[0].isdigit() else 0


def host_common() -> str:
    """common.cuh with every inline PTX statement replaced by its host emulation."""
    text = (INCLUDE / "common.cuh").read_text()
    for ptx, host in _SWAPS:
        assert ptx in text, f"common.cuh changed: update the emulation's swap of {ptx}"
        text = text.replace(ptx, host)
    assert "asm" not in text, "common.cuh has inline PTX the emulation does not replace"
    return text


#: wgmma.cuh's inline PTX (whole statements; the products' macro bodies from their asm to its operands) and shim.h's
#: host emulation (the wgmma emulation: products recorded at issue, computed at the wait that retires them)
_WGMMA_SWAPS = (
    ('asm volatile("wgmma.fence.sync.aligned;" ::: "memory");', ""),
    ('asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");', "emu_wg_commit();"),
    ('asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");', "emu_wg_wait(N);"),
    ('asm volatile("fence.proxy.async.shared::cta;" ::: "memory");', ""),  # one memory here
    ('asm volatile("" : "+f"(d[i])::"memory");', "(void)d[i];"),
    ('asm volatile("" : "+r"(f[i][j])::"memory");', "(void)f[i][j];"),
    ('asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %" #IP ", 0;\\n" \\\n'
     '                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" ACC_TXT "}, %" #IA \\\n'
     '                     ", %" #IB ", p, 1, 1, 0, 0;\\n}\\n" \\\n'
     '                     : ACC_OUTS(d) \\\n'
     '                     : "l"(da), "l"(db), "r"(acc));', "emu_wgmma(d, N, BF, nullptr, da, db, 0, acc);"),
    ('asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n" \\\n'
     '                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" ACC_TXT "}, {%" #I0 \\\n'
     '                     ", %" #I1 ", %" #I2 ", %" #I3 "}, %" #IB ", p, 1, 1, " #TB ";\\n}\\n" \\\n'
     '                     : ACC_OUTS(d) \\\n'
     '                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));',
     "emu_wgmma(d, N, BF, a, 0, db, TB, 1);"),
)


def host_wgmma() -> str:
    """wgmma.cuh with its inline PTX replaced by shim.h's wgmma emulation (its comments still say asm)."""
    text = (INCLUDE / "wgmma.cuh").read_text()
    for ptx, host in _WGMMA_SWAPS:
        assert ptx in text, f"wgmma.cuh changed: update the emulation's swap of {ptx[:60]}"
        text = text.replace(ptx, host)
    assert not re.search(r"\basm\s*(volatile\s*)?\(", text), "wgmma.cuh has inline PTX the emulation does not replace"
    return text


def write_headers(build: Path) -> None:
    """The shared headers, host-ready, and shim.h into `build` (to go first on the include path)."""
    for header in INCLUDE.glob("*.cuh"):
        if header.name == "wgmma.cuh":
            (build / header.name).write_text(host_wgmma())
            continue
        text = host_common() if header.name == "common.cuh" else header.read_text()
        assert "asm" not in text, f"{header.name} has inline PTX the emulation does not replace"
        (build / header.name).write_text(text)
    (build / "shim.h").write_text((EMU / "shim.h").read_text())


def host_ready(path: Path) -> str:
    """The text of a kernel source that runs on the host as it is (no inline PTX for the emulation to replace)."""
    text = path.read_text()
    assert "asm" not in text, f"{path.name} has inline PTX the emulation does not replace"
    return text


def compile_emulator(source: Path, exe: Path, opt: str = "-O1") -> Path:
    """`exe`: g++ (C++20, threads) of `source` against the host-ready headers in exe's folder (write_headers), no
    float contraction (each product and add rounded alone, as __fmul_rn / __fadd_rn make nvcc keep them)."""
    cmd = ["g++", "-std=c++20", opt, "-ffp-contract=off", "-pthread", "-w", "-I", str(exe.parent), str(source), "-o",
           str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr[-4000:]}"
    return exe


def call(name: str, nargs: int) -> str:
    """instances.inc's entry for instance `name` of a kernel of nargs parameters."""
    args = ", ".join(f"a[{i}]" for i in range(nargs))
    return f'    {{"{name}", [](const Arg* a) {{ {name}({args}); }}}},\n'


def kernel_emulator(build: Path, kernel: str, instances: str) -> Path:
    """build/emu: kernel_main.cpp running the kernels of `kernel` (host-ready source, written as kernel.cu) by name
    through `instances` (instances.inc's entries), against the headers already in `build` (write_headers', and any
    the caller made host-ready)."""
    (build / "kernel.cu").write_text(kernel)
    (build / "main.cpp").write_text((EMU / "kernel_main.cpp").read_text())
    (build / "instances.inc").write_text(instances)
    return compile_emulator(build / "main.cpp", build / "emu")


def q8_1_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, d) of ggml's q8_1 for each 32 values along the last axis of x (float32 math):
    d = amax / 127, codes rint(v * (127 / amax)), 0 for a block of zeros."""
    v = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(v).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    return np.rint(v * inv.astype(np.float32)).astype(np.int32), d[..., 0]


class Arena:
    """Device memory as one byte array: tensors at 256-byte aligned offsets from 512 (0 is nullptr), and an
    error word (4 u64, zeroed) at 256, which `guard` (a spec's Guard) hands out under tag TAG."""

    TAG = 7

    def __init__(self, nbytes: int) -> None:
        self.mem = np.zeros(nbytes + 512, np.uint8)
        self.word_at = 256
        self.top = 512
        self.where: dict[int, int] = {}

    def place(self, t: Tensor, data: np.ndarray | None) -> None:
        """t's base at the next free offset, holding `data` (raw or typed), or poisoned (0xFF) without."""
        b = t.base
        if b.uid in self.where:
            return
        at = self.where[b.uid] = self.top
        self.top = (self.top + b.nbytes + 255) // 256 * 256
        self.mem[at:at + b.nbytes] = np.ascontiguousarray(data).view(np.uint8).reshape(-1) if data is not None else 0xFF

    def ptr(self, t: Tensor) -> int:
        return self.where[t.base.uid] + t.view_offset

    def bytes_of(self, t: Tensor, mem: np.ndarray | None = None) -> np.ndarray:
        """t's base's bytes in `mem` (the arena's own by default)."""
        at = self.where[t.base.uid]
        return (self.mem if mem is None else mem)[at:at + t.base.nbytes]

    def word(self, mem: np.ndarray | None = None) -> list[int]:
        """The error word in `mem` (the arena's own by default): [tag + 1, position, value, spare], signed."""
        return [int(v) for v in (self.mem if mem is None else mem)[self.word_at:self.word_at + 32].view(np.int64)]

    def guard(self, node: Tensor, index: Tensor, bound: int, what: str, instead: str) -> IndexCheck:
        return IndexCheck(self.word_at, self.TAG)

    def scratch(self, role: str, nbytes: int) -> int:
        raise AssertionError("the emulated kernels take no scratch buffer")


class ScratchArena(Arena):
    """An Arena whose scratch buffers (partial sums, split counters, copies of b) are carved from the same
    memory after the tensors, by role."""

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


def placed_arena(y: Tensor, nbytes: int = 1 << 26) -> ScratchArena:
    """An arena of nbytes holding every tensor of y's graph (no values written)."""
    arena = ScratchArena(nbytes)
    graph = Graph.build(y)
    for t in (*graph.leafs, *graph.nodes):
        arena.place(t, None)
    return arena


def fed_arena(outputs: Tensor | list[Tensor], feeds: dict | None = None, extra: int = 4 << 20) -> ScratchArena:
    """A ScratchArena holding every leaf of `outputs`' graph (its feed as the leaf's type, or a state's own initial
    rows; poisoned without `feeds`) and every node (poisoned), with `extra` bytes for scratch buffers."""
    graph = Graph.build(outputs)
    arena = ScratchArena(sum(t.base.nbytes + 256 for t in (*graph.leafs, *graph.nodes)) + extra)
    for leaf in graph.leafs:
        data = None if feeds is None else from_float(leaf.dtype.name, feeds[leaf]) if leaf in feeds else leaf.data
        arena.place(leaf, data)
    for n in graph.nodes:
        arena.place(n, None)
    return arena


def run_launches(launches: list, arena: ScratchArena, eager: bool, emulator: Path, tmp_path: Path,
                 shuffle: int | None = None, last_first: bool = False, wgmma_at_issue: bool = False) -> np.ndarray:
    """The arena's memory after a kernel_main.cpp emulator ran `launches` (KernelSpecs) in turn on it: each with its
    dynamic shared memory, cp.async copies landing when issued if `eager` (EMU_EAGER), its blocks in a random order
    of seed `shuffle` if given (EMU_SHUFFLE), a block's last threads scheduled first if `last_first`
    (EMU_LAST_FIRST), wgmma products computed at issue if `wgmma_at_issue` (EMU_WGMMA_AT_ISSUE)."""
    mem_file = tmp_path / "mem.bin"
    arena.mem.tofile(mem_file)
    for spec in launches:
        grid = (spec.grid,) if isinstance(spec.grid, int) else tuple(spec.grid)
        grid += (1,) * (3 - len(grid))
        cmd = [str(emulator), str(mem_file), spec.kernel, *map(str, grid), str(spec.block),
               *(str(v.item()) for v in spec.arg_values)]
        env = {**os.environ, "EMU_SMEM": str(spec.smem), "EMU_EAGER": str(int(eager)),
               **({} if shuffle is None else {"EMU_SHUFFLE": str(shuffle)}), "EMU_LAST_FIRST": str(int(last_first)),
               "EMU_WGMMA_AT_ISSUE": str(int(wgmma_at_issue))}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, f"{spec.kernel}: {done.stderr}"
    return np.fromfile(mem_file, np.uint8)
