"""The reference's edge values (docs/ops.md, "Edge values") against formulas written out per element.

The formulas use Python floats and `math`, one value or row at a time, with the
IEEE cases spelled out (ggml's C where it defines them), on f32 inputs that are
exactly representable: signed zeros, infinities, NaN, subnormals.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.testing.metrics import nmse

from helpers import evaluate

INF, NAN = math.inf, math.nan
TINY = 2.0**-149  # the smallest f32 subnormal
SUB = float(np.float32(1e-40))  # a subnormal exactly as f32 holds it
EDGE_INPUTS = (0.0, -0.0, INF, -INF, NAN, TINY, -TINY, SUB, -SUB, 1.5, -2.5)


def run(build, values: np.ndarray) -> np.ndarray:  # noqa: ANN001 - a builder of ops on one input
    x = od.input("x", values.shape)
    (out,) = evaluate(build(x), {x: values})
    return np.asarray(out, np.float64)


def f32(v: float) -> float:
    return float(np.float32(v)) if math.isfinite(v) else v


def sgn(x: float) -> float:
    return 0.0 if x != x or x == 0 else math.copysign(1.0, x)


def floor_(x: float) -> float:
    return x if not math.isfinite(x) or x == 0 else float(math.floor(x))  # C keeps the sign of a zero


def ceil_(x: float) -> float:
    if not math.isfinite(x) or x == 0:
        return x
    c = math.ceil(x)
    return math.copysign(0.0, x) if c == 0 else float(c)  # ceil(-0.5) = -0


def sqrt_(x: float) -> float:
    return NAN if x != x or x < 0 else (x if x == 0 else math.sqrt(x))  # sqrt(-0) = -0


def log_(x: float) -> float:
    if x != x or x < 0:
        return NAN
    return -INF if x == 0 else math.log(x)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0


def silu(x: float) -> float:
    if x != x:
        return NAN
    return NAN if x == -INF else x * sigmoid(x)


MAPS = {
    "sgn": (ops.sgn, sgn),
    "step": (ops.step, lambda x: 1.0 if x > 0 else 0.0),
    "relu": (ops.relu, lambda x: x if x > 0 else 0.0),
    "floor": (ops.floor, floor_),
    "ceil": (ops.ceil, ceil_),
    "sqrt": (ops.sqrt, sqrt_),
    "log": (ops.log, log_),
    "silu": (ops.silu, silu),
    "exp": (ops.exp, lambda x: NAN if x != x else (0.0 if x == -INF else math.exp(x) if x < 700 else INF)),
    "tanh": (ops.tanh, math.tanh),
}


@pytest.mark.parametrize("op", list(MAPS))
def test_maps_of_edge_values(op: str) -> None:
    build, formula = MAPS[op]
    got = run(build, np.array(EDGE_INPUTS, np.float32))
    want = np.array([f32(formula(x)) for x in EDGE_INPUTS])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=op)
    assert nmse(got, want) <= 1e-12, (op, got, want)
    if op in ("sgn", "step", "floor", "ceil"):  # exact, signs of zeros included
        assert np.array_equal(np.signbit(got), np.signbit(want)), (op, got, want)


def test_div_by_zero_and_infinities() -> None:
    a = od.input("a", (6,))
    b = od.input("b", (6,))
    (got,) = evaluate(ops.div(a, b), {a: np.array([1, -1, 0, INF, INF, 1], np.float32),
                                      b: np.array([0, 0, 0, INF, 2, -INF], np.float32)})
    np.testing.assert_array_equal(got, np.array([INF, -INF, NAN, NAN, INF, -0.0], np.float32))


def softmax_row(row: list[float], sink: float | None = None) -> list[float]:
    """ggml's softmax of one row written out, with the edge answers: nothing to weigh -> zeros, a NaN or +inf -> NaN."""
    logits = row + ([sink] if sink is not None else [])
    if any(v != v or v == INF for v in logits):
        return [NAN] * len(row)
    top = max(logits, default=-INF)
    if top == -INF:
        return [0.0] * len(row)
    total = sum(math.exp(v - top) for v in logits)
    return [math.exp(v - top) / total for v in row]


