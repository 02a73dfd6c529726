"""cuda_attention's prefill attention, on mma.sync (fattn_prefill.cu) and on Hopper's wgmma (fattn_prefill_wgmma.cu),
with the mask tile flags its plan computes first (fattn_mask.cu), run on the CPU: their real sources compiled by g++
against the host emulation of CUDA (tests/cuda_emu/shim.h: ldmatrix and mma.sync as warp collectives, wgmma as a
warpgroup's, computed at the wait that retires it), on the launch specs the plugin binds for a GPU without wgmma
and for the H200. Each case runs with cp.async copies landing at the wait_group that covers them (lazy: a K/V stage
read before its wait shows) and at issue (eager: a copy into a stage still being read shows).

Outputs and shared memory start poisoned (0xFF), so an output row left unwritten, or a tile read before it
landed, shows; results are compared with the numpy reference by NMSE (flash_attn_ext's bound). The cases cross
the kernel's edges: query rows past a tile (tq not a multiple of 128), a last key tile cut short, key tiles the
flags skip (causal), mixed and mask-free, GQA, sinks, ALiBi and softcap, f16, bf16 and q8_0 K/V. On the H200
the same kernels run in test_cuda_attention.py.

Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import opdispatch as od
from opdispatch.backends.cuda.devices import H200, facts
from opdispatch.graph import Graph
from opdispatch.hookspecs import Device
from opdispatch.plugins.cuda_attention.specs import flash
from opdispatch.tensor import Tensor
from opdispatch.testing.cases import Inputs, bound
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import ScratchArena, call, fed_arena, gxx_major, kernel_emulator, run_launches, write_headers
from test_cuda_attention import fa_graph
from test_fattn_decode_emulated import SHARED, host_attn_common


#: a GPU without wgmma (compute capability 8.0), so that every head size and K/V type takes fattn_prefill
DEVICE = facts(Device("cuda0", "cuda", "an emulated sm_80 GPU of 2 SMs", {**H200.props, "cc": (8, 0), "sm_count": 2}))
#: the H200's description: D 64 and 128 with f16 / bf16 K/V take fattn_prefill_wgmma
HOPPER = facts(H200)
#: prefill_common.cuh's 2^x on the MUFU unit (flushing denormal results to zero), as the host computes it
EX2 = (re.compile(r'asm\("ex2\.approx\.ftz\.f32 %0, %1;" : "=f"\(y\) : "f"\(x\)\);'),
       "y = exp2f(x); if (std::fpclassify(y) == FP_SUBNORMAL) y = 0.0f;")

#: fattn_prefill_wgmma's dynamic shared memory, the emulated block's
WGMMA_SHARED = ("extern __shared__ uint4 smem_u4[];", "uint4* smem_u4 = reinterpret_cast<uint4*>(emu_ctx->smem);")

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")

#: name: fa_graph's arguments (on DEVICE: 128 query rows a block, key tiles of 64, or 64 and 32 above D 128)
CASES: dict[str, dict] = {
    "d=64 f16 causal, q tail, kv tail": dict(d=64, tq=150, tk=200, hq=4, hkv=2, mask="causal"),
    "d=64 f16 gqa 4 random mask, sinks": dict(d=64, tq=40, tk=130, hq=8, hkv=2, mask="random", sinks=True),
    "d=128 bf16 no mask": dict(d=128, tq=33, tk=96, hq=2, hkv=1, kv="bf16"),
    "d=128 q8_0 causal, ALiBi": dict(d=128, tq=70, tk=150, hq=4, hkv=4, kv="q8_0", mask="causal", max_bias=8.0),
    "d=64 f16 softcap, mask per head": dict(d=64, tq=20, tk=64, hq=2, hkv=1, mask="random", softcap=20.0,
                                            mask_shape=(1, 2, 32, 64)),
    "d=256 f16 causal (64-row tiles)": dict(d=256, tq=80, tk=100, hq=2, hkv=1, mask="causal"),
}
#: name: fa_graph's arguments, on HOPPER (fattn_prefill_wgmma: one warpgroup of 64 query rows and key tiles of 64 at
#: D 64, two warpgroups and key tiles of 128 at D 128)
WGMMA_CASES: dict[str, dict] = {
    "wgmma d=64 f16 causal, q tail, kv tail": dict(d=64, tq=100, tk=150, hq=4, hkv=2, mask="causal"),
    "wgmma d=128 bf16 gqa 4 random mask, sinks": dict(d=128, tq=40, tk=200, hq=8, hkv=2, kv="bf16", mask="random",
                                                       sinks=True),
    "wgmma d=64 bf16 no mask, softcap": dict(d=64, tq=70, tk=64, hq=2, hkv=1, kv="bf16", softcap=20.0),
}


def _kernel(kw: dict, wgmma: bool) -> str:
    return flash.prefill_kernel(kw["d"], kw.get("kv", "f16"), wgmma)


def _launches(y: Tensor, arena: ScratchArena, wgmma: bool) -> list:
    """The launches the plugin binds for flash_attn_ext `y` on HOPPER (wgmma) or DEVICE: the mask's tile flags (with
    a mask), then the prefill kernel."""
    plan = flash.flash_plan(y, HOPPER if wgmma else DEVICE)
    assert plan.kind == "prefill"
    ws = [arena.scratch(w.what, w.nbytes, w.zeroed) for w in plan.workspaces]
    specs = plan.specs(arena.ptr, ws, arena.guard)
    assert specs[-1].kernel == flash.prefill_kernel(y.srcs[0].shape[-1], y.srcs[1].dtype.name, wgmma)
    return specs



@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fattn_mask.cu, fattn_prefill.cu and fattn_prefill_wgmma.cu with their headers, host-ready, built with a call for
    every instance the cases launch."""
    build = tmp_path_factory.mktemp("fattn_prefill_emu")
    write_headers(build)
    (build / "attn_common.cuh").write_text(host_attn_common())
    prefill = flash.PREFILL_CU.with_name("prefill_common.cuh").read_text()
    prefill, n = EX2[0].subn(EX2[1], prefill)
    assert n == 1, "prefill_common.cuh's ex2.approx changed: update the emulation's swap"
    assert "asm" not in prefill, "prefill_common.cuh has inline PTX the emulation does not replace"
    (build / "prefill_common.cuh").write_text(prefill)
    kernel = flash.PREFILL_CU.read_text()
    assert SHARED[0] in kernel and "asm" not in kernel
    wgmma = flash.PREFILL_WGMMA_CU.read_text()
    assert WGMMA_SHARED[0] in wgmma and "asm" not in wgmma
    arity = {flash.MASK_FLAGS: len(flash.MaskFlagsArgs.names())}
    for kw, on in [*((kw, False) for kw in CASES.values()), *((kw, True) for kw in WGMMA_CASES.values())]:
        arity[_kernel(kw, on)] = len(flash.PrefillArgs.names())
    return kernel_emulator(build, flash.MASK_CU.read_text() + kernel.replace(*SHARED) + wgmma.replace(*WGMMA_SHARED),
                           "".join(call(name, n) for name, n in sorted(arity.items())))


