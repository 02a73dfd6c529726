"""cuda_matmul's two-launch mat-vecs run on the CPU: mmv (f32 / f16 / bf16 weights, the float batch-1..8
products) and mmvq with quantize_q8_1 before it (the legacy formats' rows that are not whole chunks, where
mmvq_stream does not run), their real sources compiled by g++ against the host emulation of CUDA
(tests/cuda_emu/shim.h), on the launch specs the plugin binds (specs/mmv.py's mmv_specs).

The cases cross the kernels' paths: 16-byte loads of a and b (vec) and element loads (b transposed or f16 / bf16
b), 1 to 8 columns, row tails, broadcast batches, and the epilogues: a bias row, a residual addend and a gate/up
GLU pair (fused groups, fusion.py's). Outputs start poisoned (0xFF), so an output left unwritten shows; results
are compared with the numpy reference by NMSE (mul_mat's bound for the weight type, twice it for a GLU's two
products). On the H200 the same kernels run in test_cuda_matmul.py.

Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.graph import Graph
from opdispatch.plugins.cuda_matmul import fusion, specs
from opdispatch.plugins.cuda_matmul.specs import mmv
from opdispatch.tensor import Tensor
from opdispatch.testing.cases.base import bound
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import ScratchArena, fed_arena, gxx_major, run_launches
from helpers import biased, gate_up_glu, residual
from test_mmq_emulated import build_emulator

VIEWS = ("view", "reshape", "permute", "transpose")

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")


def _mm(dt: str, m: int, k: int, n: int, tb: str = "f32", batch: tuple = (), a_batch: tuple | None = None,
        transposed: bool = False) -> Tensor:
    a = od.input("a", (*(batch if a_batch is None else a_batch), m, k), dt)
    b = od.input("x", (*batch, k, n), tb).transpose() if transposed else od.input("x", (*batch, n, k), tb)
    return ops.mul_mat(a, b)


#: name: graph (the kernel it reaches in the name)
CASES: dict[str, Callable[[], Tensor]] = {
    "mmv bf16 N1 vec, row tail": lambda: _mm("bf16", 37, 256, 1),
    "mmv f16 N5 vec": lambda: _mm("f16", 20, 96, 5),
    "mmv f32 N8 broadcast batches": lambda: _mm("f32", 11, 64, 8, batch=(2, 3), a_batch=(1, 3)),
    "mmv f16 N3 b transposed (element loads)": lambda: _mm("f16", 13, 40, 3, transposed=True),
    "mmv bf16 N2 b bf16": lambda: _mm("bf16", 9, 72, 2, tb="bf16"),
    "mmv f16 N4 K not a multiple of 4 (element loads)": lambda: _mm("f16", 17, 50, 4),
    "mmv bf16 bias N3": lambda: biased("bf16", 30, 128, 3),
    "mmv f16 residual N2 padded rows": lambda: residual("f16", 21, 64, 2, batch=(2,), pad=3),
    "mmv f16 glu N1 swiglu": lambda: gate_up_glu("f16", 24, 128, 1, False, "swiglu"),
    "mmvq q4_0 N1 K96 (three blocks)": lambda: _mm("q4_0", 29, 96, 1),
    "mmvq q8_0 N3 K160 bias": lambda: biased("q8_0", 33, 160, 3),
    "mmvq q5_1 N6 K96 batches": lambda: _mm("q5_1", 19, 96, 6, batch=(2,)),
    "mmvq q4_1 glu N2 geglu K96": lambda: gate_up_glu("q4_1", 26, 96, 2, True, "geglu"),
}


def _nodes(y: Tensor) -> list[Tensor]:
    return [n for n in Graph.build(y).nodes if n.op not in VIEWS]


def _specs(y: Tensor, arena: ScratchArena) -> list[KernelSpec]:
    """The launches the plugin binds for `y` (a mul_mat, or a fused group of fusion.PATTERNS) on the H200's
    description: quantize_q8_1 and mmvq for the block formats, mmv for the float ones."""
    nodes = _nodes(y)
    if len(nodes) > 1:
        assert fusion.check(None, nodes, Graph.build(y)) is True
    prods, biases, glu = fusion.parts(nodes)
    return mmv.mmv_specs(prods[0], nodes[-1], arena.ptr, arena.scratch, a1=prods[1].srcs[0] if glu else None,
                         bias0=biases[0], bias1=biases[1] if glu else None,
                         bias_col=fusion.bias_col(prods[0], biases[0]), glu=glu)



@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arity = {}
    for make in CASES.values():
        y = make()
        arity |= {s.kernel: len(s.arg_values) for s in _specs(y, fed_arena(y))}
    return build_emulator(tmp_path_factory.mktemp("mmv_emu"), ("mmv.cu",), arity)


@pytest.mark.parametrize("case", list(CASES))
def test_mmv_emulated(case: str, emulator: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    y = CASES[case]()
    graph = Graph.build(y)
    feeds = {t: rng.uniform(-1, 1, t.shape).astype(np.float32) for t in graph.inputs}
    (ref,) = od.compile(y, "cpu").run(feeds)
    arena = fed_arena(y, feeds)
    launches = _specs(y, arena)
    kernel = case.split()[0]
    assert [s.kernel.split("<")[0] for s in launches] == (["quantize_q8_1", "mmvq"] if kernel == "mmvq" else ["mmv"])
    mem = run_launches(launches, arena, False, emulator, tmp_path)
    got = arena.bytes_of(y, mem)[:y.nbytes].view(np.float32).reshape(y.shape)
    (first, *_), _, glu = fusion.parts(_nodes(y))
    limit = bound("mul_mat", weight=first.srcs[0].dtype.name) * (2 if glu is not None else 1)
    what = f"{case}: {launches[-1].kernel} grid {launches[-1].grid}"
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten?)"
    assert nmse(got, ref) <= limit, f"{what}: NMSE {nmse(got, ref):.3g}"


def test_cases_cover_the_kernels() -> None:
    """The cases reach mmv's vector and element loads, one and several column tiles' worth of columns, each
    epilogue, and mmvq for a legacy format's rows of whole blocks that are not whole chunks."""
    seen = set()
    for make in CASES.values():
        y = make()
        spec = _specs(y, fed_arena(y))[-1]
        seen.add(spec.kernel.split("<")[0] + " " + spec.kernel.split(", ")[-1].rstrip(">"))
        if spec.kernel.startswith("mmv<"):
            seen.add("vec" if ", true, " in spec.kernel else "element")
    assert {"vec", "element", f"mmv {specs.EPI_NONE}", f"mmv {specs.EPI_BIAS}", f"mmv {specs.EPI_GLU}",
            f"mmvq {specs.EPI_NONE}", f"mmvq {specs.EPI_BIAS}", f"mmvq {specs.EPI_GLU}"} <= seen, seen
