"""cuda_matmul's mat-vecs outside mmvq_stream run on the CPU: mmv (f32 / f16 / bf16 weights, the float batch-1..8
products) and mmvq with quantize_q8_1 before it (the legacy formats' rows that are not whole chunks, where
mmvq_stream does not run), and the MoE decode's mul_mat_id kernels of mmv_id.cu (mmv_id, mmvq_id at a token's slots;
moe_route then mmv_id_grouped / mmvq_id_grouped for several tokens), their real sources compiled by g++ against the
host emulation of CUDA (tests/cuda_emu/shim.h), on the launch specs the plugin binds (specs/mmv.py's fused_specs).

The cases cross the kernels' paths: 16-byte loads of a and b (vec) and element loads (b transposed or f16 / bf16
b), 1 to 8 columns, row tails, broadcast batches, and the epilogues: a bias row (mul_mat_id: an add_id bias), a
residual addend and a gate/up GLU pair (fused groups, fusion.py's). Outputs start poisoned (0xFF), so an output
left unwritten shows; results are compared with the numpy reference by NMSE (mul_mat's bound for the weight type,
twice it for a GLU's two products), and the error word (common.cuh's od::index_ok) must stay clear after valid
expert ids and name the first bad one, whose rows are NaN, after an id outside the experts. On the H200 the same
kernels run in test_cuda_matmul.py.

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
from helpers import biased, gate_up_glu, moe, residual
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
    "mmv_id f16 1 token 3 of 5 experts": lambda: moe("f16", 5, 24, 64, 1, 3, False, False),
    "mmv_id bf16 1 token glu, biases": lambda: moe("bf16", 4, 20, 96, 1, 2, True, True),
    "mmvq_id q8_0 1 token K96 bias": lambda: moe("q8_0", 6, 33, 96, 1, 2, False, True),
    "mmv_id_grouped f32 5 tokens 2 of 3 experts": lambda: moe("f32", 3, 17, 64, 5, 2, False, False),
    "mmvq_id_grouped q4_0 6 tokens K96 bias": lambda: moe("q4_0", 4, 29, 96, 6, 2, False, True),
}


def _nodes(y: Tensor) -> list[Tensor]:
    return [n for n in Graph.build(y).nodes if n.op not in VIEWS]


def _specs(y: Tensor, arena: ScratchArena) -> list[KernelSpec]:
    """The launches the plugin binds for `y` (a mul_mat or mul_mat_id, or a fused group of fusion.PATTERNS) on the
    H200's description: quantize_q8_1 and mmvq / mmvq_id (moe_route first where grouped) for the block formats,
    mmv / mmv_id (moe_route first where grouped) for the float ones."""
    nodes = _nodes(y)
    if len(nodes) > 1:
        assert fusion.check(None, nodes, Graph.build(y)) is True
    return mmv.fused_specs(nodes, arena.ptr, arena.scratch, arena.guard)


def _feeds(y: Tensor, rng: np.random.Generator) -> dict[Tensor, np.ndarray]:
    """Random inputs: floats in [-1, 1), mul_mat_id's ids valid expert numbers."""
    n_exp = next((n.srcs[0].shape[0] for n in Graph.build(y).nodes if n.op == "mul_mat_id"), 0)
    return {t: rng.integers(0, n_exp, t.shape).astype(np.int32) if t.dtype.is_int else
            rng.uniform(-1, 1, t.shape).astype(np.float32) for t in Graph.build(y).inputs}



@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arity = {}
    for make in CASES.values():
        y = make()
        arity |= {s.kernel: len(s.arg_values) for s in _specs(y, fed_arena(y))}
    return build_emulator(tmp_path_factory.mktemp("mmv_emu"), ("mmv.cu", "mmv_id.cu"), arity)


#: the launches each kernel of the cases' names takes, in order
LAUNCHES = {"mmv": ["mmv"], "mmvq": ["quantize_q8_1", "mmvq"], "mmv_id": ["mmv_id"],
            "mmvq_id": ["quantize_q8_1", "mmvq_id"], "mmv_id_grouped": ["moe_route", "mmv_id_grouped"],
            "mmvq_id_grouped": ["moe_route", "quantize_q8_1", "mmvq_id_grouped"]}


