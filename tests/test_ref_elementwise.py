"""Reference kernels of the elementwise, unary and glu ops vs independent formulas.

Expected values are computed per element in float64 with Python's math module
(or explicit index arithmetic) from the inputs as stored, i.e. already rounded
to the source dtype. NMSE bounds are the square of the output dtype's unit
roundoff u (the largest relative error of one rounding): f16 u = 2**-11 ->
2**-22 ~ 2.4e-7, bf16 u = 2**-8 -> 2**-16 ~ 1.5e-5; f32 results are held to
1e-12 (one f32 rounding gives at most 2**-48 ~ 3.6e-15).
"""

from __future__ import annotations

import math
import operator
from decimal import ROUND_HALF_UP, Decimal
from typing import Callable, Sequence

import ml_dtypes
import numpy as np
import pytest
from helpers import evaluate, nmse

import opdispatch as od
from opdispatch import ops
from opdispatch.errors import OpError
from opdispatch.tensor import Tensor

NP_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
BOUND = {"f32": 1e-12, "f16": 2.0**-22, "bf16": 2.0**-16}
LAYOUTS = ("contig", "permuted", "padded")


# -- helpers shared with test_ref_norm.py ------------------------------------------


def stored(values: np.ndarray, dt: str) -> np.ndarray:
    """values as a tensor of dtype dt holds them (float64): f32 first, then f16/bf16, like ggml."""
    return np.asarray(values, np.float64).astype(np.float32).astype(NP_DTYPES[dt]).astype(np.float64)


def source(
    name: str, values: np.ndarray, dt: str, layout: str, gen: np.random.Generator
) -> tuple[Tensor, dict[Tensor, np.ndarray]]:
    """An input tensor holding `values` (already representable in dt), laid out as asked.

    contig: a plain leaf. permuted: a permute (or, in 1-D, a stride-2 view) of a
    leaf, so rows are not contiguous. outer: a permute of the outer axes only
    (rows stay contiguous). padded: a view with gaps between rows and a one
    element offset. Returns the tensor and the feed of its leaf; leaf elements
    outside the view hold random values that must not leak into results.
    """
    values = np.asarray(values, np.float64)
    shape = values.shape
    if layout == "contig":
        leaf = od.input(name, shape, dt)
        return leaf, {leaf: values}
    if layout == "permuted" and values.ndim == 1:
        leaf = od.input(name, (2 * shape[0],), dt)
        feed = stored(gen.uniform(-1e3, 1e3, 2 * shape[0]), dt)
        feed[::2] = values
        return leaf.view(shape, (2 * leaf.strides[0],)), {leaf: feed}
    if layout in ("permuted", "outer"):
        n_perm = values.ndim - (layout == "outer")
        assert n_perm >= 2, f"layout {layout} needs more dimensions than {shape}"
        axes = tuple(gen.permutation(n_perm)) + tuple(range(n_perm, values.ndim))
        if axes == tuple(range(values.ndim)):
            axes = (1, 0) + axes[2:]
        leaf = od.input(name, tuple(shape[i] for i in np.argsort(axes)), dt)
        return leaf.permute(*axes), {leaf: np.transpose(values, np.argsort(axes))}
    assert layout == "padded", layout
    leaf = od.input(name, shape[:-1] + (shape[-1] + 3,), dt)
    feed = stored(gen.uniform(-1e3, 1e3, leaf.shape), dt)
    feed[..., 1 : shape[-1] + 1] = values
    return leaf.view(shape, leaf.strides, offset=leaf.strides[-1]), {leaf: feed}


def assert_close(out: np.ndarray, want: np.ndarray, bound: float, seed: int, what: str) -> None:
    """NMSE within bound (NaN fails), and the kernel wrote the output (it starts as zeros)."""
    assert out.shape == want.shape, f"{what}: shape {out.shape} != {want.shape} (seed {seed})"
    err = nmse(out, want)
    assert err <= bound, f"{what}: NMSE {err:.3g} > {bound:.3g} (seed {seed})"
    assert np.any(out != 0) or not np.any(want != 0), f"{what}: output left all zero (seed {seed})"


def per_element(fn: Callable[..., float], *arrays: np.ndarray) -> np.ndarray:
    """fn applied with plain Python floats, element by element."""
    flat = [a.ravel().tolist() for a in arrays]
    return np.array([fn(*vs) for vs in zip(*flat)], np.float64).reshape(arrays[0].shape)


def _sigmoid(v: float) -> float:
    # tanh form: a different evaluation from the kernels' 1 / (1 + exp(-x))
    return 0.5 * (1.0 + math.tanh(0.5 * v))


