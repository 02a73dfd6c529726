"""cuda_attention's split-K decode attention (fattn_decode.cu), alone and fused with the decode step's q/k/v
rope and cache writes, run on the CPU: its real source compiled by g++ against the host emulation of CUDA
(tests/cuda_emu/shim.h: ldmatrix and mma.sync as warp collectives), on the launch specs the plugin binds.
Each case runs with cp.async copies landing at the wait_group that covers them (lazy: a stage read before its
wait shows) and at issue (eager: a copy into a stage still being read, such as the last one while it holds
the fused kernel's rotated q, shows).

Outputs and shared memory start poisoned (0xFF), so that a mask value read from a slot nothing copied
(the mask travels in the K/V stages' row padding: the kernel's header), an output left unwritten or a tile
read before it landed (the first copies go before the PDL wait) shows; results are compared with the numpy
reference by NMSE (flash_attn_ext's bound; fused, also the caches by set_rows' bound), and the split
counters must be back to 0. On the H200 the same kernels run in test_cuda_attention.py.

Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import opdispatch as od
from opdispatch.backends.cuda.devices import H200, facts
from opdispatch.dtypes import to_host_float
from opdispatch.graph import Graph
from opdispatch.hookspecs import Device
from opdispatch.plugins.cuda_attention import fusion
from opdispatch.plugins.cuda_attention.specs import flash
from opdispatch.tensor import Tensor
from opdispatch.testing.cases import Inputs, bound
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import (ScratchArena, call, fed_arena, gxx_major, host_ready, kernel_emulator,
                              run_launches, write_headers)
from test_cuda_attention import attn_step, fa_graph


#: a small GPU (2 SMs), so that a split streams several tiles through the stages (3 at D = 64)
DEVICE = facts(Device("cuda0", "cuda", "an emulated sm_90 GPU of 2 SMs", {**H200.props, "sm_count": 2}))
#: attn_common.cuh's inline PTX and its host emulation (shim.h)
SWAPS = (
    (re.compile(r'asm volatile\(\s*"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32 .*?\);', re.S),
     "emu_mma_m16n8k16_bf16(d, a[0], a[1], a[2], a[3], b0, b1);"),
    (re.compile(r'asm volatile\(\s*"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32 .*?\);', re.S),
     "emu_mma_m16n8k16_f16(d, a[0], a[1], a[2], a[3], b0, b1);"),
    (re.compile(r'asm\("cvt\.rn\.bf16x2\.f32 .*?\);'),
     "r = od::f32_to_bf16(lo) | (unsigned)od::f32_to_bf16(hi) << 16;"),
    (re.compile(r'asm\("cvt\.rn\.f16x2\.f32 .*?\);'), "r = od::f32_to_f16(lo) | (unsigned)od::f32_to_f16(hi) << 16;"),
    (re.compile(r'asm volatile\("st\.shared\.v4\.b32 .*?\);'),
     "const unsigned w[4] = {a, b, c, d}; memcpy(emu_ctx->smem + saddr, w, 16);"),
)
SHARED = ("extern __shared__ __align__(16) unsigned short smem[];",
          "unsigned short* smem = reinterpret_cast<unsigned short*>(emu_ctx->smem);")


def host_attn_common() -> str:
    """attn_common.cuh with its inline PTX swapped for shim.h's host emulation (SWAPS), each swap asserted."""
    src = flash.DECODE_CU.with_name("attn_common.cuh").read_text()
    for ptx, host in SWAPS:
        src, n = ptx.subn(host, src)
        assert n == 1, f"attn_common.cuh changed: update the emulation's swap of {ptx.pattern[:50]}"
    assert "asm" not in src, "attn_common.cuh has inline PTX the emulation does not replace"
    return src

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")


def _unfused(**kw: object) -> Callable[[Inputs], list[Tensor]]:
    return lambda inp: [fa_graph(inp, **kw)]


def _fused(**kw: object) -> Callable[[Inputs], list[Tensor]]:
    return lambda inp: attn_step(inp, **kw)


#: name: graph from random inputs (on DEVICE: splits of several tiles, the last one partial)
CASES: dict[str, Callable[[Inputs], list[Tensor]]] = {
    "d=64 gqa 4 kv=700 mask batch 2": _unfused(d=64, tq=1, tk=700, hq=8, hkv=2, mask="random", batch=2),
    "d=64 kv=300 no mask sinks": _unfused(d=64, tq=1, tk=300, hq=4, hkv=1, sinks=True),
    "d=128 bf16 q=3 gqa 4 mask per batch and head": _unfused(d=128, tq=3, tk=333, hq=8, hkv=2, kv="bf16",
                                                            mask="random", batch=2, mask_shape=(2, 8, 16, 333)),
    "d=64 misaligned mask rows (kv=100: 200-byte rows)": _unfused(d=64, tq=1, tk=100, hq=4, hkv=2, mask="random"),
    "d=64 q8_0 kv=200 mask": _unfused(d=64, tq=2, tk=200, hq=8, hkv=1, kv="q8_0", mask="random"),
    "fused neox f16 i64 3 sequences": _fused(cache="f16", idx="i64", mode="neox", seqs=3, ctx=320),
    "fused neox f16 i32 1 sequence, splits": _fused(cache="f16", idx="i32", mode="neox", seqs=1, heads=16,
                                                    kv_heads=2, ctx=700),
    "fused normal f32 i32 d=128 2 sequences": _fused(cache="f32", idx="i32", mode="normal", seqs=2, d=128,
                                                     ctx=200),
    "fused normal f16 i32 16 sequences": _fused(cache="f16", idx="i32", mode="normal", seqs=16, ctx=200),
}