def _emulate(y: Tensor, feeds: dict, emulator: Path, tmp_path: Path) -> tuple[np.ndarray, list, list[int]]:
    """`y`'s output after the launches the plugin binds for it ran in the emulator, the launches, the error word."""
    arena = fed_arena(y, feeds)
    launches = _specs(y, arena)
    mem = run_launches(launches, arena, False, emulator, tmp_path)
    return arena.bytes_of(y, mem)[:y.nbytes].view(np.float32).reshape(y.shape), launches, arena.word(mem)


@pytest.mark.parametrize("case", list(CASES))
def test_mmv_emulated(case: str, emulator: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    y = CASES[case]()
    feeds = _feeds(y, rng)
    (ref,) = od.compile(y, "cpu").run(feeds)
    got, launches, word = _emulate(y, feeds, emulator, tmp_path)
    assert [s.kernel.split("<")[0] for s in launches] == LAUNCHES[case.split()[0]]
    (first, *_), _, glu = fusion.parts(_nodes(y))
    limit = bound("mul_mat", weight=first.srcs[0].dtype.name) * (2 if glu is not None else 1)
    what = f"{case}: {launches[-1].kernel} grid {launches[-1].grid}"
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten?)"
    assert nmse(got, ref) <= limit, f"{what}: NMSE {nmse(got, ref):.3g}"
    assert not any(word), f"{what}: error word {word} set by valid ids"


@pytest.mark.parametrize("case", ["mmv_id f16 1 token 3 of 5 experts", "mmvq_id q8_0 1 token K96 bias",
                                  "mmv_id_grouped f32 5 tokens 2 of 3 experts"])
def test_expert_out_of_range_writes_nan(case: str, emulator: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    """An expert id outside [0, E) gives its (token, slot) NaN rows and the error word its tag, position and value;
    the other slots stay right."""
    y = CASES[case]()
    feeds = _feeds(y, rng)
    ids = next(t for t in feeds if t.dtype.is_int)
    n_exp = next(n.srcs[0].shape[0] for n in Graph.build(y).nodes if n.op == "mul_mat_id")
    bad = feeds[ids].copy()
    bad[-1, -1] = n_exp + 2
    good = feeds[ids].copy()
    good[-1, -1] = 0
    (ref,) = od.compile(y, "cpu").run({**feeds, ids: good})
    got, launches, word = _emulate(y, {**feeds, ids: bad}, emulator, tmp_path)
    assert np.isnan(got[-1, -1]).all(), f"{case}: the bad slot's rows are not NaN"
    others = np.ones(got.shape[:2], bool)
    others[-1, -1] = False
    (first, *_), _, _ = fusion.parts(_nodes(y))
    assert nmse(got[others], ref[others]) <= bound("mul_mat", weight=first.srcs[0].dtype.name), f"{case}: other slots"
    assert word[:3] == [ScratchArena.TAG + 1, bad.size - 1, n_exp + 2], f"{case}: error word {word}"


def test_cases_cover_the_kernels() -> None:
    """The cases reach mmv's vector and element loads, each epilogue of mmv and mmvq (a legacy format's rows of
    whole blocks that are not whole chunks) and every mul_mat_id kernel of mmv_id.cu."""
    seen = set()
    for make in CASES.values():
        y = make()
        spec = _specs(y, fed_arena(y))[-1]
        seen.add(spec.kernel.split("<")[0] + " " + spec.kernel.split(", ")[-1].rstrip(">"))
        if spec.kernel.startswith("mmv<"):
            seen.add("vec" if ", true, " in spec.kernel else "element")
    assert {"vec", "element", *(f"{k} {e}" for k in ("mmv", "mmvq") for e in (specs.EPI_NONE, specs.EPI_BIAS,
                                                                              specs.EPI_GLU))} <= seen, seen
    assert {k for k in LAUNCHES} <= {s.split()[0] for s in seen}, seen
