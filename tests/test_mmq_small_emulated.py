"""cuda_matmul's weight-streaming quantized GEMM (mmq_small.cu, after mmv.cu's quantize_q8_1) run on the CPU:
the real sources compiled by g++ against tests/cuda_emu/shim.h (test_mmq_emulated.py's emulation: threads,
barriers, lazy or eager cp.async, the int8 mma from the PTX ISA's fragment layout, poisoned shared memory and
outputs), on the launch specs the plugin binds (specs/mmq_small.py).

The weights are random valid blocks (opdispatch.quants.samples.random_blocks: every code, sub-scale and min
drawn), so each format's decode is exercised over its whole range; the oracle is numpy: the blocks dequantized
(opdispatch.dtypes.dequantize, ggml's dequantize_row) times b, in float64. The kernel's only departure from it
is b's q8_1 rounding (and split K's f32 order): NMSE 1e-8 against numpy on b rounded to q8_1, mul_mat's 5e-4
against the plain product. Cases: every format of mmq's, N = 9, 16, 17, 32 (both column tiles, partial ones),
M tails (M not a multiple of 16, nor of a block's rows), split K (uneven slices, a short last K tile), batches.
The fused gate/up GLU (support.MMQ_GLU) runs GLU_CASES: the oracle applies the glu node's reference to the two
products (b rounded to q8_1, float64).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.dtypes import DTYPES, dequantize
from opdispatch.graph import Graph
from opdispatch.plugins.cuda_matmul import fusion, specs, support
from opdispatch.plugins.cuda_matmul.specs import mmq, mmq_small
from opdispatch.quants.samples import random_blocks
from opdispatch.tensor import Tensor
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import gxx_major
from test_mmq_emulated import NMSE_MAX, NMSE_Q8_1, ScratchArena, build_emulator, run_launches
from test_mmvq_stream_emulated import q8_1_rounded

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20 <barrier>, _Float16)")

SC = mmq_small.SmallConfig
#: two warps a block, a 3-stage ring, and a split aimed at 64 blocks an SM: the small test shapes split K
TWO_WARPS = SC(warps=2, stages=3, blocks_per_sm=64)
#: name: (format, M, K, N, batch, eager copies, configuration)
CASES = {
    "q4_0 M77 K2048 N9": ("q4_0", 77, 2048, 9, (), False, SC()),
    "q4_0 M40 K768 N16 eager": ("q4_0", 40, 768, 16, (), True, SC()),
    "q8_0 M33 K1280 N32 (3 uneven slices)": ("q8_0", 33, 1280, 32, (), False, SC(warps=1, kt_min=1, split_max=3)),
    "q8_0 M19 K768 N17 two warps": ("q8_0", 19, 768, 17, (), False, TWO_WARPS),
    "q4_1 M21 K640 N12 (a 4-block K tail)": ("q4_1", 21, 640, 12, (), False, TWO_WARPS),
    "q5_0 M35 K512 N16 fm2": ("q5_0", 35, 512, 16, (), False, SC(fm=2, warps=2, blocks_per_sm=64)),
    "q5_1 M17 K576 N9 (a 2-block K tail)": ("q5_1", 17, 576, 9, (), False, TWO_WARPS),
    "q4_K M77 K2304 N16 (9 K tiles)": ("q4_K", 77, 2304, 16, (), False, SC()),
    "q4_K M30 K1024 N32 batches": ("q4_K", 30, 1024, 32, (2,), True, TWO_WARPS),
    "q5_K M23 K768 N9": ("q5_K", 23, 768, 9, (), False, TWO_WARPS),
    "q6_K M21 K2048 N17 (halves, K tiles inside granules)": ("q6_K", 21, 2048, 17, (), False, TWO_WARPS),
    "q3_K M18 K2048 N16": ("q3_K", 18, 2048, 16, (), False, TWO_WARPS),
    "q2_K M25 K1024 N32 (mins)": ("q2_K", 25, 1024, 32, (), False, TWO_WARPS),
    "iq4_nl M20 K512 N9": ("iq4_nl", 20, 512, 9, (), False, TWO_WARPS),
    "iq4_xs M19 K1024 N16": ("iq4_xs", 19, 1024, 16, (), False, TWO_WARPS),
    "mxfp4 M22 K1024 N32 (odd block addresses)": ("mxfp4", 22, 1024, 32, (), True, TWO_WARPS),
}


def _node(y: Tensor) -> Tensor:
    return next(n for n in Graph.build(y).nodes if n.op == "mul_mat")


def _graph(dt: str, m: int, k: int, n: int, batch: tuple) -> Tensor:
    return ops.mul_mat(od.input("a", (m, k), dt), od.input("x", (*batch, n, k)))


def _specs(case: str, arena: ScratchArena, ptr=lambda t: 512) -> list:  # noqa: ANN001
    dt, m, k, n, batch, _, cfg = CASES[case]
    return mmq_small.small_specs(_node(_graph(dt, m, k, n, batch)), ptr, arena.scratch, None, cfg)


@pytest.fixture(autouse=True)
def mmq_small_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmq_small takes 9.. columns, whatever support.MMQ_SMALL_MIN_N (off until it is tuned) says."""
    monkeypatch.setattr(support, "MMQ_SMALL_MIN_N", support.MMV_MAX_N + 1)
    monkeypatch.setattr(support, "MMQ_SMALL_SKIP", frozenset())


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    launches = [*(s for case in CASES for s in _specs(case, ScratchArena(1 << 24))),
                *(s for case in GLU_CASES for s in _glu_specs(case, ScratchArena(1 << 24))[1])]
    arity = {s.kernel: len(s.arg_values) for s in launches}
    return build_emulator(tmp_path_factory.mktemp("mmq_small_emu"), ("mmv.cu", "mmq_small.cu"), arity)