def _round_half_away(v: float) -> float:
    return float(Decimal(v).quantize(Decimal(1), rounding=ROUND_HALF_UP))


UNARY: dict[str, Callable[[float], float]] = {
    "abs": lambda v: -v if v < 0 else v,
    "sgn": lambda v: 0.0 if v == 0 else math.copysign(1.0, v),
    "neg": lambda v: -v,
    "step": lambda v: 1.0 if v > 0 else 0.0,
    "tanh": math.tanh,
    "elu": lambda v: v if v > 0 else math.expm1(v),
    "relu": lambda v: max(v, 0.0),
    "sigmoid": _sigmoid,
    "gelu": lambda v: 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3))),
    "gelu_erf": lambda v: 0.5 * v * math.erfc(-v / math.sqrt(2.0)),
    "gelu_quick": lambda v: v * _sigmoid(1.702 * v),
    "silu": lambda v: v * _sigmoid(v),
    "hardswish": lambda v: v * min(max(v + 3.0, 0.0), 6.0) / 6.0,
    "hardsigmoid": lambda v: min(max(v + 3.0, 0.0), 6.0) / 6.0,
    "exp": math.exp,
    "expm1": math.expm1,
    "softplus": lambda v: max(v, 0.0) + math.log1p(math.exp(-abs(v))),
    "floor": lambda v: float(math.floor(v)),
    "ceil": lambda v: float(math.ceil(v)),
    "round": _round_half_away,
    "trunc": lambda v: float(math.trunc(v)),
}

#: values where round/sgn/step/relu... have their edge cases
SPECIAL = (0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997, 3.0, -3.0)


# -- binary ops ------------------------------------------------------------------

BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}

#: (a shape, b shape) with R, C and C/2 symbolic: broadcasting over every axis
BROADCASTS = [
    ((4, 6, "R", "C"), (4, 6, "R", "C")),
    ((4, 6, "R", "C"), ("C",)),
    ((4, 6, "R", "C"), (1, "C")),
    ((4, 6, "R", "C"), ("R", 1)),
    ((4, 6, "R", "C"), (2, 1, "C")),
    ((4, 6, "R", "C"), (2, 1, 1, "C")),
    ((4, 6, "R", "C"), (4, 1, "R", 1)),
    ((4, 6, "R", "C"), (1, 3, 1, 1)),
    ((4, 6, "R", "C"), (2, 3, "R", "C/2")),
    ((4, 6, "R", "C"), (1,)),
    (("R", "C"), ("C/2",)),
    (("C",), ("C",)),
]


