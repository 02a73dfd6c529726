"""The full conformance sweep (`opdispatch test-ops --full`) reaches every path of the GPU's matrix products, for
every block format a kernel reads, at the batches where the paths change (N = 1, 9, 16, 32, 64, 512), at odd
sizes (M, N, K not multiples of the tiles), fused and unfused, and mul_mat_id with many tokens on both sides of
the switch to the quantized GEMM. Without a GPU: each case is planned on the H200's description, which gives
every node's path (support.choose) as on the GPU."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

import opdispatch as od
from opdispatch.backends.cuda.devices import H200
from opdispatch.dtypes import DTYPES
from opdispatch.graph import Graph
from opdispatch.plugins.cuda_matmul import fusion, support
from opdispatch.plugins.cuda_matmul.specs import GRID_NAMES, QUANT_NAMES, mmq, mmq_id
from opdispatch.plugins.cuda_matmul.specs.stream import STREAMED, stream_geo
from opdispatch.testing import cases
from opdispatch.testing.cases.matmul import (BATCHES, K_TILE, MOE_SHAPES, MOE_TOKENS, ODD_BATCHES, WEIGHT_FORMATS,
                                             chunk, odd_k)
from opdispatch.testing.harness import Status, support as plan_support

GROUPS = ("mul_mat", "mul_mat_id", "fused:mul_mat_add", "fused:mul_mat_glu", "fused:mul_mat_id_add_id")
MMQ_FORMATS = mmq.MMQ_FORMATS


def _reach(groups: tuple[str, ...] = GROUPS) -> dict[str, set[tuple]]:
    """group -> what its full sweep reaches on the H200: (weight format, M, N or tokens, K, experts, used, path of
    the product, fused rule or "") for every product node of every case."""
    rng = np.random.default_rng(0)
    got: dict[str, set[tuple]] = defaultdict(set)
    for group in groups:
        for case in cases.cases(group, full=True):
            outputs, _ = case.build(rng)
            for step in od.compile(Graph.build(outputs), H200).steps:
                for node in step.nodes if step.kind in ("kernel", "fused") else ():
                    if node.op not in ("mul_mat", "mul_mat_id"):
                        continue
                    a = node.srcs[0]
                    cols = support.batch_n(node) if node.op == "mul_mat" else node.shape[0]
                    experts, used = (a.shape[0], node.shape[1]) if node.op == "mul_mat_id" else (0, 0)
                    rule = step.kernel if step.kind == "fused" else ""
                    got[group].add((a.dtype.name, a.shape[-2], cols, a.shape[-1], experts, used,
                                    support.choose(node, H200).path, rule))
    return got


@pytest.fixture(scope="module")
def reach() -> dict[str, set[tuple]]:
    return _reach()


def _gemm(dt: str, n: int, m: int, k: int) -> str:
    """The path of mul_mat of m x k weights at n > 8 columns on rows of whole chunks (K a multiple of 64 in every case
    here)."""
    if dt in MMQ_FORMATS and support.MMQ_SMALL_MIN_N <= n <= support.MMQ_SMALL_MAX_N:
        return "mmq_small"
    wgmma = support.wgmma_takes(dt, m, k) is True
    if dt in MMQ_FORMATS and n <= support.MMQ_MAX_N and not (wgmma and n >= support.MMQ_WGMMA_MIN_N):
        return "mmq"
    return "mmq_wgmma" if wgmma else "dequant_cublas"


def _id_path(dt: str, t: int, e: int, u: int) -> str:
    """The path of mul_mat_id at t > 1 tokens over e experts, u used, on rows of whole chunks (K a multiple of 64)."""
    if dt not in MMQ_FORMATS or t * u <= support.MMQ_ID_PAIRS_PER_EXPERT * e:
        return "mmv_id_grouped"
    if dt in support.MMQ_WGMMA_ID_TYPES and -(-t * u // e) > support.MMQ_WGMMA_ID_MIN_MEAN:
        return "mmq_wgmma_id"
    return "mmq_id"


def test_weight_formats_are_those_the_kernels_read() -> None:
    assert set(WEIGHT_FORMATS) == set(QUANT_NAMES) and set(MMQ_FORMATS) | set(GRID_NAMES) == set(QUANT_NAMES)


@pytest.mark.parametrize("dt", QUANT_NAMES)
def test_the_sweeps_chunks_are_the_kernels(dt: str) -> None:
    """The sweep's K of whole 16-byte chunks is the streamed and tensor-core paths' row condition."""
    assert dt in STREAMED and chunk(dt) == stream_geo(dt).row_values
    k = odd_k(dt)
    assert k % chunk(dt) == 0 and k > K_TILE
    if chunk(dt) < K_TILE:
        assert k % K_TILE  # a partial last K tile
    elif chunk(dt) == K_TILE:
        assert k // K_TILE % 2  # an odd number of K tiles


@pytest.mark.parametrize("dt", QUANT_NAMES)
def test_mul_mat_reaches_every_path_at_every_batch(reach: dict[str, set[tuple]], dt: str) -> None:
    """Each batch on rows of whole chunks (the streamed mat-vec at 1, then mmq, mmq_wgmma or dequant_cublas), the
    two-launch mat-vec on rows of part chunks, and the odd sizes on the GEMM: M and N partial tiles, K of odd_k."""
    mine = {r for r in reach["mul_mat"] if r[0] == dt}
    rows = [(n, m, k, path) for _, m, n, k, *_, path, _ in mine if k % chunk(dt) == 0 and m % 2]
    assert any(n == 1 and path == "mmvq_stream" for n, _, _, path in rows)
    for n in (n for n in BATCHES if n > 1):
        assert any(cols == n and path == _gemm(dt, n, m, k) for cols, m, k, path in rows), n
    if chunk(dt) > DTYPES[dt].block_size:  # rows of q4_K / q5_K blocks are always whole chunks
        assert any(path == "mmvq" for *_, path, _ in mine)
    for n in ODD_BATCHES:
        assert any(path == _gemm(dt, n, m, k) and m % 64 and cols == n and k == odd_k(dt)
                   for _, m, cols, k, *_, path, _ in mine), n


@pytest.mark.parametrize("dt", QUANT_NAMES)
def test_mul_mat_id_reaches_the_grouped_mat_vec_and_the_gemm(reach: dict[str, set[tuple]], dt: str) -> None:
    """Many tokens (9, 64, 512) over 8 experts, 2 used, and 64 experts, 8 used: mmq_id above 8 (token, slot) pairs
    an expert for mmq's formats (both of its configurations, up to 32 pairs an expert and more, where mmq_wgmma_id
    does not take the latter), mmq_wgmma_id above 32 for its formats, mmv_id_grouped below 8 and for the grid
    I-quants; mmv_id at one token."""
    mine = {r for r in reach["mul_mat_id"] if r[0] == dt}
    paths = {(t, e, u, path) for _, _, t, k, e, u, path, _ in mine if k % chunk(dt) == 0}
    for (e, u), t in [(shape, t) for shape in MOE_SHAPES for t in MOE_TOKENS]:
        assert (t, e, u, _id_path(dt, t, e, u)) in paths, (t, e, u)
    assert any(path == "mmv_id" for *_, path, _ in mine)
    if dt in MMQ_FORMATS:
        configs = {mmq_id.mmq_id_config(dt, t * u, e) for t, e, u, path in paths if path == "mmq_id"}
        assert len(configs) == (1 if dt in support.MMQ_WGMMA_ID_TYPES else 2)
    if dt in support.MMQ_WGMMA_ID_TYPES:
        assert any(path == "mmq_wgmma_id" for *_, path in paths)


def _fused(dt: str, rule: str, n: int, m: int, k: int) -> tuple[str, str]:
    """The path of rule's pattern on m x k weights of dt at n > 8 columns, and the rule where it is fused there."""
    path = ("mmf" if n <= support.MMF_MAX_N else "cublas") if dt in ("f16", "bf16") else _gemm(dt, n, m, k)
    # cuBLAS adds contiguous residuals only, which the sweep's are but at 16 columns (strided rows)
    add = rule == "mul_mat_add" and not (path in ("cublas", "dequant_cublas") and n == 16)
    return path, rule if path == "mmf" or add else ""


