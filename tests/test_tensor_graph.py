"""Tensors, views, leaves, graph building, structural keys and build-time errors."""

from __future__ import annotations

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.dtypes import quantize
from opdispatch.graph import Graph
from opdispatch.errors import OpError
from opdispatch.tensor import contiguous_strides


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.uniform(-1, 1, shape).astype(np.float32)


# -- tensors and views -------------------------------------------------------------------
def test_contiguous_strides_and_nbytes_in_bytes() -> None:
    x = od.input("x", (2, 3, 4), "f16")
    assert x.strides == (24, 8, 2) and x.nbytes == 48 and x.is_contiguous()
    q = od.input("q", (3, 64), "q4_0")  # 2 blocks of 18 bytes a row
    assert q.strides == (36, 18) and q.nbytes == 108
    assert contiguous_strides((5,), od.dtype("f32")) == (4,)


def test_views_share_storage_and_cost_nothing() -> None:
    rng = np.random.default_rng()
    x = od.input("x", (4, 6))
    t = x.T
    p = x.reshape(2, 3, 4).permute(2, 0, 1)
    v = x.view((3,), (8,), offset=4)  # every other element of row 0, from column 1
    for view in (t, p, v):
        assert view.base is x and view.view_src is x
    assert not t.is_contiguous() and t.rows_contiguous() is False
    plan = od.compile([ops.cont(t), ops.cont(p), ops.cont(v)], "cpu")
    assert sum(s.kind == "view" for s in plan.steps) == 4  # reshape+permute count twice
    fx = rand(rng, 4, 6)
    ot, op_, ov = plan.run({x: fx})
    np.testing.assert_array_equal(ot, fx.T)
    np.testing.assert_array_equal(op_, fx.reshape(2, 3, 4).transpose(2, 0, 1))
    np.testing.assert_array_equal(ov, fx[0, 1::2])


def test_view_of_view_points_at_the_owner_with_summed_offsets() -> None:
    x = od.input("x", (4, 8))
    row = x.view((8,), offset=32)
    tail = row.view((4,), offset=16)
    assert tail.view_src is x and tail.view_offset == 48


def test_reshape_infers_minus_one_and_rejects_non_contiguous() -> None:
    x = od.input("x", (4, 6))
    assert x.reshape(-1, 3).shape == (8, 3)
    with pytest.raises(OpError, match=r"reshape: source is not contiguous .*'x'|reshape: source is not contiguous"):
        x.T.reshape(24)
    with pytest.raises(OpError, match=r"reshape: cannot reshape 24 elements into \(5, 5\)"):
        x.reshape(5, 5)


def test_view_bounds_and_block_alignment_are_checked() -> None:
    x = od.input("x", (4, 6))
    with pytest.raises(OpError, match="view: window of 96 bytes at offset 4 exceeds the source's 96 bytes"):
        x.view((4, 6), offset=4)
    q = od.input("q", (2, 64), "q8_0")
    with pytest.raises(OpError, match="q8_0 views need a last axis that is a multiple of 32"):
        q.view((2, 16))
    with pytest.raises(OpError, match="q8_0 blocks must stay on the last axis"):
        q.permute(1, 0)


def test_params_convert_quantize_and_take_raw_bytes() -> None:
    rng = np.random.default_rng()
    w = rand(rng, 4, 64)
    p = od.param("w", w, "q8_0")
    np.testing.assert_array_equal(p.data, quantize("q8_0", w).reshape(-1))
    raw = od.param("raw", quantize("q4_0", w), "q4_0", shape=(4, 64))
    assert raw.shape == (4, 64) and raw.nbytes == raw.data.size
    with pytest.raises(ValueError, match=r"param 'bad': q4_0 \(4, 32\) needs 72 bytes, got 144"):
        od.param("bad", quantize("q4_0", w), "q4_0", shape=(4, 32))
    before = p.data.copy()
    w[0, 0] = 99.0  # each param holds its own copy
    assert od.param("copy", w).data.view(np.float32)[0] == 99.0
    np.testing.assert_array_equal(p.data, before)


def test_leaf_errors_name_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"tensor 'k': q4_0 needs a last axis that is a multiple of 32, got shape \(2, 10\)"):
        od.input("k", (2, 10), "q4_0")
    with pytest.raises(ValueError, match="unknown|known"):
        od.input("u", (2,), "f64")


# -- graphs ----------------------------------------------------------------------------
def test_graph_order_leafs_nodes_and_users() -> None:
    a, b = od.input("a", (3, 4)), od.input("b", (3, 4))
    w = od.param("w", np.ones((4,), np.float32))
    s = ops.add(a, b)
    m = ops.mul(s, w)
    y = ops.add(m, s)  # s read twice
    g = Graph.build(y)
    assert g.nodes == [s, m, y]
    assert set(g.leafs) == {a, b, w}
    assert g.inputs == [a, b] and g.params == [w]
    assert g.users[s] == [m, y] and g.use_count(s) == 2 and g.use_count(y) == 0
    for i, n in enumerate(g.nodes):  # sources come before their users
        assert all(src in g.leafs or g.nodes.index(src) < i for src in n.srcs if src is not None)


def test_deep_graphs_do_not_hit_the_recursion_limit() -> None:
    h = od.input("x", (2,))
    for _ in range(5000):
        h = ops.neg(h)
    assert len(Graph.build(h)) == 5000


def test_structural_key_ignores_data_and_names_but_not_structure() -> None:
    def build(shape=(4, 8), eps=1e-6, name="x"):  # noqa: ANN001, ANN202
        x = od.input(name, shape)
        return Graph.build(ops.rms_norm(ops.add(x, x), eps))

    assert build().key() == build(name="other").key()
    assert build().key() != build(shape=(4, 9)).key()
    assert build().key() != build(eps=1e-5).key()
    w1, w2 = (od.param(f"w{i}", np.ones(4, np.float32)) for i in range(2))
    x = od.input("x", (4,))
    assert Graph.build(ops.mul(x, w1)).key() != Graph.build(ops.mul(x, w2)).key()  # weights are identity


def test_graph_needs_tensors() -> None:
    with pytest.raises(ValueError, match="no outputs"):
        Graph.build([])
    with pytest.raises(OpError, match="outputs must be Tensors"):
        Graph.build([np.zeros(3)])  # type: ignore[list-item]


# -- build-time validation ------------------------------------------------------------
def test_op_errors_name_the_op_the_tensors_their_shapes_and_dtypes() -> None:
    w = od.input("wq", (4096, 4096), "f16")
    x = od.input("x", (7, 4095))
    with pytest.raises(OpError) as err:
        ops.mul_mat(w, x)
    msg = str(err.value)
    assert msg.startswith("mul_mat:") and "'wq' (4096, 4096) f16" in msg and "'x' (7, 4095) f32" in msg
    with pytest.raises(OpError, match=r"add: .*'a' \(3, 4\) f32.*'b' \(5,\) f32"):
        ops.add(od.input("a", (3, 4)), od.input("b", (5,)))
    with pytest.raises(OpError, match=r"rms_norm: .*dtype i32"):
        ops.rms_norm(od.input("i", (3, 4), "i32"))
    with pytest.raises(OpError, match="must be a Tensor"):
        ops.neg(np.zeros(3))  # type: ignore[arg-type]
