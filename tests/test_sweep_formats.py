"""The conformance sweep's block formats: every format of the dtype table has cases in each op family that
takes it, its random valid blocks are what they claim, and the products' bounds (docs/conformance.md) hold
the rounding of b to q8_1 that GPU kernels add, measured on the CPU reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from opdispatch.compiler import compile
from opdispatch.dtypes import DTYPES, dequantize
from opdispatch.graph import Graph
from opdispatch.ops.base import BLOCK_FORMATS, ENCODABLE, QUANTS
from opdispatch.quants.samples import random_blocks
from opdispatch.tensor import Tensor
from opdispatch.testing import cases
from opdispatch.testing.cases import Case, Inputs, bound
from opdispatch.testing.cases.base import CODE_STEPS, OP_BOUNDS, Q8_1_NMSE, SAMPLED, WEIGHT_BOUNDS
from opdispatch.testing.harness import Status, run_case
from opdispatch.testing.metrics import nmse
from test_mmvq_stream_emulated import q8_1_rounded

PRODUCTS = ("mul_mat", "mul_mat_id", "fused:mul_mat_add", "fused:mul_mat_glu", "fused:mul_mat_id_add_id")
FULL = {g: cases.cases(g, full=True) for g in (*PRODUCTS, "get_rows", "set_rows", "cpy", "dup", "cont", "out_prod")}


def _formats(group: str, what: str) -> set[str]:
    """The block formats named as `what`=<format> in the labels of `group`'s full sweep."""
    return {word.split("=")[1] for c in FULL[group] for word in c.label.split() if word.startswith(what + "=")}


def test_every_block_format_has_cases_in_every_family_that_takes_it() -> None:
    for group in ("mul_mat", "fused:mul_mat_add", "fused:mul_mat_glu", "out_prod"):
        assert _formats(group, "a") >= set(BLOCK_FORMATS), group
    assert _formats("mul_mat_id", "as") >= set(BLOCK_FORMATS)
    assert _formats("fused:mul_mat_id_add_id", "as") >= set(BLOCK_FORMATS) - {"q8_K"}  # no kernel's weight format
    assert _formats("set_rows", "dst") >= set(ENCODABLE)
    rows = {c.label.split()[0] for g in ("get_rows", "dup", "cont") for c in FULL[g]}
    assert rows >= set(BLOCK_FORMATS)
    pairs = {c.label.split()[0] for c in FULL["cpy"]}
    for q in BLOCK_FORMATS:
        assert {f"{q}->f32", f"{q}->f16", f"{q}->bf16", f"{q}->{q}"} <= pairs, q
        assert (f"f32->{q}" in pairs) == (q in ENCODABLE), q


@pytest.mark.parametrize("fmt", SAMPLED)
def test_mul_mat_sweeps_each_format_at_every_mat_vec_width(fmt: str) -> None:
    """N = 1..9 and 16 (the mat-vecs, then mmq or dequant_cublas), K whole blocks, odd M."""
    labels = [dict(w.split("=") for w in c.label.split() if "=" in w) for c in FULL["mul_mat"]]
    mine = [lab for lab in labels if lab["a"] == fmt]
    assert {int(lab["n"]) for lab in mine} >= {*range(1, 10), 16}
    assert all(int(lab["k"]) % DTYPES[fmt].block_size == 0 and int(lab["m"]) % 2 for lab in mine)


