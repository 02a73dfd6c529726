"""Reference kernels of the layout ops (concat, repeat, pad, pad_reflect_1d, roll,
arange, fill, diag, tri, timestep_embedding) against independent formulas: slice
assignment, modulo gathers and python loops over small odd shapes.

Random inputs come from a fresh seed each run, printed in failure messages;
set OPDISPATCH_TEST_SEED to replay one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import evaluate, nmse
from opdispatch import dtypes as D
from opdispatch.errors import OpError
from opdispatch.ops import arange, concat, diag, fill, pad, pad_reflect_1d, repeat, roll, timestep_embedding, tri
from opdispatch.tensor import Tensor, input, param

HOST = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i16": np.int16}


def values(rng: np.random.Generator, shape: tuple[int, ...], dt: str = "f32") -> np.ndarray:
    if dt in ("i32", "i16"):
        return rng.integers(-1000, 1000, shape).astype(HOST[dt])
    return rng.uniform(-1, 1, shape).astype(HOST[dt])


def reversed_view(name: str, vals: np.ndarray, dt: str = "f32") -> tuple[Tensor, dict]:
    """vals as a non-contiguous tensor (the axis-reversing permute of an input) and its feed."""
    axes = tuple(range(vals.ndim))[::-1]
    leaf = input(name, vals.shape[::-1], dt)
    return leaf.permute(*axes), {leaf: np.transpose(vals, axes)}


def assert_exact(got: np.ndarray, want: np.ndarray, seed: int) -> None:
    assert got.shape == want.shape, f"seed {seed}: shape {got.shape} != {want.shape}"
    assert np.any(want != 0), f"seed {seed}: vacuous check, all-zero expectation"
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"seed {seed}: {len(bad)} elements differ, first at {tuple(bad[0])}"


def assert_close(got: np.ndarray, want: np.ndarray, seed: int, bound: float = 1e-7) -> None:
    assert got.shape == want.shape, f"seed {seed}: shape {got.shape} != {want.shape}"
    assert np.any(want != 0), f"seed {seed}: vacuous check, all-zero expectation"
    err = nmse(got, want)
    assert err <= bound, f"seed {seed}: NMSE {err:.3g} > {bound:g}"


# ---------------------------------------------------------------------------
# concat


CONCAT_CASES = [(shape, axis) for shape in [(5,), (3, 7), (2, 3, 5), (2, 3, 1, 5)] for axis in range(len(shape))]


@pytest.mark.parametrize("dt", ["f32", "f16", "i32"])
@pytest.mark.parametrize("shape,axis", CONCAT_CASES)
def test_concat(rng, seed, dt, shape, axis):
    b_shape = tuple(n + 2 if i == axis else n for i, n in enumerate(shape))
    a, b = values(rng, shape, dt), values(rng, b_shape, dt)
    ta = input("a", shape, dt)
    tb, feeds = reversed_view("b", b, dt)
    out = concat(ta, tb, axis - len(shape))  # negative axes count from the end
    (got,) = evaluate(out, {ta: a, **feeds})
    want = np.zeros(tuple(n + m if i == axis else n for i, (n, m) in enumerate(zip(shape, b_shape))), a.dtype)
    cut = [slice(None)] * len(shape)
    cut[axis] = slice(0, shape[axis])
    want[tuple(cut)] = a
    cut[axis] = slice(shape[axis], None)
    want[tuple(cut)] = b
    assert_exact(got, want, seed)


@pytest.mark.parametrize("axis", [0, 2])
def test_concat_quant(rng, seed, axis):
    a_shape, b_shape = (2, 3, 64), ((1, 3, 64) if axis == 0 else (2, 3, 32))
    raw_a = D.quantize("q8_0", rng.uniform(-1, 1, a_shape))
    raw_b = D.quantize("q8_0", rng.uniform(-1, 1, b_shape))
    ta = param("a", raw_a, "q8_0", shape=a_shape)
    tb = param("b", raw_b, "q8_0", shape=b_shape)
    (got,) = evaluate(concat(ta, tb, axis))
    want = np.zeros(raw_a.shape[:axis] + (raw_a.shape[axis] + raw_b.shape[axis],) + raw_a.shape[axis + 1:], np.uint8)
    want[(slice(None),) * axis + (slice(0, raw_a.shape[axis]),)] = raw_a
    want[(slice(None),) * axis + (slice(raw_a.shape[axis], None),)] = raw_b
    assert_exact(got, want, seed)


# ---------------------------------------------------------------------------
# repeat, pad, pad_reflect_1d, roll


@pytest.mark.parametrize("dt", ["f32", "f16", "i32", "i16"])
@pytest.mark.parametrize("shape,target", [
    ((3,), (2, 6)),
    ((2, 3), (4, 9)),
    ((1, 3, 1, 5), (2, 3, 4, 10)),
    ((5, 7), (5, 7)),
])
def test_repeat(rng, seed, dt, shape, target):
    a = values(rng, shape, dt)
    ta, feeds = reversed_view("a", a, dt)
    (got,) = evaluate(repeat(ta, target), feeds)
    padded = a.reshape((1,) * (len(target) - a.ndim) + a.shape)
    want = padded[np.ix_(*[np.arange(n) % m for n, m in zip(target, padded.shape)])]  # out[i] = a[i % n]
    assert_exact(got, want, seed)


@pytest.mark.parametrize("shape,pads", [
    ((7,), ((3, 2),)),
    ((3, 5), ((1, 2), (0, 3))),
    ((2, 3, 5), ((0, 1), (2, 0), (1, 1))),
    ((2, 1, 3, 5), ((1, 0), (0, 2), (0, 0), (3, 1))),
])
def test_pad(rng, seed, shape, pads):
    x = values(rng, shape)
    tx, feeds = reversed_view("x", x)
    (got,) = evaluate(pad(tx, pads), feeds)
    want = np.zeros(tuple(n + lo + hi for n, (lo, hi) in zip(shape, pads)), np.float32)
    want[tuple(slice(lo, lo + n) for n, (lo, _) in zip(shape, pads))] = x
    assert_exact(got, want, seed)


@pytest.mark.parametrize("shape,p0,p1", [((9,), 1, 1), ((3, 7), 2, 6), ((2, 3, 5), 4, 0), ((2, 2, 3, 5), 0, 3)])
def test_pad_reflect_1d(rng, seed, shape, p0, p1):
    x = values(rng, shape)
    tx, feeds = reversed_view("x", x)
    (got,) = evaluate(pad_reflect_1d(tx, p0, p1), feeds)
    n = shape[-1]
    want = np.empty(shape[:-1] + (n + p0 + p1,), np.float32)
    for j in range(n + p0 + p1):
        src = abs(j - p0)  # mirror at the first element
        if src >= n:
            src = 2 * (n - 1) - src  # mirror at the last element
        want[..., j] = x[..., src]
    assert_exact(got, want, seed)


@pytest.mark.parametrize("shape,shifts", [
    ((7,), (-6,)),
    ((5, 7), (-2, 3)),
    ((2, 3, 5), (1, -2, -4)),
    ((2, 3, 4, 5), (-1, 2, -3, 4)),
])
def test_roll(rng, seed, shape, shifts):
    x = values(rng, shape)
    tx, feeds = reversed_view("x", x)
    (got,) = evaluate(roll(tx, shifts), feeds)
    want = np.empty_like(x)
    for i in np.ndindex(shape):
        want[i] = x[tuple((k - s) % n for k, s, n in zip(i, shifts, shape))]
    assert_exact(got, want, seed)


# ---------------------------------------------------------------------------
# arange, fill, diag, tri, timestep_embedding


@pytest.mark.parametrize("start,stop,step,count", [
    (0, 10, 1, 10), (-3.5, 7.25, 0.75, 15), (0, 1, 0.1, 10), (5, 6, 0.25, 4), (2, 2.5, 1, 1),
])
def test_arange(seed, start, stop, step, count):
    out = arange(start, stop, step)
    assert out.srcs == () and out.shape == (count,) and out.dtype.name == "f32"
    (got,) = evaluate(out)
    assert_close(got, np.array([start + step * i for i in range(count)]), seed)


@pytest.mark.parametrize("dt,value", [("f32", -2.5), ("f16", 0.1), ("f32", 7.0)])
def test_fill(rng, seed, dt, value):
    x = values(rng, (3, 5, 7), dt)
    tx, feeds = reversed_view("x", x, dt)
    (got,) = evaluate(fill(tx, value), feeds)
    assert_exact(got, np.full((3, 5, 7), value, HOST[dt]), seed)


@pytest.mark.parametrize("shape", [(7,), (1, 5), (3, 1, 5), (2, 3, 1, 4)])
def test_diag(rng, seed, shape):
    x = values(rng, shape)
    tx, feeds = reversed_view("x", x)
    out = diag(tx)
    n = shape[-1]
    assert out.shape == shape[:-2] + (n, n)
    (got,) = evaluate(out, feeds)
    rows = x.reshape(-1, n)
    want = np.zeros((rows.shape[0], n, n), np.float32)
    for b in range(rows.shape[0]):
        for i in range(n):
            want[b, i, i] = rows[b, i]
    assert_exact(got, want.reshape(out.shape), seed)


KEEP = {
    "lower": lambda col, row: col < row,
    "lower_diag": lambda col, row: col <= row,
    "upper": lambda col, row: col > row,
    "upper_diag": lambda col, row: col >= row,
}


@pytest.mark.parametrize("kind", list(KEEP))
@pytest.mark.parametrize("shape", [(5, 5), (2, 7, 7), (2, 3, 4, 4)])
def test_tri(rng, seed, kind, shape):
    x = values(rng, shape)
    tx, feeds = reversed_view("x", x)
    (got,) = evaluate(tri(tx, kind), feeds)
    want = np.zeros_like(x)
    for i in np.ndindex(shape):
        if KEEP[kind](i[-1], i[-2]):
            want[i] = x[i]
    assert_exact(got, want, seed)


@pytest.mark.parametrize("dim,max_period", [(8, 10000), (7, 10000), (3, 100), (16, 50)])
def test_timestep_embedding(rng, seed, dim, max_period):
    t = rng.uniform(0, 1000, 5).astype(np.float32)
    tt = input("t", (5,))
    out = timestep_embedding(tt, dim, max_period)
    assert out.shape == (5, dim)
    (got,) = evaluate(out, {tt: t})
    half = dim // 2
    want = np.zeros((5, dim))
    for i in range(5):
        for j in range(half):
            arg = float(t[i]) * math.exp(-math.log(max_period) * j / half)
            want[i, j], want[i, j + half] = math.cos(arg), math.sin(arg)
    assert_close(got, want, seed)


# ---------------------------------------------------------------------------
# build-time errors


def test_layout_errors():
    a = input("a", (3, 5))
    cases = [
        (lambda: concat(a, input("b", (3, 5), "f16"), 0), r"concat: dtypes differ: f32 vs f16 \['a' \(3, 5\) f32, 'b' \(3, 5\) f16\]"),
        (lambda: concat(a, input("b", (4, 6)), 0), r"concat: shapes differ outside axis 0 .*\(4, 6\)"),
        (lambda: concat(a, input("b", (3, 5)), 2), r"concat: axis 2 out of range for 2 axes"),
        (lambda: repeat(a, (6, 7)), r"repeat: target shape \(6, 7\) is not a multiple of a's shape \['a' \(3, 5\) f32\]"),
        (lambda: repeat(input("q", (3, 32), "q8_0"), (6, 32)), r"repeat: source dtype q8_0 not supported"),
        (lambda: pad(a, ((1, 1),)), r"pad: 1 \(before, after\) pairs for 2 axes"),
        (lambda: pad(a, ((1, 1), (0, -1))), r"pad: negative padding"),
        (lambda: pad(input("h", (3, 5), "f16"), ((0, 0), (0, 1))), r"pad: source dtype f16 not supported"),
        (lambda: pad_reflect_1d(a, 5, 0), r"pad_reflect_1d: padding \(5, 0\) must be non-negative and less than the last axis 5"),
        (lambda: roll(a, (3, 0)), r"roll: each \|shift\| must be less than its axis length, got \(3, 0\)"),
        (lambda: roll(a, (1,)), r"roll: shifts needs 2 entries"),
        (lambda: arange(3, 1, 1), r"arange: needs stop > start and step > 0"),
        (lambda: arange(0, 1, -1), r"arange: needs stop > start and step > 0"),
        (lambda: fill(input("i", (3,), "i32"), 1.0), r"fill: source dtype i32 not supported"),
        (lambda: diag(input("m", (2, 5))), r"diag: expected a row per matrix \(axis -2 of size 1\), got 2"),
        (lambda: tri(a, "lower"), r"tri: matrices must be square, got \(3, 5\)"),
        (lambda: tri(input("s", (4, 4)), "strict"), r"tri: kind 'strict' is not one of lower, upper"),
        (lambda: timestep_embedding(input("t2", (2, 3)), 8), r"timestep_embedding: expected 1..1 dimensions, got 2"),
        (lambda: timestep_embedding(input("t1", (3,)), 0), r"timestep_embedding: dim and max_period must be positive"),
    ]
    for build, message in cases:
        with pytest.raises(OpError, match=message):
            build()