@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
@pytest.mark.parametrize("case", [*CASES, *WGMMA_CASES])
def test_fattn_prefill_emulated(case: str, eager: bool, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    inp = Inputs(rng)
    wgmma = case in WGMMA_CASES
    y = fa_graph(inp, **(WGMMA_CASES if wgmma else CASES)[case])
    feeds = {t: inp.feeds[t] for t in Graph.build(y).leafs}
    (ref,) = od.compile(y, "cpu").run(feeds)
    arena = fed_arena(y, feeds)
    launches = _launches(y, arena, wgmma)
    mem = run_launches(launches, arena, eager, emulator, tmp_path)
    got = arena.bytes_of(y, mem)[:y.nbytes].view(np.float32).reshape(y.shape)
    what = f"{case}: {launches[-1].kernel} grid {launches[-1].grid}"
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten, or a tile read before it landed)"
    assert nmse(got, ref) <= bound("flash_attn_ext"), f"{what}: NMSE {nmse(got, ref):.3g}"


def test_cases_cover_the_kernels() -> None:
    """The cases reach, on each kernel, a mask (its flags launched first) and none, query rows and keys past a tile,
    every tile shape (fattn_prefill's two, fattn_prefill_wgmma's one and two warpgroups) and GQA; on fattn_prefill
    every flag: key tiles skipped (all -inf), mixed, and all zero."""
    seen = set()
    for wgmma, cases in ((False, CASES), (True, WGMMA_CASES)):
        for kw in cases.values():
            y = fa_graph(Inputs(np.random.default_rng(0)), **kw)
            launches = _launches(y, fed_arena(y), wgmma)
            q, k = y.srcs[0], y.srcs[1]
            bm, bn = flash.prefill_tile_m(kw["d"], wgmma), flash.prefill_tile_n(kw["d"], wgmma)
            seen |= {(wgmma, "mask", len(launches) == 2), (wgmma, "q tail", kw["tq"] % bm != 0),
                     (wgmma, "kv tail", kw["tk"] % bn != 0), (wgmma, "tile", bm, bn),
                     (wgmma, "gqa", q.shape[1] > k.shape[1])}
            if kw.get("mask") == "causal" and not wgmma:
                m = np.where(np.arange(kw["tk"])[None, :] > np.arange(kw["tq"])[:, None] + kw["tk"] - kw["tq"], 1, 0)
                tiles = [m[i:i + bm, j:j + bn] for i in range(0, kw["tq"], bm) for j in range(0, kw["tk"], bn)]
                seen |= {("flag", 0 if t.all() else 2 if not t.any() else 1) for t in tiles}
    want = {("flag", 0), ("flag", 1), ("flag", 2), (False, "tile", 128, 64), (False, "tile", 64, 32),
            (True, "tile", 64, 64), (True, "tile", 128, 128)}
    for wgmma in (False, True):
        want |= {(wgmma, "mask", True), (wgmma, "mask", False), (wgmma, "q tail", True), (wgmma, "kv tail", True),
                 (wgmma, "gqa", True)}
    assert want <= seen, want - seen