def test_default_sweep_takes_a_few_cases_a_format_group() -> None:
    """One or two cases a family for each group past the legacy formats, not the full set."""
    groups = {"K-quants": ("q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "q8_K"), "iq4": ("iq4_nl", "iq4_xs"),
              "mxfp4": ("mxfp4",), "grid": tuple(q for q in SAMPLED if q not in ENCODABLE)}
    for family in ("mul_mat", "mul_mat_id", "get_rows", "cpy", "dup", "cont", "fused:mul_mat_add",
                   "fused:mul_mat_glu"):
        labels = [c.label for c in cases.cases(family)]
        per_group = {g: sum(any(f"{q} " in f"{lab} " or f"={q} " in f"{lab} " or f"{q}->" in lab for q in qs)
                            for lab in labels) for g, qs in groups.items()}
        assert sum(per_group.values()) >= 2 and max(per_group.values()) <= 2, (family, per_group)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_random_blocks_are_valid_with_every_code_drawn(fmt: str, rng: np.random.Generator) -> None:
    dt = DTYPES[fmt]
    raw = random_blocks(rng, fmt, 512)
    assert raw.shape == (512, dt.block_bytes) and raw.dtype == np.uint8
    values = dequantize(fmt, raw.reshape(1, -1)).reshape(512, dt.block_size)
    assert np.isfinite(values).all() and np.abs(values).max() < 1024  # inside f16, where GPU paths convert
    rms = np.sqrt(np.mean(values.astype(np.float64) ** 2, axis=-1))
    lo, hi = np.quantile(rms, (0.05, 0.95))
    assert lo > 0 and hi / lo < 16, (lo, hi)  # block scales of one octave: no block holds the tensor's weight
    assert len(np.unique(raw[:, dt.block_bytes // 2])) > 128  # code bytes (mid-block in every format) drawn
    again = random_blocks(rng, fmt, 512)
    assert not np.array_equal(raw, again)


def test_inputs_blocks_are_raw_rows_in_every_layout(rng: np.random.Generator) -> None:
    inp = Inputs(rng)
    for layout in ("contig", "perm", "strided"):
        t = inp.blocks((2, 3, 256), "iq2_xxs", layout)
        leaf = t.base
        assert t.shape == (2, 3, 256) and t.is_contiguous() == (layout == "contig")
        assert inp.feeds[leaf].dtype == np.uint8 and inp.feeds[leaf].shape == leaf.array_layout()[0]
    w = inp.weight((5, 256), "iq3_s")
    assert w.shape == (5, 256) and w.data.size == 5 * DTYPES["iq3_s"].block_bytes
    legacy, sampled = inp.source((4, 64), "q4_0"), inp.source((4, 256), "q4_K")
    assert inp.feeds[legacy].dtype == np.float64 and inp.feeds[sampled].dtype == np.uint8  # values / raw blocks


def test_bounds_of_block_formats() -> None:
    assert OP_BOUNDS["mul_mat"] == pytest.approx(32 * Q8_1_NMSE, rel=0.01)
    assert bound("mul_mat", weight="q4_0") == bound("mul_mat", weight="iq2_xxs") == OP_BOUNDS["mul_mat"]
    assert bound("mul_mat_id", weight="q4_K") == WEIGHT_BOUNDS["q4_K"] == 256 * Q8_1_NMSE
    assert bound("dup", "iq2_xxs", src="iq2_xxs") == bound("dup", "q4_0", src="q4_0") == 1e-7
    assert set(CODE_STEPS) == set(ENCODABLE) and set(QUANTS) | set(SAMPLED) == set(BLOCK_FORMATS)
    for q in ENCODABLE:
        assert bound("set_rows", q, 64) == pytest.approx(max(1e-7, CODE_STEPS[q] ** 2 / 16))


def _rounded_b(outputs: list[Tensor], feeds: dict[Tensor, np.ndarray]) -> dict[Tensor, np.ndarray]:
    """`feeds` with the b of every matrix product (an f32 input, rows contiguous) rounded to q8_1."""
    out = dict(feeds)
    for node in Graph.build(outputs).nodes:
        if node.op in ("mul_mat", "mul_mat_id") and node.srcs[0].dtype.is_quant:
            b = node.srcs[1].base
            out[b] = q8_1_rounded(np.asarray(feeds[b], np.float32))
    return out


def _product_cases() -> list[Case]:
    """The products of the formats past the legacy ones, full sweep: every N up to 9 and the 1-block K,
    where b's rounding has the fewest terms to average over."""
    picked = []
    for c in itertools.chain.from_iterable(FULL[g] for g in PRODUCTS):
        words = dict(w.split("=") for w in c.label.split() if "=" in w)
        fmt = words.get("a", words.get("as"))
        if fmt in SAMPLED and int(words.get("n", words.get("t", "1"))) <= 9:
            picked.append(c)
    return picked


def test_products_hold_b_rounded_to_q8_1_within_their_bound(rng: np.random.Generator) -> None:
    """What the GPU's mat-vecs and mmq compute (the reference on b rounded to q8_1, their only departure:
    docs/cuda_matmul.md) is within each case's bound of the reference, for every block format."""
    worst: dict[str, float] = {}
    for case in _product_cases():
        outputs, feeds = case.build(rng)
        plan = compile(Graph.build(outputs), "cpu", fusion=False)
        exact, rounded = plan.run(feeds)[0], plan.run(_rounded_b(outputs, feeds))[0]
        err = nmse(np.asarray(rounded, np.float64), np.asarray(exact, np.float64))
        assert 0 < err <= case.bound, f"{case.name}: nmse {err:.3g} > bound {case.bound:.3g}"
        worst[case.group] = max(worst.get(case.group, 0.0), err / case.bound)
    assert set(worst) == set(PRODUCTS)


@pytest.mark.parametrize("case", [c for g in ("get_rows", "cpy", "dup", "cont") for c in FULL[g]
                                  if c.label.split()[0].split("->")[0] in ("iq1_m", "q8_K")],
                         ids=lambda c: c.name)
def test_full_sweep_rows_of_formats_without_a_gpu_path_pass_on_cpu(case: Case) -> None:
    res = run_case(case, "cpu")
    assert res.status is Status.PASS and res.nmse == 0.0, res.describe()