@pytest.mark.parametrize("dt", ("f16", "bf16", *QUANT_NAMES))
def test_fused_patterns_reach_every_batch(reach: dict[str, set[tuple]], dt: str) -> None:
    """The bias (and residual) and gate/up GLU patterns at 9 .. 512 columns: fused on mmf (f16 / bf16 up to 16
    columns); the add fused on every GEMM too (cuBLAS: the contiguous residual, its C), the GLU not; fused on the
    mat-vecs at 1 and 8."""
    for group, rule in (("fused:mul_mat_add", "mul_mat_add"), ("fused:mul_mat_glu", "mul_mat_glu")):
        mine = {(n, m, k, path, fused) for fmt, m, n, k, _, _, path, fused in reach[group] if fmt == dt}
        for n in (9, 16, 64, 512):
            assert any((path, fused) == _fused(dt, rule, n, m, k) for cols, m, k, path, fused in mine if cols == n), \
                (group, n)
        assert {1, 8} <= {n for n, *_, fused in mine if fused == rule}, group


@pytest.mark.parametrize("dt", ("f16", "bf16", *QUANT_NAMES))
def test_residual_adds_fuse_wherever_the_bias_does(dt: str) -> None:
    """The sweep's residual cases (an addend of the product's shape, contiguous or in padded rows) fuse exactly
    where its bias cases of the same N and K do, every path with an epilogue at every batch, and on cuBLAS, whose
    C is a contiguous addend of the product's shape (not a bias row), where they are contiguous."""
    rng = np.random.default_rng(0)
    bias: dict[tuple, bool] = {}
    residual: dict[tuple, tuple[bool, str, bool]] = {}
    for case in cases.cases("fused:mul_mat_add", full=True):
        if f"a={dt} " not in case.label + " ":
            continue
        outputs, _ = case.build(rng)
        plan = od.compile(Graph.build(outputs), H200)
        (node,) = [n for s in plan.steps if s.kind in ("kernel", "fused") for n in s.nodes if n.op == "mul_mat"]
        key = (support.batch_n(node), node.srcs[0].shape[-1])
        if "residual" in case.label:
            residual[key] = (bool(plan.fusions), support.choose(node, H200).path, "residual:contig" in case.label)
        else:
            bias[key] = bool(plan.fusions)
    assert {9, 16, 64, 512} <= {n for n, _ in residual}
    for key, (fused, path, contig) in residual.items():
        assert fused == (bias[key] or (path in ("cublas", "dequant_cublas") and contig)), (dt, key, path)


