"""Reference kernels of mul_mat, mul_mat_id and out_prod against independent formulas.

The formulas loop over batches, tokens and experts with np.dot in float64 on
inputs rounded to their stored dtype (quantized weights: dequantize(quantize(w))).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import opdispatch as od
from opdispatch.errors import OpError
from opdispatch.ops import OPS, mul_mat, mul_mat_id, out_prod
from opdispatch.reference import REFERENCE

from helpers import assert_close, evaluate, stored, uniform

QUANTS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")


def mul_mat_formula(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """out[i3, i2, n, :] = a[i3 // r3, i2 // r2] . b[i3, i2, n], looping over batches and rows."""
    (a3, a2, m, _), (b3, b2, n, _) = a.shape, b.shape
    out = np.empty((b3, b2, n, m))
    for i3, i2 in itertools.product(range(b3), range(b2)):
        w = a[i3 // (b3 // a3), i2 // (b2 // a2)]
        for j in range(n):
            out[i3, i2, j] = np.dot(w, b[i3, i2, j])
    return out


# ---------------------------------------------------------------------------- mul_mat


@pytest.mark.parametrize("bs", [(1, 1), (1, 3), (2, 1), (2, 3)])  # a's (A3, A2)
@pytest.mark.parametrize("nr", [(1, 1), (2, 1), (1, 2), (2, 2)])  # (B3 // A3, B2 // A2)
def test_mul_mat_broadcast(rng, seed, bs, nr):
    gen = rng
    m, n, k = 5, 7, 65
    a_shape = (*bs, m, k)
    b_shape = (bs[0] * nr[0], bs[1] * nr[1], n, k)
    a, b = od.input("a", a_shape), od.input("b", b_shape)
    av, bv = uniform(gen, a_shape), uniform(gen, b_shape)
    (out,) = evaluate(mul_mat(a, b), {a: av, b: bv})
    assert_close(out, mul_mat_formula(stored(av, "f32"), stored(bv, "f32")), seed)


@pytest.mark.parametrize("a_dt,b_dt", [("f32", "f32"), ("f16", "f32"), ("bf16", "f32"), ("f16", "f16"),
                                       ("bf16", "bf16")])
@pytest.mark.parametrize("k", [65, 80])
@pytest.mark.parametrize("n", [1, 7, 16])
def test_mul_mat_float_dtypes(rng, seed, a_dt, b_dt, k, n):
    gen = rng
    a_shape, b_shape = (2, 11, k), (4, n, k)
    av, bv = uniform(gen, a_shape), uniform(gen, b_shape)
    a = od.param("w", av, a_dt)
    b = od.input("x", b_shape, b_dt)
    node = mul_mat(a, b)
    assert node.shape == (4, n, 11) and node.dtype.name == "f32"
    (out,) = evaluate(node, {b: bv})
    ref = mul_mat_formula(stored(av, a_dt)[None], stored(bv, b_dt)[None])[0]
    assert_close(out, ref, seed)


@pytest.mark.parametrize("dt", QUANTS)
@pytest.mark.parametrize("n", [1, 7, 16])
def test_mul_mat_quantized(rng, seed, dt, n):
    gen = rng
    k = 96
    av, bv = uniform(gen, (1, 3, 13, k)), uniform(gen, (2, 3, n, k))
    a = od.param("w", av, dt)
    b = od.input("x", bv.shape)
    (out,) = evaluate(mul_mat(a, b), {b: bv})
    # The reference multiplies by the dequantized weight exactly: only float64 rounding differs.
    assert_close(out, mul_mat_formula(stored(av, dt), bv), seed)


def test_mul_mat_noncontiguous(rng, seed):
    gen = rng
    m, n, k = 13, 7, 80
    # a: outer axes permuted (rows stay contiguous, not transposed)
    a_leaf = od.input("a", (3, 2, m, k))
    a = a_leaf.permute(1, 0, 2, 3)  # (2, 3, m, k)
    # b: transposed view of a (.., k, n) tensor, and a permuted one
    bt_leaf = od.input("bt", (2, 6, k, n))
    bp_leaf = od.input("bp", (n, 2, 6, k))
    b_t = bt_leaf.transpose()  # (2, 6, n, k)
    b_p = bp_leaf.permute(1, 2, 0, 3)  # (2, 6, n, k)
    av = uniform(gen, a_leaf.shape)
    btv, bpv = uniform(gen, bt_leaf.shape), uniform(gen, bp_leaf.shape)
    assert not b_t.rows_contiguous() and not b_p.is_contiguous() and not a.is_contiguous()
    out_t, out_p = evaluate([mul_mat(a, b_t), mul_mat(a, b_p)], {a_leaf: av, bt_leaf: btv, bp_leaf: bpv})
    a_np = stored(av, "f32").transpose(1, 0, 2, 3)
    assert_close(out_t, mul_mat_formula(a_np, stored(btv, "f32").swapaxes(-1, -2)), seed)
    assert_close(out_p, mul_mat_formula(a_np, stored(bpv, "f32").transpose(1, 2, 0, 3)), seed)


@pytest.mark.parametrize("a_shape,b_shape,out_shape", [
    ((5, 32), (7, 32), (7, 5)),
    ((5, 32), (3, 7, 32), (3, 7, 5)),
    ((1, 5, 32), (7, 32), (1, 7, 5)),
    ((5, 32), (2, 3, 1, 32), (2, 3, 1, 5)),
])
def test_mul_mat_ranks(rng, seed, a_shape, b_shape, out_shape):
    gen = rng
    a, b = od.input("a", a_shape), od.input("b", b_shape)
    av, bv = uniform(gen, a_shape), uniform(gen, b_shape)
    node = mul_mat(a, b)
    assert node.shape == out_shape
    (out,) = evaluate(node, {a: av, b: bv})
    pad = lambda x: x.reshape((1,) * (4 - x.ndim) + x.shape)  # noqa: E731
    assert_close(out, mul_mat_formula(pad(stored(av, "f32")), pad(stored(bv, "f32"))).reshape(out_shape), seed)


def test_mul_mat_errors():
    def raises(match: str, a: od.Tensor, b: od.Tensor, named: str = "ab") -> None:
        """mul_mat(a, b) raises OpError matching `match`, naming the op and the tensors in `named`."""
        with pytest.raises(OpError, match=match) as info:
            mul_mat(a, b)
        msg = str(info.value)
        assert msg.startswith("mul_mat:"), msg
        for t in (a if "a" in named else None, b if "b" in named else None):
            assert t is None or f"'{t.name}' {t.shape} {t.dtype.name}" in msg, msg

    raises("K differs: a has 4096, b has 4095", od.input("wq", (4096, 4096), "f16"), od.input("x", (7, 4095)))
    raises("do not divide", od.input("a", (2, 5, 32)), od.input("b", (3, 7, 32)))
    raises("do not divide", od.input("a", (2, 1, 5, 32)), od.input("b", (1, 1, 7, 32)))
    raises("b dtype q8_0", od.input("a", (5, 32)), od.input("b", (7, 32), "q8_0"), "b")
    raises("a dtype i32", od.input("a", (5, 32), "i32"), od.input("b", (7, 32)), "a")
    raises("b dtype i8", od.input("a", (5, 32)), od.input("b", (7, 32), "i8"), "b")
    raises("transposed", od.input("a", (32, 5)).T, od.input("b", (7, 32)), "a")
    raises("dimensions", od.input("a", (32,)), od.input("b", (7, 32)), "a")
    raises("dimensions", od.input("a", (5, 32)), od.input("b", (1, 2, 1, 7, 32)), "b")


# ---------------------------------------------------------------------------- mul_mat_id


@pytest.mark.parametrize("dt", ["f32", "f16", "q8_0", "q4_1"])
@pytest.mark.parametrize("u,ub", [(1, 1), (2, 1), (2, 2)])
def test_mul_mat_id(rng, seed, dt, u, ub):
    gen = rng
    n_exp, m, k, t = 4, 7, 64, 5
    wv, bv = uniform(gen, (n_exp, m, k)), uniform(gen, (t, ub, k))
    idv = gen.integers(0, n_exp, (t, u))
    w = od.param("experts", wv, dt)
    b, ids = od.input("x", bv.shape), od.input("ids", idv.shape, "i32")
    node = mul_mat_id(w, b, ids)
    assert node.shape == (t, u, m) and node.dtype.name == "f32"
    (out,) = evaluate(node, {b: bv, ids: idv})
    wq = stored(wv, dt)
    ref = np.empty((t, u, m))
    for ti, ui in itertools.product(range(t), range(u)):
        ref[ti, ui] = np.dot(wq[idv[ti, ui]], bv[ti, ui % ub])
    assert_close(out, ref, seed)


@pytest.mark.parametrize("bad", [4, -1])
def test_mul_mat_id_out_of_range(rng, bad):
    gen = rng
    w = od.param("experts", uniform(gen, (4, 3, 32)))
    b, ids = od.input("x", (2, 1, 32)), od.input("ids", (2, 2), "i32")
    node = mul_mat_id(w, b, ids)
    with pytest.raises(IndexError, match=rf"mul_mat_id: ids\[1, 0\] = {bad} is out of range for 4 experts"):
        evaluate(node, {b: uniform(gen, (2, 1, 32)), ids: np.array([[0, 3], [bad, 1]])})


def test_mul_mat_id_errors():
    w, x, ids = od.input("w", (4, 3, 32)), od.input("x", (5, 2, 32)), od.input("ids", (5, 2), "i32")
    mul_mat_id(w, x, ids)  # valid
    cases = [
        ("K differs: as_ has 32, b has 64", (w, od.input("x", (5, 2, 64)), ids)),
        ("token counts differ", (w, od.input("x", (4, 2, 32)), ids)),
        ("do not divide", (w, od.input("x", (5, 3, 32)), od.input("ids", (5, 4), "i32"))),
        ("ids dtype i64", (w, x, od.input("ids", (5, 2), "i64"))),
        ("b dtype f16", (w, od.input("x", (5, 2, 32), "f16"), ids)),
        ("as_ must be 3-D", (od.input("w", (3, 32)), x, ids)),
    ]
    for match, args in cases:
        with pytest.raises(OpError, match=match) as info:
            mul_mat_id(*args)
        assert str(info.value).startswith("mul_mat_id:")


# ---------------------------------------------------------------------------- out_prod


def out_prod_formula(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """out[i3, i2] = sum_k outer(b[i3, i2, k], a[i3 // r3, i2 // r2, k])."""
    (a3, a2, k, m), (b3, b2, _, n) = a.shape, b.shape
    out = np.zeros((b3, b2, n, m))
    for i3, i2 in itertools.product(range(b3), range(b2)):
        w = a[i3 // (b3 // a3), i2 // (b2 // a2)]
        for j in range(k):
            out[i3, i2] += np.outer(b[i3, i2, j], w[j])
    return out


@pytest.mark.parametrize("a_dt", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("bs,nr", [((1, 1), (1, 1)), ((1, 3), (2, 2)), ((2, 1), (1, 2))])
def test_out_prod(rng, seed, a_dt, bs, nr):
    gen = rng
    k, m, n = 11, 32, 7
    a_shape, b_shape = (*bs, k, m), (bs[0] * nr[0], bs[1] * nr[1], k, n)
    av, bv = uniform(gen, a_shape), uniform(gen, b_shape)
    a, b = od.param("a", av, a_dt), od.input("b", b_shape)
    node = out_prod(a, b)
    assert node.shape == (b_shape[0], b_shape[1], n, m)
    (out,) = evaluate(node, {b: bv})
    assert_close(out, out_prod_formula(stored(av, a_dt), bv), seed)


def test_out_prod_noncontiguous(rng, seed):
    gen = rng
    k, m, n = 13, 5, 7
    b_leaf = od.input("bt", (2, n, k))
    b = b_leaf.transpose()  # (2, k, n)
    a = od.input("a", (k, m))
    av, bv = uniform(gen, a.shape), uniform(gen, b_leaf.shape)
    (out,) = evaluate(out_prod(a, b), {a: av, b_leaf: bv})
    assert out.shape == (2, n, m)
    ref = out_prod_formula(av[None, None], bv.swapaxes(-1, -2)[None])[0]
    assert_close(out, ref, seed)


def test_out_prod_errors():
    with pytest.raises(OpError, match=r"out_prod: K differs: a has 11, b has 12"):
        out_prod(od.input("a", (11, 5)), od.input("b", (12, 7)))
    with pytest.raises(OpError, match=r"out_prod: .*do not divide"):
        out_prod(od.input("a", (2, 11, 5)), od.input("b", (3, 11, 7)))
    with pytest.raises(OpError, match=r"out_prod: b dtype f16"):
        out_prod(od.input("a", (11, 5)), od.input("b", (11, 7), "f16"))


def test_registered():
    for name in ("mul_mat", "mul_mat_id", "out_prod"):
        assert OPS[name].family == "matmul" and name in REFERENCE
        assert OPS[name].doc, name
