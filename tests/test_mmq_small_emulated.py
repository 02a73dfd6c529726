"""cuda_matmul's weight-streaming quantized GEMM (mmq_small.cu, after mmv.cu's quantize_q8_1) run on the CPU:
the real sources compiled by g++ against tests/cuda_emu/shim.h (test_mmq_emulated.py's emulation: fibers,
barriers, lazy or eager cp.async, the int8 mma from the PTX ISA's fragment layout, poisoned shared memory and
outputs), on the launch specs the plugin binds (specs/mmq_small.py).

The weights are random valid blocks (opdispatch.quants.samples.random_blocks: every code, sub-scale and min
drawn), so each format's decode is exercised over its whole range; the oracle is numpy: the blocks dequantized
(opdispatch.dtypes.dequantize, ggml's dequantize_row) times b, in float64. The kernel's only departure from it
is b's q8_1 rounding (and split K's f32 order): NMSE 1e-8 against numpy on b rounded to q8_1, mul_mat's 5e-4
against the plain product. Cases: every format of mmq's, N = 9, 16, 17, 32 (both column tiles, partial ones),
M tails (M not a multiple of 16, nor of a block's rows), split K (uneven slices, a short last K tile), batches.
Every launch runs its blocks in a random order (the emulator's EMU_SHUFFLE): no block may rely on another's
going first.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.dtypes import DTYPES, dequantize
from opdispatch.graph import Graph
from opdispatch.plugins.cuda_matmul import bind, fusion, support
from opdispatch.plugins.cuda_matmul.specs import mmq, mmq_small
from opdispatch.quants.samples import random_blocks
from opdispatch.tensor import Tensor
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import gxx_major, run_launches
from test_mmq_emulated import NMSE_MAX, NMSE_Q8_1, ScratchArena, build_emulator
from test_mmvq_stream_emulated import q8_1_rounded

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")

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
    "q4_0 M48 K2048 N16 (split: the planes summed in runs of 4 rows)": ("q4_0", 48, 2048, 16, (), False, TWO_WARPS),
    "q4_K M30 K1024 N32 batches": ("q4_K", 30, 1024, 32, (2,), True, TWO_WARPS),
    "q5_K M23 K768 N9": ("q5_K", 23, 768, 9, (), False, TWO_WARPS),
    "q6_K M21 K2048 N17 (halves, K tiles inside granules)": ("q6_K", 21, 2048, 17, (), False, TWO_WARPS),
    "q3_K M18 K2048 N16": ("q3_K", 18, 2048, 16, (), False, TWO_WARPS),
    "q2_K M25 K1024 N32 (mins)": ("q2_K", 25, 1024, 32, (), False, TWO_WARPS),
    "iq4_nl M20 K512 N9": ("iq4_nl", 20, 512, 9, (), False, TWO_WARPS),
    "iq4_xs M19 K1024 N16": ("iq4_xs", 19, 1024, 16, (), False, TWO_WARPS),
    "mxfp4 M22 K1024 N32 (odd block addresses)": ("mxfp4", 22, 1024, 32, (), True, TWO_WARPS),
    # k-groups (kw): the warps of a row group take every kw-th K tile and the first adds the others' sums
    "q4_0 M37 K2304 N16 k-groups of 4 (slices of 4 and 5 K tiles)": (
        "q4_0", 37, 2304, 16, (), False, SC(warps=4, kw=4, stages=2, kt_min=1)),
    "q4_K M40 K1024 N24 k-groups of 2, fm 2 (two K tiles a warp)": (
        "q4_K", 40, 1024, 24, (), True, SC(fm=2, warps=4, kw=2, stages=3, kt_min=1, split_max=1)),
    "q8_0 M45 K2304 N16 SMALL_WAVE (a short fifth K tile)": ("q8_0", 45, 2304, 16, (), False, mmq_small.SMALL_WAVE),
    "q5_K M21 K1536 N9 k-groups of 8 (two warps without a K tile)": (
        "q5_K", 21, 1536, 9, (), False, SC(kw=8, stages=2, kt_min=1, kts_max=8)),
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


#: the rms_norm before a pair of products (fusion.PAIR): format, M, K, N; one quantize_q8_1 launch (the norm's
#: instance) rounds the normed values for both mmq_small launches
NORM_PAIR = ("q4_0", 45, 2048, 16)


def _norm_pair() -> list[Tensor]:
    dt, m, k, n = NORM_PAIR
    h = ops.mul(ops.rms_norm(od.input("x", (n, k)), 1e-5), od.input("nw", (k,)))
    return [h.srcs[0], h, *(ops.mul_mat(od.input(f"w{i}", (m, k), dt), h) for i in range(2))]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arity = {s.kernel: len(s.arg_values) for case in CASES for s in _specs(case, ScratchArena(1 << 24))}
    arity.update({s.kernel: len(s.arg_values) for s in bind.gemm_fused_specs(_norm_pair(), lambda t: 512,
                                                                             ScratchArena(1 << 24).scratch, None)})
    first, second = _pair()
    arity.update({s.kernel: len(s.arg_values) for s in mmq_small.small_specs(
        first, lambda t: 512, ScratchArena(1 << 24).scratch, None, PAIR_SPLIT[-1], second=second)})
    return build_emulator(tmp_path_factory.mktemp("mmq_small_emu"), ("mmv.cu", "mmq_small.cu"), arity)


#: the cases run again with a residual addend (add(mul_mat, r), r of the product's shape: mq::finish adds it as out
#: is written, straight or after split K's planes): case -> the pad of r's rows (m + pad floats apart; a view if > 0)
RESIDUAL_CASES = {"q4_0 M77 K2048 N9": 0, "q4_0 M48 K2048 N16 (split: the planes summed in runs of 4 rows)": 3,
                  "q4_K M30 K1024 N32 batches": 5, "q8_0 M19 K768 N17 two warps": 3,
                  "q4_0 M37 K2304 N16 k-groups of 4 (slices of 4 and 5 K tiles)": 2}


@pytest.mark.parametrize("case", list(CASES))
def test_mmq_small_emulated(case: str, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    _check(case, None, emulator, tmp_path, rng)


@pytest.mark.parametrize("case", list(RESIDUAL_CASES))
def test_mmq_small_residual_emulated(case: str, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    _check(case, RESIDUAL_CASES[case], emulator, tmp_path, rng)


def test_norm_pair_emulated(emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    """quantize_q8_1's norm instance and the two mmq_small launches of a PAIR group, on poisoned memory: each
    product against numpy's rms_norm(x) * w (float32 as the kernel computes it) rounded to q8_1, times its weights,
    and against the float64 reference."""
    nodes = _norm_pair()
    graph = Graph.build(nodes[2:])
    assert fusion.check_pair(None, nodes, graph) is True
    dt, m, k, n = NORM_PAIR
    norm = fusion.norm_of(nodes)
    x = rng.uniform(-1, 1, (n, k)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, k).astype(np.float32)
    raws = [random_blocks(rng, dt, m * k // DTYPES[dt].block_size).reshape(m, -1) for _ in range(2)]
    arena = ScratchArena(sum(t.nbytes for t in (norm.x, norm.w, *nodes[2:])) * 4 + 44 * x.nbytes + (1 << 20))
    arena.place(norm.x, x)
    arena.place(norm.w, w)
    for prod, raw in zip(nodes[2:], raws):
        arena.place(prod.srcs[0], raw)
        arena.place(prod, None)
    launches = bind.gemm_fused_specs(nodes, arena.ptr, arena.scratch, None)
    assert [s.kernel for s in launches][0] == "quantize_q8_1<B_F32, true>"
    assert [s.kernel.split("<")[0] for s in launches[1:]] == ["mmq_small"]  # a pair: one launch, both products
    mem = run_launches(launches, arena, False, emulator, tmp_path)
    scale = np.float32(1) / np.sqrt((x * x).sum(-1, dtype=np.float32, keepdims=True) / np.float32(k) + np.float32(1e-5))
    normed = x * scale * w
    exact = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    for prod, raw in zip(nodes[2:], raws):
        at = arena.ptr(prod)
        got = mem[at:at + prod.nbytes].view(np.float32).reshape(prod.shape)
        wa = dequantize(dt, raw).astype(np.float64)
        model = q8_1_rounded(normed).astype(np.float64) @ wa.T
        assert np.isfinite(got).all(), f"{prod.name}: non-finite outputs (unwritten)"
        err = nmse(got, model)
        assert err <= 1e-6, f"{prod.name}: NMSE {err:.3g} against the normed b rounded to q8_1"
        assert nmse(got, exact @ wa.T) <= NMSE_MAX, f"{prod.name}: NMSE {nmse(got, exact @ wa.T):.3g}"


#: a pair (one launch, two products of one b: specs/mmq_small.pair_ok) on a configuration that splits K: format,
#: M, K, N, configuration
PAIR_SPLIT = ("q4_K", 37, 2048, 12, TWO_WARPS)


def _pair() -> list[Tensor]:
    dt, m, k, n, _ = PAIR_SPLIT
    x = od.input("x", (n, k))
    return [ops.mul_mat(od.input(f"w{i}", (m, k), dt), x) for i in range(2)]


def test_pair_split_emulated(emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    """Both products of a pair with split K, on poisoned memory, its blocks in a random order (so that the halves'
    blocks interleave): each against numpy (b rounded to q8_1), every output written, each product's own planes
    and counters (back to zero)."""
    dt, m, k, n, cfg = PAIR_SPLIT
    prods = _pair()
    b = prods[0].srcs[1]
    vb = rng.uniform(-1, 1, b.shape).astype(np.float32)
    raws = [random_blocks(rng, dt, m * k // DTYPES[dt].block_size).reshape(m, -1) for _ in prods]
    arena = ScratchArena(sum(p.nbytes for p in prods) * 40 + 44 * vb.nbytes + (1 << 20))
    arena.place(b, vb)
    for prod, raw in zip(prods, raws):
        arena.place(prod.srcs[0], raw)
        arena.place(prod, None)
    launches = mmq_small.small_specs(prods[0], arena.ptr, arena.scratch, None, cfg, second=prods[1])
    assert [s.kernel.split("<")[0] for s in launches] == ["quantize_q8_1", "mmq_small"]
    args = launches[1].args
    assert args.splits > 1 and launches[1].grid[0] == 2 * args.tiles_m * args.splits
    mem = run_launches(launches, arena, False, emulator, tmp_path, shuffle=int(rng.integers(2**31)))
    at, nbytes = arena.roles["mmq split counters"]
    assert not mem[at:at + nbytes].any(), "split counters not back to zero"
    for prod, raw in zip(prods, raws):
        at = arena.ptr(prod)
        got = mem[at:at + prod.nbytes].view(np.float32).reshape(prod.shape)
        model = q8_1_rounded(vb).astype(np.float64) @ dequantize(dt, raw).astype(np.float64).T
        assert np.isfinite(got).all(), f"{prod.name}: non-finite outputs (unwritten)"
        assert nmse(got, model) <= NMSE_Q8_1, f"{prod.name}: NMSE {nmse(got, model):.3g} against b rounded to q8_1"


def test_pair_ok() -> None:
    """A pair reads one b with weights of one dtype, shape and strides; anything else is two launches."""
    prods = _pair()
    assert mmq_small.pair_ok(*prods) is True
    other_b = ops.mul_mat(prods[1].srcs[0], od.input("x2", prods[0].srcs[1].shape))
    assert mmq_small.pair_ok(prods[0], other_b) == "the products read different b"
    wider = ops.mul_mat(od.input("w", (40, 2048), "q4_K"), prods[0].srcs[1])
    assert mmq_small.pair_ok(prods[0], wider) == "the weights differ in dtype, shape or strides"
    with pytest.raises(ValueError, match="no pair"):
        mmq_small.small_specs(prods[0], lambda t: 512, ScratchArena(1 << 24).scratch, None, second=wider)


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
    args = launches[1].args
    mem = run_launches(launches, arena, eager, emulator, tmp_path, shuffle=int(rng.integers(2**31)))
    at = arena.ptr(out)
    got = mem[at:at + out.nbytes].view(np.float32).reshape(out.shape)
    what = f"{case}: grid {launches[1].grid} splits {args.splits} kts {args.kts} smem {launches[1].smem}"
    if args.splits > 1:
        at, nbytes = arena.roles["mmq split counters"]
        assert not mem[at:at + nbytes].any(), f"{what}: split counters not back to zero"
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
    kws = {(c[-1].kw, launches[case].args.splits > 1) for case, c in CASES.items()}
    assert {(1, True), (1, False), (4, True), (2, False), (8, False)} <= kws
    assert any(c[1] % 16 for c in CASES.values())
    # the last block's sum of the planes: runs of 4 rows (M % 4 == 0) and single rows
    assert {c[1] % 4 == 0 for case, c in CASES.items() if launches[case].args.splits > 1} == {True, False}
