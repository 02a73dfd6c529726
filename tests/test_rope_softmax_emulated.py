"""cuda_attention's soft_max (kernels/softmax.cu) and rope (kernels/rope.cu, the unfused kernel) run on the CPU: their
real sources compiled by g++ against the host emulation of CUDA (tests/cuda_emu/shim.h), on the launch specs the
plugin binds (specs/softmax.py's softmax_specs, specs/rope.py's rope_specs).

The cases cross the kernels' paths: soft_max with and without a mask (f16 and f32, broadcast over heads and
batches), ALiBi, sinks, float4 and element rows, rows kept in registers and rows too long for them (two passes);
rope in normal and neox modes, f32 and f16, all dimensions rotated or the first n_dims, frequency factors and YaRN,
chunked lanes and pairs. Outputs start poisoned (0xFF), so an element left unwritten shows; results are compared
with the numpy reference by NMSE (each op's bound). On the H200 the same kernels run in test_cuda_attention.py.

Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.devices import H200, facts
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.dtypes import to_host_float
from opdispatch.graph import Graph
from opdispatch.plugins.cuda_attention.specs import rope, softmax
from opdispatch.tensor import Tensor
from opdispatch.testing.cases import bound
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import (ScratchArena, call, fed_arena, gxx_major, host_ready, kernel_emulator,
                              run_launches, write_headers)
from test_fattn_decode_emulated import host_attn_common

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")


def _soft_max(shape: tuple, mask: str | None = None, mask_shape: tuple | None = None, max_bias: float = 0.0,
              sinks: bool = False) -> Tensor:
    m = od.input("m", mask_shape or (1, 1, shape[2], shape[3]), mask) if mask else None
    return ops.soft_max(od.input("a", shape), m, 0.125, max_bias, od.input("s", (shape[1],)) if sinks else None)


def _rope(shape: tuple, dt: str, n_dims: int, mode: str, ff: bool = False, yarn: bool = False) -> Tensor:
    kw = dict(ext_factor=1.0, n_ctx_orig=4096, freq_scale=0.5) if yarn else {}
    return ops.rope(od.input("x", shape, dt), od.input("p", (shape[1],), "i32"), n_dims, mode,
                    freq_factors=od.input("ff", (n_dims // 2,)) if ff else None, **kw)


#: name: graph
CASES: dict[str, Callable[[], Tensor]] = {
    "soft_max f16 mask over heads, ALiBi, sinks": lambda: _soft_max((2, 4, 7, 36), "f16", (1, 4, 16, 36), 8.0, True),
    "soft_max no mask, rows of 33 (element loads)": lambda: _soft_max((1, 2, 5, 33)),
    "soft_max f32 mask, 3000 columns": lambda: _soft_max((1, 1, 3, 3000), "f32"),
    "soft_max f16 mask, 9000 columns (two passes)": lambda: _soft_max((1, 1, 2, 9000), "f16"),
    "rope neox f16 32 of 64 dims, ff, YaRN": lambda: _rope((1, 5, 4, 64), "f16", 32, "neox", ff=True, yarn=True),
    "rope normal f32 all 128 dims": lambda: _rope((1, 3, 6, 128), "f32", 128, "normal"),
    "rope neox f32 64 dims, 2 batches": lambda: _rope((2, 4, 3, 64), "f32", 64, "neox", ff=True),
    "rope normal f16 24 of 80 dims": lambda: _rope((1, 7, 2, 80), "f16", 24, "normal"),
}


def _spec(y: Tensor, arena: ScratchArena) -> KernelSpec:
    if y.op == "soft_max":
        (spec,) = softmax.softmax_specs(y, arena.ptr)
    else:
        (spec,) = rope.rope_specs(y, arena.ptr, facts(H200))
    return spec


def _feeds(y: Tensor, rng: np.random.Generator) -> dict[Tensor, np.ndarray]:
    """Random inputs: positions in [0, 4096), masks of 0 or -inf in places, the rest floats in [-2, 2)."""
    feeds = {}
    for t in Graph.build(y).inputs:
        if t.dtype.is_int:
            feeds[t] = rng.integers(0, 4096, t.shape).astype(np.int32)
        elif t.name == "m":
            feeds[t] = np.where(rng.random(t.shape) < 0.2, -np.inf, rng.uniform(-1, 0, t.shape)).astype(np.float32)
        elif t.name == "ff":
            feeds[t] = rng.uniform(0.9, 1.1, t.shape).astype(np.float32)
        else:
            feeds[t] = rng.uniform(-2, 2, t.shape).astype(np.float32)
    return feeds


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """softmax.cu and rope.cu with their headers, host-ready, built with a call for every instance the cases
    launch."""
    build = tmp_path_factory.mktemp("rope_softmax_emu")
    write_headers(build)
    (build / "attn_common.cuh").write_text(host_attn_common())
    (build / "rope_common.cuh").write_text(host_ready(rope.ROPE_CU.with_name("rope_common.cuh")))
    sources = [host_ready(softmax.SOFTMAX_CU), host_ready(rope.ROPE_CU)]
    arity = {}
    for make in CASES.values():
        y = make()
        spec = _spec(y, fed_arena(y))
        arity[spec.kernel] = len(spec.arg_values)
    return kernel_emulator(build, "".join(sources), "".join(call(name, n) for name, n in sorted(arity.items())))


@pytest.mark.parametrize("case", list(CASES))
def test_rope_softmax_emulated(case: str, emulator: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    y = CASES[case]()
    feeds = _feeds(y, rng)
    (ref,) = od.compile(y, "cpu").run(feeds)
    arena = fed_arena(y, feeds)
    spec = _spec(y, arena)
    mem = run_launches([spec], arena, False, emulator, tmp_path)
    got = to_host_float(y.dtype.name, arena.bytes_of(y, mem)[:y.nbytes].view(y.dtype.numpy)).reshape(y.shape)
    what = f"{case}: {spec.kernel} grid {spec.grid} block {spec.block}"
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten?)"
    assert nmse(got, ref) <= bound(y.op), f"{what}: NMSE {nmse(got, ref):.3g}"