@pytest.mark.parametrize("dt", QUANT_NAMES)
def test_mul_mat_id_add_id_is_fused_on_every_path(reach: dict[str, set[tuple]], dt: str) -> None:
    mine = {(t, path) for fmt, _, t, _, _, _, path, rule in reach["fused:mul_mat_id_add_id"]
            if fmt == dt and rule == "mul_mat_id_add_id"}
    want = {(1, "mmv_id"), (9, "mmv_id_grouped"), *((t, _id_path(dt, t, 8, 2)) for t in (64, 512))}
    assert want <= mine


def test_mmq_small_is_reached() -> None:
    """The sweep reaches mmq_small at 9, 16 and 32 columns for every format mmq reads."""
    got = {(dt, n) for dt, _, n, *_, path, _ in _reach(("mul_mat",))["mul_mat"] if path == "mmq_small"}
    assert {(dt, n) for dt in MMQ_FORMATS for n in (9, 16, 32)} <= got


def test_fusion_off_plans_the_fused_patterns_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`test-ops --no-fusion` (fusion=False) or OPDISPATCH_DISABLE_FUSION=1 runs the fused patterns' cases unfused."""
    case = cases.cases("fused:mul_mat_glu")[0]
    assert plan_support(case, H200).plugin == "cuda_matmul[fused mul_mat_glu]"
    assert plan_support(case, H200, fusion=False).plugin == "cuda_misc:glu"
    monkeypatch.setenv("OPDISPATCH_DISABLE_FUSION", "1")
    r = plan_support(case, H200)
    assert r.status is Status.SUPPORTED and r.plugin == "cuda_misc:glu"


def test_the_swept_patterns_are_fusion_rules() -> None:
    swept = {g.split(":", 1)[1] for g in GROUPS if g.startswith("fused:")}
    assert swept <= {name for name, _ in fusion.PATTERNS} and swept <= {g[6:] for g in cases.groups()}
