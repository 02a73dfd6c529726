"""Reference kernels of the reductions and sorts (sum, sum_rows, mean, cumsum,
argmax, count_equal, argsort, top_k) against python loops: math.fsum, running
sums, first/last-index scans and python's stable sorted().

Random inputs come from a fresh seed each run, printed in failure messages;
set OPDISPATCH_TEST_SEED to replay one.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from helpers import evaluate, nmse
from opdispatch import ops
from opdispatch.errors import OpError
from opdispatch.ops import argmax, argsort, count_equal, cumsum, mean, sum_rows, top_k
from opdispatch.tensor import Tensor, input

HOST = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
SHAPES = [(7,), (5, 13), (2, 3, 11), (2, 3, 5, 7)]


def reversed_view(name: str, vals: np.ndarray, dt: str = "f32") -> tuple[Tensor, dict]:
    """vals as a non-contiguous tensor (the axis-reversing permute of an input) and its feed."""
    axes = tuple(range(vals.ndim))[::-1]
    leaf = input(name, vals.shape[::-1], dt)
    return leaf.permute(*axes), {leaf: np.transpose(vals, axes)}


def assert_close(got: np.ndarray, want: np.ndarray, seed: int, bound: float = 1e-7) -> None:
    assert got.shape == want.shape, f"seed {seed}: shape {got.shape} != {want.shape}"
    assert np.any(want != 0), f"seed {seed}: vacuous check, all-zero expectation"
    err = nmse(got, want)
    assert err <= bound, f"seed {seed}: NMSE {err:.3g} > {bound:g}"


def assert_exact(got: np.ndarray, want: np.ndarray, seed: int) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"seed {seed}: {got.shape} {got.dtype} != {want.shape} {want.dtype}")
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"seed {seed}: {len(bad)} elements differ, first at {tuple(bad[0])}"


def rows_of(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


# ---------------------------------------------------------------------------
# sums


# f16/bf16 results are rounded once: NMSE of a scalar <= (half an ulp, relative)^2.
SUM_BOUND = {"f32": 1e-7, "f16": 2.0**-22, "bf16": 2.0**-16}


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_sum(rng, seed, dt, shape):
    x = rng.uniform(0.1, 1, shape).astype(np.float32).astype(HOST[dt])  # one sign: no cancellation
    tx, feeds = reversed_view("x", x, dt)
    out = ops.sum(tx)
    assert out.shape == (1,) and out.dtype.name == dt
    (got,) = evaluate(out, feeds)
    assert_close(got.astype(np.float64), np.array([math.fsum(float(v) for v in x.reshape(-1))]), seed, SUM_BOUND[dt])


@pytest.mark.parametrize("op_name", ["sum_rows", "mean", "cumsum"])
@pytest.mark.parametrize("shape", SHAPES)
def test_row_sums(rng, seed, op_name, shape):
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    tx, feeds = reversed_view("x", x)
    out = {"sum_rows": sum_rows, "mean": mean, "cumsum": cumsum}[op_name](tx)
    (got,) = evaluate(out, feeds)
    rows = rows_of(x).astype(np.float64)
    want = np.empty((rows.shape[0], shape[-1] if op_name == "cumsum" else 1))
    for r, row in enumerate(rows):
        if op_name == "cumsum":
            running = 0.0
            for j, v in enumerate(row):
                running += v
                want[r, j] = running
        else:
            want[r, 0] = math.fsum(row) / (len(row) if op_name == "mean" else 1)
    assert out.shape == shape[:-1] + want.shape[-1:]
    assert_close(got, want.reshape(out.shape), seed)


# ---------------------------------------------------------------------------
# argmax, count_equal


@pytest.mark.parametrize("shape", [(13,), (5, 7), (3, 11)])
def test_argmax_ties_take_last(rng, seed, shape):
    x = rng.integers(-3, 3, shape).astype(np.float32)  # few values: most rows have tied maxima
    tx, feeds = reversed_view("x", x)
    out = argmax(tx)
    assert out.shape == (shape[0] if len(shape) == 2 else 1,) and out.dtype.name == "i32"
    (got,) = evaluate(out, feeds)
    want = []
    for row in rows_of(x):
        best = 0
        for j, v in enumerate(row):
            if v >= row[best]:
                best = j
        want.append(best)
    assert_exact(got, np.array(want, np.int32), seed)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 5, 7)])
def test_count_equal(rng, seed, shape):
    a = rng.integers(-5, 5, shape).astype(np.int32)
    b = np.where(rng.random(shape) < 0.5, a, rng.integers(-5, 5, shape)).astype(np.int32)
    ta = input("a", shape, "i32")
    tb, feeds = reversed_view("b", b, "i32")
    out = count_equal(ta, tb)
    assert out.shape == (1,) and out.dtype.name == "i64"
    (got,) = evaluate(out, {ta: a, **feeds})
    want = sum(1 for i in np.ndindex(shape) if a[i] == b[i])
    assert_exact(got, np.array([want], np.int64), seed)


# ---------------------------------------------------------------------------
# argsort, top_k


@pytest.mark.parametrize("order", ["asc", "desc"])
@pytest.mark.parametrize("shape,ties", [
    ((3, 1), False), ((3, 5), True), ((2, 3, 13), False), ((4, 100), True), ((2, 2**12), False), ((2, 2**12), True),
])
def test_argsort(rng, seed, order, shape, ties):
    x = (rng.integers(0, 7, shape) if ties else rng.uniform(-1, 1, shape)).astype(np.float32)
    tx, feeds = reversed_view("x", x) if len(shape) == 2 else (input("x", shape), None)
    out = argsort(tx, order)
    assert out.shape == shape and out.dtype.name == "i32"
    (got,) = evaluate(out, feeds or {tx: x})
    want = [sorted(range(len(row)), key=lambda j, row=row: row[j], reverse=order == "desc") for row in rows_of(x)]
    assert_exact(got, np.array(want, np.int32).reshape(shape), seed)


@pytest.mark.parametrize("shape,k", [((5, 13), 1), ((5, 13), 3), ((2, 3, 11), 11), ((2, 300), 7)])
def test_top_k(rng, seed, shape, k):
    x = rng.permuted(np.tile(np.arange(shape[-1], dtype=np.float32), shape[:-1] + (1,)), axis=-1) - 3.5
    tx, feeds = reversed_view("x", x) if len(shape) == 2 else (input("x", shape), None)
    out = top_k(tx, k)
    assert out.shape == shape[:-1] + (k,) and out.dtype.name == "i32"
    (got,) = evaluate(out, feeds or {tx: x})
    for r, (row, idx) in enumerate(zip(rows_of(x), rows_of(got))):
        want = {j for j in range(len(row)) if row[j] >= sorted(row, reverse=True)[k - 1]}  # distinct values
        assert {int(j) for j in idx} == want, f"seed {seed}: row {r}: {sorted(idx)} != {sorted(want)}"


def test_top_k_ties(rng, seed):
    x = rng.integers(0, 4, (6, 17)).astype(np.float32)
    tx = input("x", x.shape)
    (got,) = evaluate(top_k(tx, 5), {tx: x})
    for r, (row, idx) in enumerate(zip(x, got)):
        assert len(set(idx.tolist())) == 5 and all(0 <= j < 17 for j in idx), f"seed {seed}: row {r}: {idx}"
        assert sorted(row[idx]) == sorted(row)[-5:], f"seed {seed}: row {r}: values {row[idx]} are not the top 5"


# ---------------------------------------------------------------------------
# build-time errors


def test_reduce_errors():
    x = input("x", (3, 5))
    cases = [
        (lambda: ops.sum(input("i", (3,), "i32")), r"sum: source dtype i32 not supported .*\['i' \(3,\) i32\]"),
        (lambda: sum_rows(input("h", (3, 5), "f16")), r"sum_rows: source dtype f16 not supported"),
        (lambda: mean(input("q", (3, 32), "q8_0")), r"mean: source dtype q8_0 not supported"),
        (lambda: argmax(input("x3", (2, 3, 5))), r"argmax: expected 1..2 dimensions, got 3 \['x3' \(2, 3, 5\) f32\]"),
        (lambda: count_equal(input("a", (3, 5), "i32"), input("b", (5, 3), "i32")), r"count_equal: shapes differ \['a' \(3, 5\) i32, 'b' \(5, 3\) i32\]"),
        (lambda: count_equal(x, x), r"count_equal: a dtype f32 not supported"),
        (lambda: argsort(x, "up"), r"argsort: order 'up' is not one of asc, desc"),
        (lambda: top_k(x, 6), r"top_k: k = 6 must be in 1..5 \(the row length\) \['x' \(3, 5\) f32\]"),
        (lambda: top_k(x, 0), r"top_k: k = 0 must be in 1..5"),
        (lambda: cumsum(input("x5", (1, 2, 3, 4, 5))), r"cumsum: expected 1..4 dimensions, got 5"),
    ]
    for build, message in cases:
        with pytest.raises(OpError, match=message):
            build()