@pytest.mark.parametrize("scale", [1.0, -1.0])
@pytest.mark.parametrize("sink", [None, 0.25])
def test_soft_max_rows_of_edge_values(scale: float, sink: float | None) -> None:
    rows = [[-INF] * 5, [0.3, NAN, -0.2, 0.0, 1.0], [0.1, INF, -0.5, 0.0, 0.0], [-INF, 0.5, -INF, -INF, 0.25]]
    values = np.array(rows, np.float32).reshape(1, 1, 4, 5)
    x = od.input("x", values.shape)
    sinks = od.input("s", (1,)) if sink is not None else None
    feeds = {x: values, **({sinks: np.array([sink], np.float32)} if sinks is not None else {})}
    (got,) = evaluate(ops.soft_max(x, scale=scale, sinks=sinks), feeds)
    want = np.array([softmax_row([scale * v for v in r], sink) for r in rows]).reshape(values.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert nmse(got, want) <= 1e-12


@pytest.mark.parametrize("shape", [(3, 0), (2, 4, 0), (0, 5)])
def test_soft_max_of_an_empty_tensor_is_empty(shape: tuple[int, ...]) -> None:
    assert run(ops.soft_max, np.zeros(shape, np.float32)).shape == shape


def test_flash_attn_ext_skips_hidden_keys_and_zeros_empty_rows(rng: np.random.Generator) -> None:
    d, n_kv, n_q = 16, 12, 4
    q = rng.uniform(-1, 1, (1, 1, n_q, d))
    k = rng.uniform(-1, 1, (1, 1, n_kv, d))
    v = rng.uniform(-1, 1, (1, 1, n_kv, d))
    k[..., 3:6, :] = NAN  # garbage under the mask
    mask = rng.uniform(-1, 1, (1, 1, n_q, n_kv)).astype(np.float16).astype(np.float64)  # f16 values: fed exactly
    mask[..., 3:6] = -INF
    mask[..., 1, :] = -INF  # query row 1 sees nothing
    tq, tk, tv, tm = (od.input(n, a.shape, dt) for n, a, dt in
                      (("q", q, "f32"), ("k", k, "f32"), ("v", v, "f32"), ("m", mask, "f16")))
    (got,) = evaluate(ops.flash_attn_ext(tq, tk, tv, tm, 0.5), {tq: q, tk: k, tv: v, tm: mask})
    m16 = mask.astype(np.float16).astype(np.float64)
    for t in range(n_q):
        seen = [j for j in range(n_kv) if m16[0, 0, t, j] != -INF]
        w = softmax_row([0.5 * float(np.dot(q[0, 0, t], k[0, 0, j])) + m16[0, 0, t, j] for j in seen])
        want = sum((wj * v[0, 0, j] for wj, j in zip(w, seen)), np.zeros(d))
        assert np.isfinite(got[0, t, 0]).all() and nmse(got[0, t, 0], want) <= 1e-10, t


NORM_ROWS = [[0.0] * 6, [0.5, -0.3, INF, 0.7, 1.0, 2.0], [NAN, 1.0, 2.0, -1.0, 0.5, 0.0]]


def norm_row(op: str, row: list[float], eps: float) -> list[float]:
    """One row of norm / rms_norm / l2_norm as ggml's CPU computes it (C's fmaxf for l2_norm)."""
    n = len(row)
    if op == "norm":
        mean = sum(row) / n
        dev = [x - mean for x in row]
        scale = 1.0 / math.sqrt(sum(d * d for d in dev) / n + eps)
        return [d * scale for d in dev]
    if op == "rms_norm":
        ms = sum(x * x for x in row) / n
        return [x / math.sqrt(ms + eps) for x in row]
    norm = math.sqrt(sum(x * x for x in row))
    return [x / (eps if norm != norm else max(norm, eps)) for x in row]  # fmaxf drops a NaN norm


@pytest.mark.parametrize(("op", "eps"), [("norm", 1e-5), ("rms_norm", 1e-6), ("l2_norm", 1e-30), ("l2_norm", 1e-12)])
def test_norms_of_zero_inf_and_nan_rows(op: str, eps: float) -> None:
    got = run(lambda x: getattr(ops, op)(x, eps), np.array(NORM_ROWS, np.float32))
    with np.errstate(all="ignore"):
        want = np.array([norm_row(op, r, float(np.float32(eps))) for r in NORM_ROWS], np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=op)
    assert nmse(got, want) <= 1e-12
    assert (got[0] == 0).all(), "a zero row gives zeros"


def argmax_row(row: list[float]) -> int:
    """The last index of the largest value that is not NaN; 0 for a row of NaN."""
    best, at = -INF, -1
    for i, x in enumerate(row):
        if x == x and x >= best:
            best, at = x, i
    return max(at, 0)


def test_argmax_of_nan_ties_and_infinities() -> None:
    rows = [[1, NAN, 1, 0, -1], [NAN] * 5, [-INF, NAN, -INF, NAN, NAN], [2, 2, NAN, 1, 2], [-INF] * 5, [0.0, -0.0, NAN, -1, -0.0]]
    got = run(ops.argmax, np.array(rows, np.float32))
    assert got.tolist() == [argmax_row(r) for r in rows]


def order(row: list[float], desc: bool) -> list[int]:
    """Indices by value, NaN last in either order, -0 tying +0, ties by index."""
    def key(i: int) -> tuple[int, float, int]:
        x = row[i]
        return (1, 0.0, i) if x != x else (0, (-x if desc else x) + 0.0, i)

    return sorted(range(len(row)), key=key)


def test_argsort_and_top_k_order_edge_values(rng: np.random.Generator) -> None:
    pool = np.array([NAN, INF, -INF, 0.0, -0.0, TINY, -TINY, 1.0, -1.0, 2.0])
    values = rng.choice(pool, (4, 40)).astype(np.float32)
    rows = values.astype(np.float64).tolist()
    for desc in (False, True):
        got = run(lambda x: ops.argsort(x, "desc" if desc else "asc"), values)
        assert got.astype(int).tolist() == [order(r, desc) for r in rows], desc
    got = run(lambda x: ops.top_k(x, 7), values)
    assert np.sort(got, -1).astype(int).tolist() == [sorted(order(r, True)[:7]) for r in rows]


def test_sums_of_infinities_and_nan() -> None:
    rows = [[0.5, INF, 0.25], [0.5, INF, -INF], [0.3, NAN, 1.0], [-INF, 1.0, 2.0]]
    values = np.array(rows, np.float32)
    sums = run(ops.sum_rows, values)[:, 0]
    np.testing.assert_array_equal(sums, [INF, NAN, NAN, -INF])
    prefix = run(ops.cumsum, values)
    want = []
    for r in rows:
        acc, out = 0.0, []
        for x in r:
            acc = NAN if (acc == INF and x == -INF) or (acc == -INF and x == INF) else acc + x
            out.append(acc)
        want.append(out)
    np.testing.assert_array_equal(prefix, np.array(want, np.float32))


def test_nmse_passes_nan_only_where_the_reference_has_it() -> None:
    ref = np.array([1.0, NAN, INF, 2.0])
    assert nmse(np.array([1.0, NAN, INF, 2.0]), ref) == 0.0
    assert nmse(np.array([1.0, 0.0, INF, 2.0]), ref) == INF  # no NaN where the reference has one
    assert nmse(np.array([NAN, NAN, INF, 2.0]), ref) == INF  # a NaN where it has none
    assert nmse(np.array([1.0, NAN, -INF, 2.0]), ref) == INF  # an infinity of the other sign
