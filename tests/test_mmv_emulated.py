"""cuda_matmul's float mat-vec (mmv.cu's mmv) run on the CPU with a fused rms_norm (the rms_norm_mul_mat groups on
float weights): its real source, compiled by g++ against the host emulation of CUDA (tests/cuda_emu, with
test_mmq_emulated.py's build), on the launch the plugin binds.

The kernel reads x, multiplies each value by the norm weight, sums x^2 per column and scales each column's
products by rsqrt(mean + eps) before the epilogue: against the CPU reference (the norm, the mul and the product
run apart, on the same rounded weights) only float rounding differs, so the bound is NMSE 1e-9, not mul_mat's.
Outputs start poisoned (0xFF: NaN), so an output left unwritten shows. A plain mat-vec (no norm) runs too, the
same instances' other branch. On the H200 the same groups run in test_cuda_matmul_norm.py.

Skipped without g++ 12 or newer (C++20 <barrier>, _Float16).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.devices import H200
from opdispatch.dtypes import from_float, to_host_float
from opdispatch.graph import Graph
from opdispatch.plugins.cuda_matmul import fusion
from opdispatch.plugins.cuda_matmul.specs import mmv
from opdispatch.tensor import Tensor
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import ScratchArena, gxx_major
from helpers import FakeGuard
from test_cuda_matmul import fake_ptr, fake_scratch
from test_cuda_matmul_norm import normed
from test_mmq_emulated import build_emulator, run_launches

NMSE_ROUNDING = 1e-9  # the kernel and the reference differ by f32 rounding only

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20 <barrier>, _Float16)")

#: name: graph; M odd (the last tile's second row past M), K over one unit a thread and not a multiple of the
#: block's units (threads with one unit more), every column count
CASES = {
    "bf16 N1 M37": lambda: normed("bf16", 37, 256, 1),
    "f16 N3 K2056 (a partial round of units)": lambda: normed("f16", 11, 2056, 3),
    "f32 N8 K1024": lambda: normed("f32", 9, 1024, 8),
    "bf16 N5 (NT 8, columns past N)": lambda: normed("bf16", 6, 512, 5),
    "glu bf16 N2": lambda: normed("bf16", 13, 2048, 2, glu=True),
    "glu f16 N8": lambda: normed("f16", 5, 1032, 8, glu=True),
    "no norm bf16 N3": lambda: ops.mul_mat(od.input("w", (13, 512), "bf16"), od.input("x", (3, 512))),
}


def _specs(y: Tensor, ptr, scratch) -> list:  # noqa: ANN001
    nodes = list(Graph.build(y).nodes)
    if len(nodes) == 1:
        return mmv.mmv_specs(nodes[0], nodes[0], ptr, scratch, device=H200)
    assert fusion.check(H200, nodes, Graph.build(y)) is True
    return mmv.fused_specs(nodes, ptr, scratch, FakeGuard(), H200)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arity = {s.kernel: len(s.arg_values) for make in CASES.values() for s in _specs(make(), fake_ptr, fake_scratch)}
    return build_emulator(tmp_path_factory.mktemp("mmv_emu"), ("mmv.cu",), arity)


@pytest.mark.parametrize("case", list(CASES))
def test_mmv_emulated(case: str, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    y = CASES[case]()
    graph = Graph.build(y)
    # random weights rounded to their type first, so that the reference reads what the kernel reads
    feeds = {t: to_host_float(t.dtype.name, from_float(t.dtype.name, rng.uniform(-1, 1, t.shape).astype(np.float32)))
             for t in graph.inputs}
    arena = ScratchArena(sum(t.base.nbytes + 256 for t in (*graph.leafs, *graph.nodes)) + (1 << 16))
    for leaf in graph.leafs:
        arena.place(leaf, from_float(leaf.dtype.name, feeds[leaf]))
    for n in graph.nodes:
        arena.place(n, None)
    (spec,) = _specs(y, arena.ptr, arena.scratch)
    norm = fusion.norm_of(list(graph.nodes))
    assert (int(spec.args.norm_w) != 0) == (norm is not None) and "true" in spec.kernel, spec.kernel
    mem = run_launches([spec], arena, False, emulator, tmp_path)
    at = arena.ptr(y)
    got = mem[at:at + y.nbytes].view(np.float32).reshape(y.shape)
    (ref,) = od.compile(y, "cpu").run(feeds)
    assert np.isfinite(got).all(), f"{case}: {spec.kernel}: non-finite outputs (unwritten?)"
    err = nmse(got.astype(np.float64), ref.astype(np.float64))
    assert err <= NMSE_ROUNDING, f"{case}: {spec.kernel}: NMSE {err:.3g}"