#: the cases run again with a residual addend (add(mul_mat, r), r of the product's shape: mq::finish adds it as out
#: is written, straight or after split K's planes): case -> the pad of r's rows (m + pad floats apart; a view if > 0)
RESIDUAL_CASES = {"q4_0 M77 K2048 N9": 0, "q4_K M30 K1024 N32 batches": 5, "q8_0 M19 K768 N17 two warps": 3}


@pytest.mark.parametrize("case", list(CASES))
def test_mmq_small_emulated(case: str, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    _check(case, None, emulator, tmp_path, rng)


@pytest.mark.parametrize("case", list(RESIDUAL_CASES))
def test_mmq_small_residual_emulated(case: str, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    _check(case, RESIDUAL_CASES[case], emulator, tmp_path, rng)


def _run(case: str, launches: list, arena: ScratchArena, out: Tensor, eager: bool, emulator: Path,
         tmp_path: Path) -> tuple[np.ndarray, str]:
    """Run quantize_q8_1 + mmq_small emulated: out's values and a description of the launch; the split counters
    must be back at zero."""
    args = launches[1].args
    mem = run_launches(launches, arena, eager, emulator, tmp_path)
    at = arena.ptr(out)
    got = mem[at:at + out.nbytes].view(np.float32).reshape(out.shape)
    what = f"{case}: grid {launches[1].grid} splits {args.splits} kts {args.kts} smem {launches[1].smem}"
    if args.splits > 1:
        at, nbytes = arena.roles["mmq split counters"]
        assert not mem[at:at + nbytes].any(), f"{what}: split counters not back to zero"
    return got, what


def _check(case: str, pad: int | None, emulator: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    """The launches of CASES[case] (with pad: fused with a residual addend, rows m + pad floats apart) run by the
    emulator on poisoned memory, against numpy: every output written, NMSE as the module docstring says."""
    dt, m, k, n, batch, eager, cfg = CASES[case]
    y = _graph(dt, m, k, n, batch)
    node = _node(y)
    assert support.choose(node).path == "mmq_small"
    a, b = node.srcs
    raw = random_blocks(rng, dt, m * k // DTYPES[dt].block_size).reshape(m, -1)
    vb = rng.uniform(-1, 1, b.shape).astype(np.float32)
    arena = ScratchArena(a.nbytes + 3 * b.nbytes + 41 * b.nbytes + (cfg.split_max + 4) * node.nbytes + (1 << 16))
    arena.place(a, raw)
    arena.place(b, vb)
    out, addend, epi = node, 0.0, {}
    if pad is not None:
        wide = od.input("r", (*node.shape[:-1], m + pad))
        r = wide.view(node.shape, wide.strides) if pad else wide
        out = ops.add(node, r)
        assert fusion.check(None, [node, out], Graph.build(out)) is True
        vr = rng.uniform(-1, 1, wide.shape).astype(np.float32)
        arena.place(wide, vr)
        addend, epi = vr[..., :m].astype(np.float64), dict(out=out, bias=r, bias_col=fusion.bias_col(node, r))
        assert epi["bias_col"] == m + pad
    arena.place(out, None)
    launches = mmq_small.small_specs(node, arena.ptr, arena.scratch, None, cfg, **epi)
    assert [s.kernel.split("<")[0] for s in launches] == ["quantize_q8_1", "mmq_small"]
    got, what = _run(case, launches, arena, out, eager, emulator, tmp_path)
    wa = dequantize(dt, raw).astype(np.float64)
    ref = vb.astype(np.float64) @ wa.T + addend
    model = q8_1_rounded(vb).astype(np.float64) @ wa.T + addend
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (unwritten, or read before landing)"
    assert nmse(got, model) <= NMSE_Q8_1, f"{what}: NMSE {nmse(got, model):.3g} against b rounded to q8_1"
    assert nmse(got, ref) <= NMSE_MAX, f"{what}: NMSE {nmse(got, ref):.3g}"
    if pad is not None:  # the product alone, as sensitive as the unfused case
        assert nmse(got - addend, model - addend) <= NMSE_Q8_1, f"{what}: the product part"


def test_cases_cover() -> None:
    """Every format of mmq's, both column tiles, split and unsplit launches, M tails."""
    assert {c[0] for c in CASES.values()} == set(mmq.MMQ_FORMATS)
    launches = {case: _specs(case, ScratchArena(1 << 24))[1] for case in CASES}
    assert {mmq_small.small_nt(c[3]) for c in CASES.values()} == set(mmq_small.SMALL_NTS)
    assert {9, 16, 17, 32} <= {c[3] for c in CASES.values()}
    splits = {s.args.splits for s in launches.values()}
    assert 1 in splits and max(splits) >= 3
    assert any(c[1] % 16 for c in CASES.values())


# -- the fused gate/up GLU ----------------------------------------------------------------------------------------

GLU_WARPS = mmq_small.SMALL_GLU
#: name: (format, M, K, N, eager copies, configuration, glu kind, addends: None, "row" (one row each) or "rows"
#: (the products' shape, rows m + 3 floats apart))
GLU_CASES = {
    "q4_0 M77 K2048 N9 swiglu split": ("q4_0", 77, 2048, 9, False, GLU_WARPS, "swiglu", None),
    "q4_0 M40 K768 N16 geglu unsplit eager": ("q4_0", 40, 768, 16, True, SC(warps=2, split_max=1), "geglu", "row"),
    "q4_K M77 K2304 N16 swiglu split": ("q4_K", 77, 2304, 16, False, GLU_WARPS, "swiglu", "rows"),
    "q4_K M30 K1024 N32 swiglu_oai unsplit": ("q4_K", 30, 1024, 32, False, SC(warps=2, split_max=1), "swiglu_oai",
                                              "row"),
    "q6_K M21 K2048 N17 swiglu split": ("q6_K", 21, 2048, 17, False, TWO_WARPS, "swiglu", None),
    "q6_K M35 K2048 N32 geglu fm2 unsplit": ("q6_K", 35, 2048, 32, True, SC(fm=2, warps=2, split_max=1), "geglu",
                                            "rows"),
    "q8_0 M19 K768 N9 swiglu_oai split": ("q8_0", 19, 768, 9, False, attrs.evolve(TWO_WARPS, kt_min=1), "swiglu_oai", "rows"),
}


def _glu_graph(case: str) -> Tensor:
    dt, m, k, n, _, _, kind, addends = GLU_CASES[case]
    x = od.input("x", (n, k))
    prods = [ops.mul_mat(od.input(w, (m, k), dt), x) for w in ("wg", "wu")]
    if addends == "row":
        prods = [ops.add(p, od.input(f"b{i}", (m,))) for i, p in enumerate(prods)]
    elif addends == "rows":
        prods = [ops.add(p, od.input(f"r{i}", (n, m + 3)).view((n, m), (4 * (m + 3), 4))) for i, p in enumerate(prods)]
    extra = dict(alpha=1.702, limit=7.0) if kind == "swiglu_oai" else {}
    return ops.glu_split(*prods, kind, **extra)


def _glu_specs(case: str, arena: ScratchArena, y: Tensor | None = None) -> tuple[list[Tensor], list]:
    """(the group's nodes, its launches on the arena's addresses; the tensors not yet placed placed unfilled) of
    y (default: a new _glu_graph(case))."""
    cfg = GLU_CASES[case][5]
    y = _glu_graph(case) if y is None else y
    graph = Graph.build(y)
    for t in (*graph.leafs, *graph.nodes):  # place() keeps a tensor already placed (filled) where it is
        arena.place(t, None)
    nodes = [n for n in graph.nodes if n.op != "view"]
    prods, biases, glu = fusion.parts(nodes)
    launches = mmq_small.small_specs(prods[0], arena.ptr, arena.scratch, None, cfg, out=glu, bias=biases[0],
                                     bias1=biases[1], bias_col=fusion.bias_col(prods[0], biases[0]),
                                     a1=prods[1].srcs[0], glu=glu)
    return nodes, launches


@pytest.fixture
def glu_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "MMQ_GLU", True)


@pytest.mark.usefixtures("glu_on")
@pytest.mark.parametrize("case", list(GLU_CASES))
def test_mmq_small_glu_emulated(case: str, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    """One quantize_q8_1 and one fused launch against numpy: every output written, NMSE against the glu of the
    products of b rounded to q8_1 (1e-8 to 1e-6: the activations' f32 rounding) and against the plain reference."""
    dt, m, k, n, eager, cfg, kind, addends = GLU_CASES[case]
    y = _glu_graph(case)
    graph = Graph.build(y)
    nodes = [n for n in graph.nodes if n.op != "view"]
    assert fusion.check(None, nodes, graph) is True
    prods, biases, _ = fusion.parts(nodes)
    feeds: dict[Tensor, np.ndarray] = {}
    for t in graph.leafs:
        if t.dtype.is_quant:
            feeds[t] = random_blocks(rng, dt, m * k // DTYPES[dt].block_size).reshape(m, -1)
        else:
            feeds[t] = rng.uniform(-1, 1, t.shape).astype(np.float32)
    # x scaled so that the gate's sums spread about 2: the activations neither saturate nor (swiglu_oai) clip
    # mostly, where b's q8_1 rounding alone would move outputs past the plain reference's bound
    x = prods[0].srcs[1]
    spread = np.std(feeds[x].astype(np.float64) @ dequantize(dt, feeds[prods[0].srcs[0]]).astype(np.float64).T)
    feeds[x] = (feeds[x] * (2.0 / spread)).astype(np.float32)
    arena = ScratchArena(1 << 24)
    for t in graph.leafs:
        arena.place(t, feeds[t])
    _, launches = _glu_specs(case, arena, y)
    assert [s.kernel.split("<")[0] for s in launches] == ["quantize_q8_1", "mmq_small"]
    assert launches[1].kernel.endswith(", true>"), launches[1].kernel
    assert (launches[1].args.splits > 1) == ("split" in case.split()), launches[1].args.splits
    got, what = _run(case, launches, arena, y, eager, emulator, tmp_path)
    vb = feeds[x]

    def glu_of(b: np.ndarray) -> np.ndarray:
        sums = []
        for p, bias in zip(prods, biases):
            v = b.astype(np.float64) @ dequantize(dt, feeds[p.srcs[0]]).astype(np.float64).T
            if bias is not None:
                v = v + (feeds[bias.base] if bias.base is not bias else feeds[bias])[..., :m]
            sums.append(v)
        g, u = od.input("g", y.shape), od.input("u", y.shape)
        extra = dict(alpha=1.702, limit=7.0) if kind == "swiglu_oai" else {}
        z = ops.glu_split(g, u, kind, **extra)
        (out,) = od.compile(z, "cpu").run({g: sums[0].astype(np.float32), u: sums[1].astype(np.float32)})
        return out.astype(np.float64)

    model, ref = glu_of(q8_1_rounded(vb)), glu_of(vb)
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (unwritten, or read before landing)"
    assert nmse(got, model) <= 1e-6, f"{what}: NMSE {nmse(got, model):.3g} against b rounded to q8_1"
    assert nmse(got, ref) <= NMSE_MAX, f"{what}: NMSE {nmse(got, ref):.3g}"


def test_glu_cases_cover() -> None:
    """q4_0, q4_K, q6_K (and q8_0), both column tiles, N 9 / 16 / 32, split and unsplit, M tails, every addend."""
    assert {"q4_0", "q4_K", "q6_K"} <= {c[0] for c in GLU_CASES.values()}
    assert {9, 16, 32} <= {c[3] for c in GLU_CASES.values()}
    splits = {case: _glu_specs(case, ScratchArena(1 << 24))[1][1].args.splits for case in GLU_CASES}
    assert all((s > 1) == ("split" in case.split()) for case, s in splits.items()), splits
    assert any(c[1] % 16 for c in GLU_CASES.values()) and {None, "row", "rows"} == {c[7] for c in GLU_CASES.values()}