def _launch(outputs: list[Tensor], arena: ScratchArena):  # noqa: ANN202
    """The one fattn_decode launch the plugin binds for `outputs` on DEVICE."""
    graph = Graph.build(outputs)
    fa = next(n for n in graph.nodes if n.op == "flash_attn_ext")
    fused = None
    if len(outputs) > 1:  # attn_step's graph (attention and caches): the group the fusion rule takes
        (group,) = od.compile(outputs, H200).fusions
        assert group.kernel == "rope_qkv_flash_attn_ext"
        fused = fusion.fused_qkv(group.nodes)
    plan = flash.flash_plan(fa, DEVICE, fused)
    assert plan.kind == "decode"
    ws = [arena.scratch(w.what, w.nbytes, w.zeroed) for w in plan.workspaces]
    (spec,) = plan.specs(arena.ptr, ws, arena.guard)
    return spec, fa, fused


def _all_launches() -> list:
    """Every case's launch, for the emulator's instance table."""
    specs = []
    for make in CASES.values():
        outputs = make(Inputs(np.random.default_rng(0)))
        specs.append(_launch(outputs, fed_arena(outputs))[0])
    return specs



def _spelled(name: str) -> str:
    """An unfused instance's name with its defaulted ROPE and IT spelled out."""
    return name if name.count(",") > 1 else name[:-1] + ", 0, int>"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fattn_decode.cu and its headers, host-ready, built with a call for every instance the cases launch."""
    build = tmp_path_factory.mktemp("fattn_emu")
    write_headers(build)
    (build / "attn_common.cuh").write_text(host_attn_common())
    (build / "rope_common.cuh").write_text(host_ready(flash.DECODE_CU.with_name("rope_common.cuh")))
    kernel = flash.DECODE_CU.read_text()
    assert SHARED[0] in kernel and "asm" not in kernel
    arity = {s.kernel: len(s.arg_values) for s in _all_launches()}
    # the table's names as specs give them, each calling the instance with every template argument spelled
    # (g++ would deduce IT from the Arg given for new_idx)
    table = "".join(call(n, arity[n]).replace(f"{{ {n}(", f"{{ {_spelled(n)}(") for n in sorted(arity))
    return kernel_emulator(build, kernel.replace(*SHARED), table)


def _emulate(outputs: list[Tensor], feeds: dict, eager: bool, emulator: Path, tmp_path: Path) -> tuple[list, str]:
    """`outputs` as the emulated launch leaves them (attention, then the caches if fused), and a description."""
    arena = fed_arena(outputs, feeds)
    spec, fa, _ = _launch(outputs, arena)
    mem = run_launches([spec], arena, eager, emulator, tmp_path)
    what = (f"{spec.kernel} grid {spec.grid} chunk {int(spec.args.chunk)} mask_vec {int(spec.args.mask_vec)} "
            f"kv_early {int(spec.args.kv_early)}")
    for role, (at, nbytes) in arena.roles.items():
        if "counters" in role:
            assert not mem[at:at + nbytes].any(), f"{what}: split counters not back to 0"
    got = [arena.bytes_of(fa, mem)[:fa.nbytes].view(np.float32).reshape(fa.shape).copy()]
    for cache in outputs[1:]:
        raw = arena.bytes_of(cache, mem)
        got.append(to_host_float(cache.dtype.name, raw.view(cache.dtype.numpy).reshape(cache.base.shape)))
    return got, what


@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_fattn_decode_emulated(case: str, eager: bool, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    inp = Inputs(rng)
    outputs = CASES[case](inp)
    graph = Graph.build(outputs)
    feeds = {t: inp.feeds[t] for t in graph.leafs if t in inp.feeds}
    ref = od.compile(outputs, "cpu").run(feeds)
    got, what = _emulate(outputs, feeds, eager, emulator, tmp_path)
    assert np.isfinite(got[0]).all(), f"{case}: {what}: non-finite attention (unwritten, or read before it landed)"
    assert nmse(got[0], ref[0]) <= bound("flash_attn_ext"), f"{case}: {what}: NMSE {nmse(got[0], ref[0]):.3g}"
    for cache, out, want in zip(outputs[1:], got[1:], ref[1:]):
        limit = bound("set_rows", cache.dtype.name)
        assert nmse(out, want.reshape(out.shape)) <= limit, f"{case}: {what}: {cache.describe()}"
    if len(outputs) > 1:
        assert int(_launch(outputs, fed_arena(outputs))[0].args.kv_early) == 1


def test_cases_cover_the_kernel() -> None:
    """Unfused and fused, the cases reach one split and several, splits of several tiles (the stages
    wrapping around), mask rows copied by cp.async and by element, and the early K/V copies; fused, splits
    whose tiles refill the last stage (where the rotated q was), and a batch of 16 sequences."""
    seen = set()
    for make in CASES.values():
        outputs = make(Inputs(np.random.default_rng(0)))
        spec = _launch(outputs, fed_arena(outputs))[0]
        a, fused = spec.args, len(outputs) > 1
        seen |= {(fused, "splits" if int(a.ws_acc) else "one split"),
                 ("stages wrap around", int(a.chunk) > 3 * flash.DECODE_BN),
                 ("mask_vec", int(a.mask_vec)), ("kv_early", int(a.kv_early)),
                 ("fused: the last stage refilled", fused and min(int(a.chunk), int(a.tk)) > 2 * flash.DECODE_BN),
                 ("fused: 16 sequences", fused and spec.grid[2] == 16)}
    assert {(False, "splits"), (False, "one split"), (True, "splits"), (True, "one split"), ("stages wrap around", True),
            ("mask_vec", 0), ("mask_vec", 1), ("kv_early", 1), ("kv_early", 0), ("fused: the last stage refilled", True),
            ("fused: 16 sequences", True)} <= seen, seen