def _dims(template: Sequence, r: int, c: int) -> tuple[int, ...]:
    sizes = {"R": r, "C": c, "C/2": c // 2}
    return tuple(sizes.get(d, d) for d in template)


def _binary_inputs(op_name: str, a_shape: tuple, b_shape: tuple, dta: str, dtb: str, gen: np.random.Generator):
    a = stored(gen.uniform(-1, 1, a_shape), dta)
    if op_name == "div":  # divisors away from zero, either sign
        b = gen.uniform(0.5, 2.0, b_shape) * gen.choice([-1.0, 1.0], b_shape)
    else:
        b = gen.uniform(-1, 1, b_shape)
    return a, stored(b, dtb)


def _binary_expected(op_name: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """b indexed by i % b.shape in every axis (explicit index arithmetic, not tiling)."""
    b = b.reshape((1,) * (a.ndim - b.ndim) + b.shape)
    index = np.ix_(*(np.arange(n) % m for n, m in zip(a.shape, b.shape)))
    return BINARY[op_name](a, b[index])


def _run_binary(op_name, a_shape, b_shape, dta, dtb, layouts, gen, seed):
    a, b = _binary_inputs(op_name, a_shape, b_shape, dta, dtb, gen)
    ta, feed_a = source("a", a, dta, layouts[0], gen)
    tb, feed_b = source("b", b, dtb, layouts[1], gen)
    y = getattr(ops, op_name)(ta, tb)
    assert y.op == op_name and y.shape == a_shape and y.dtype.name == dta
    (out,) = evaluate(y, {**feed_a, **feed_b})
    what = f"{op_name} a {a_shape} {dta} {layouts[0]}, b {b_shape} {dtb} {layouts[1]}"
    assert_close(out.astype(np.float64), _binary_expected(op_name, a, b), BOUND[dta], seed, what)


@pytest.mark.parametrize("layouts", [("contig", "contig"), ("permuted", "permuted"), ("padded", "permuted")])
@pytest.mark.parametrize("shapes", BROADCASTS, ids=lambda s: f"{s[0]}<-{s[1]}".replace(" ", ""))
@pytest.mark.parametrize("op_name", list(BINARY))
def test_binary_broadcast(op_name, shapes, layouts, rng, seed):
    gen = rng
    r, c = int(gen.choice([5, 7, 11])), int(gen.choice([10, 14, 26]))
    _run_binary(op_name, _dims(shapes[0], r, c), _dims(shapes[1], r, c), "f32", "f32", layouts, gen, seed)


@pytest.mark.parametrize("dtypes", [("f16", "f16"), ("bf16", "bf16"), ("f16", "f32"), ("f32", "bf16"), ("bf16", "f16")])
@pytest.mark.parametrize("op_name", list(BINARY))
def test_binary_dtypes(op_name, dtypes, rng, seed):
    gen = rng
    for a_shape, b_shape in [((3, 7, 13), (7, 1)), ((2, 5, 11), (2, 5, 11))]:
        _run_binary(op_name, a_shape, b_shape, *dtypes, ("permuted", "padded"), gen, seed)


# -- add1, add_id ------------------------------------------------------------------


@pytest.mark.parametrize("dtypes", [("f32", "f32"), ("f16", "f32"), ("bf16", "bf16")])
@pytest.mark.parametrize("b_shape", [(1,), (1, 1, 1)])
def test_add1(dtypes, b_shape, rng, seed):
    gen = rng
    dta, dtb = dtypes
    a = stored(gen.uniform(-1, 1, (3, 5, 7)), dta)
    b = stored(gen.uniform(-1, 1, b_shape), dtb)
    ta, feed_a = source("a", a, dta, "permuted", gen)
    tb, feed_b = source("b", b, dtb, "contig", gen)
    (out,) = evaluate(ops.add1(ta, tb), {**feed_a, **feed_b})
    want = per_element(lambda v: v + b.ravel()[0], a)
    assert_close(out.astype(np.float64), want, BOUND[dta], seed, f"add1 {dta} + {dtb} {b_shape}")


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("layout", ["contig", "permuted"])
def test_add_id(dt, layout, rng, seed):
    gen = rng
    t, u, c, e = 5, 3, 7, 4
    a = stored(gen.uniform(-1, 1, (t, u, c)), dt)
    b = stored(gen.uniform(-1, 1, (e, c)), dt)
    ids = gen.integers(0, e, (t, u))
    ta, feed_a = source("a", a, dt, layout, gen)
    tb, feed_b = source("b", b, dt, layout, gen)
    tids = od.input("ids", (t, u), "i32")
    y = ops.add_id(ta, tb, tids)
    (out,) = evaluate(y, {**feed_a, **feed_b, tids: ids})
    want = np.zeros((t, u, c))
    for i in range(t):
        for j in range(u):
            for k in range(c):
                want[i, j, k] = a[i, j, k] + b[ids[i, j], k]
    assert_close(out.astype(np.float64), want, BOUND[dt], seed, f"add_id {dt} {layout}")


def test_add_id_rejects_ids_out_of_range():
    a, b, ids = od.input("a", (2, 3, 4)), od.input("b", (5, 4)), od.input("ids", (2, 3), "i32")
    with pytest.raises(ValueError, match=r"add_id: ids must lie in \[0, 5\)"):
        evaluate(ops.add_id(a, b, ids), {a: np.ones((2, 3, 4)), b: np.ones((5, 4)), ids: np.full((2, 3), 5)})


# -- unary and parameterless maps -------------------------------------------------


def test_unary_ops_listed():
    assert set(ops.UNARY_OPS) == set(UNARY)
    for name in ops.UNARY_OPS:
        assert ops.OPS[name].family == "unary" and ops.OPS[name].doc


def _map_case(name: str, formula: Callable[[float], float], values: np.ndarray, dt: str, layout: str, gen, seed):
    x = stored(values, dt)
    tx, feed = source("x", x, dt, layout, gen)
    y = getattr(ops, name)(tx)
    assert y.op == name and y.shape == x.shape and y.dtype.name == dt
    (out,) = evaluate(y, feed)
    assert_close(out.astype(np.float64), per_element(formula, x), BOUND[dt], seed, f"{name} {dt} {layout}")
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dt", list(NP_DTYPES))
@pytest.mark.parametrize("name", list(UNARY))
def test_unary(name, dt, layout, rng, seed):
    gen = rng
    values = gen.uniform(-10, 10, (3, 5, 7))
    values.flat[: len(SPECIAL)] = SPECIAL
    _map_case(name, UNARY[name], values, dt, layout, gen, seed)


def test_unary_edge_points(rng, seed):
    """round: halves away from zero; sgn/step/relu at 0 and at the signs (exact)."""
    gen = rng
    x = np.array([-2.5, -1.5, -0.5, -0.49999997, 0.0, 0.49999997, 0.5, 1.5, 2.5])
    want = {
        "round": [-3, -2, -1, -0.0, 0, 0, 1, 2, 3],
        "sgn": [-1, -1, -1, -1, 0, 1, 1, 1, 1],
        "step": [0, 0, 0, 0, 0, 1, 1, 1, 1],
        "trunc": [-2, -1, -0.0, -0.0, 0, 0, 0, 1, 2],
    }
    for name, expected in want.items():
        out = _map_case(name, UNARY[name], x, "f32", "contig", gen, seed)
        np.testing.assert_array_equal(out, np.array(expected, np.float32), err_msg=name)


MAPS: dict[str, tuple[Callable[[float], float], tuple[float, float]]] = {
    "sqr": (lambda v: v * v, (-10, 10)),
    "sqrt": (math.sqrt, (0.01, 10)),
    "log": (math.log, (0.01, 10)),
    "sin": (math.sin, (-10, 10)),
    "cos": (math.cos, (-10, 10)),
}


@pytest.mark.parametrize("dt", list(NP_DTYPES))
@pytest.mark.parametrize("name", list(MAPS))
def test_maps(name, dt, rng, seed):
    gen = rng
    formula, (lo, hi) = MAPS[name]
    for layout, shape in [("contig", (11,)), ("permuted", (2, 5, 7)), ("padded", (3, 13))]:
        _map_case(name, formula, gen.uniform(lo, hi, shape), dt, layout, gen, seed)


@pytest.mark.parametrize("dt", list(NP_DTYPES))
def test_scale_clamp_leaky_relu(dt, rng, seed):
    gen = rng
    x = stored(gen.uniform(-10, 10, (4, 5, 7)), dt)
    tx, feed = source("x", x, dt, "permuted", gen)
    s, bias = float(gen.uniform(-3, 3)), float(gen.uniform(-3, 3))
    lo, hi = sorted(gen.uniform(-8, 8, 2).tolist())
    slope = float(gen.uniform(0.01, 0.5))
    cases = [
        (ops.scale(tx, s), lambda v: v * s),
        (ops.scale(tx, s, bias), lambda v: v * s + bias),
        (ops.clamp(tx, lo, hi), lambda v: min(max(v, lo), hi)),
        (ops.clamp(tx, hi, lo), lambda v: hi),  # min > max: ggml's order lets min win
        (ops.leaky_relu(tx), lambda v: v if v > 0 else 0.01 * v),
        (ops.leaky_relu(tx, slope), lambda v: v if v > 0 else slope * v),
    ]
    outs = evaluate([y for y, _ in cases], feed)
    for (y, formula), out in zip(cases, outs):
        assert y.shape == x.shape and y.dtype.name == dt
        want = per_element(formula, x)
        assert_close(out.astype(np.float64), want, BOUND[dt], seed, f"{y.op} {y.params} {dt}")


# -- glu -------------------------------------------------------------------------


def _glu_formula(kind: str, alpha: float, limit: float) -> Callable[[float, float], float]:
    if kind == "swiglu_oai":
        def oai(g: float, u: float) -> float:
            g = min(g, limit)
            return g * _sigmoid(alpha * g) * (min(max(u, -limit), limit) + 1.0)
        return oai
    act = UNARY[{"reglu": "relu", "geglu": "gelu", "swiglu": "silu"}.get(kind, kind.replace("geglu", "gelu"))]
    return lambda g, u: act(g) * u


@pytest.mark.parametrize("layout", ["contig", "padded", "outer"])  # glu needs contiguous rows
@pytest.mark.parametrize("dt", list(NP_DTYPES))
@pytest.mark.parametrize("mode", ["fused", "swapped", "split"])
@pytest.mark.parametrize("kind", ops.GLU_KINDS)
def test_glu(kind, mode, dt, layout, rng, seed):
    gen = rng
    shape = (2, 3, 7)  # gate/up rows of 7: odd
    gate = stored(gen.uniform(-10, 10, shape), dt)  # beyond swiglu_oai's limit of 7
    up = stored(gen.uniform(-10, 10, shape), dt)
    if mode == "split":
        ta, feed_a = source("a", gate, dt, layout, gen)
        tb, feed_b = source("b", up, dt, "padded", gen)
        y = ops.glu_split(ta, tb, kind)
        feeds = {**feed_a, **feed_b}
        assert y.srcs == (ta, tb)
    else:
        halves = (up, gate) if mode == "swapped" else (gate, up)
        tx, feeds = source("x", np.concatenate(halves, axis=-1), dt, layout, gen)
        y = ops.glu(tx, kind, swapped=mode == "swapped")
        assert y.srcs == (tx, None)
    assert y.op == "glu" and y.shape == shape and y.dtype.name == dt
    assert y.params == {"kind": kind, "swapped": mode == "swapped", "alpha": 1.702, "limit": 7.0}
    (out,) = evaluate(y, feeds)
    want = per_element(_glu_formula(kind, 1.702, 7.0), gate, up)
    assert_close(out.astype(np.float64), want, BOUND[dt], seed, f"glu {kind} {mode} {dt} {layout}")


@pytest.mark.parametrize("swapped", [False, True])
def test_glu_swiglu_oai_params(swapped, rng, seed):
    gen = rng
    alpha, limit = float(gen.uniform(0.5, 2)), float(gen.uniform(1, 4))
    x = stored(gen.uniform(-6, 6, (5, 2 * 11)), "f32")
    tx = od.input("x", x.shape)
    (out,) = evaluate(ops.glu(tx, "swiglu_oai", swapped, alpha=alpha, limit=limit), {tx: x})
    gate, up = (x[:, 11:], x[:, :11]) if swapped else (x[:, :11], x[:, 11:])
    want = per_element(_glu_formula("swiglu_oai", alpha, limit), gate, up)
    assert_close(out.astype(np.float64), want, BOUND["f32"], seed, f"swiglu_oai alpha={alpha} limit={limit}")


# -- build-time errors ----------------------------------------------------------


def _raises(build: Callable[[], Tensor], *fragments: str) -> None:
    with pytest.raises(OpError) as info:
        build()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"


def test_build_errors():
    a = od.input("a", (4, 6, 5, 10))
    _raises(lambda: ops.add(a, od.input("b", (4, 10))), "add:", "(4, 10)", "(4, 6, 5, 10)")
    _raises(lambda: ops.mul(a, od.input("b", (1, 4, 6, 5, 10))), "mul:", "(1, 4, 6, 5, 10)")
    _raises(lambda: ops.div(a, od.input("b", (4, 1, 1))), "div:", "(4, 1, 1)")
    _raises(lambda: ops.sub(od.input("i", (5,), "i32"), od.input("b", (5,))), "sub:", "i32", "(5,)")
    _raises(lambda: ops.add(a, od.input("q", (2, 32), "q8_0")), "add:", "q8_0")
    _raises(lambda: ops.add(od.input("a5", (1, 2, 3, 4, 5)), od.input("b", (5,))), "add:", "(1, 2, 3, 4, 5)")
    _raises(lambda: ops.add1(a, od.input("b", (2,))), "add1:", "one element", "(2,)")
    _raises(lambda: ops.exp(od.input("i", (3,), "i32")), "exp:", "i32")
    _raises(lambda: ops.round(od.input("i", (3,), "i8")), "round:", "i8")
    _raises(lambda: ops.scale(od.input("i", (3,), "i16"), 2.0), "scale:", "i16")


def test_add_id_build_errors():
    a, b = od.input("a", (5, 3, 7)), od.input("b", (4, 7))
    _raises(lambda: ops.add_id(a, b, od.input("ids", (5, 3), "f32")), "add_id:", "f32", "ids")
    _raises(lambda: ops.add_id(a, b, od.input("ids", (3, 5), "i32")), "add_id:", "(5, 3)", "(3, 5)")
    _raises(lambda: ops.add_id(a, od.input("b", (4, 6)), od.input("ids", (5, 3), "i32")), "add_id:", "C differs")
    _raises(lambda: ops.add_id(od.input("a", (3, 7)), b, od.input("ids", (5, 3), "i32")), "add_id:", "(3, 7)")


def test_glu_build_errors():
    x = od.input("x", (4, 7))
    _raises(lambda: ops.glu(x, "swiglu"), "glu:", "even", "(4, 7)")
    _raises(lambda: ops.glu(od.input("x", (4, 8)), "swish"), "glu:", "kind 'swish' is not one of reglu, geglu")
    _raises(lambda: ops.glu(od.input("x", (8, 4)).transpose(), "geglu"), "glu:", "contiguous")
    _raises(lambda: ops.glu(od.input("x", (4, 8), "i32"), "reglu"), "glu:", "i32")
    a = od.input("a", (4, 8))
    _raises(lambda: ops.glu_split(a, od.input("b", (4, 6)), "swiglu"), "glu:", "(4, 8)", "(4, 6)")
    _raises(lambda: ops.glu_split(a, od.input("b", (4, 8), "f16"), "swiglu"), "glu:", "f16")
