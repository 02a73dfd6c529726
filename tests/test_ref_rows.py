"""Reference kernels of the rows family (get_rows, set_rows, cpy, dup, cont, set, acc)
against independent formulas: python loops over small shapes, numpy's own casts
(float16, ml_dtypes' bfloat16, trunc for integers) and the dtypes module's
quantizer for block formats.

Random inputs come from a fresh seed each run, printed in failure messages;
set OPDISPATCH_TEST_SEED to replay one.
"""

from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest

from helpers import evaluate
from opdispatch import dtypes as D
from opdispatch import ops
from opdispatch.errors import OpError
from opdispatch.ops import cont, cpy, dup, get_rows, set_rows
from opdispatch.tensor import Tensor, input, param, state

QUANTS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
PLAIN = ["f32", "f16", "bf16", "i32"]
HOST = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "i32": np.int32}


def values(rng: np.random.Generator, shape: tuple[int, ...], dt: str, scale: float = 1.0) -> np.ndarray:
    """Random host values of a plain dtype, exactly representable in it (never all zero)."""
    if dt == "i32":
        return rng.integers(-30000, 30000, shape).astype(np.int32)
    return rng.uniform(-scale, scale, shape).astype(np.float32).astype(HOST[dt])


def encode(dt: str, vals: np.ndarray) -> np.ndarray:
    """Host storage of float or int values in dt, by numpy's casts (ggml goes through f32)."""
    if dt in QUANTS:
        return D.quantize(dt, vals)
    if dt == "i32":
        return np.trunc(vals.astype(np.float32)).astype(np.int32) if vals.dtype.kind == "f" else vals.astype(np.int32)
    return vals.astype(np.float32).astype(HOST[dt])


def transposed(name: str, shape: tuple[int, ...], dt: str) -> tuple[Tensor, Tensor]:
    """A non-contiguous (..., M, N) view (the transpose of a (..., N, M) input) and its leaf."""
    leaf = input(name, shape[:-2] + (shape[-1], shape[-2]), dt)
    return leaf.transpose(), leaf


def same_bytes(out: np.ndarray, want: np.ndarray, seed: int) -> None:
    assert out.shape == want.shape, f"seed {seed}: shape {out.shape} != {want.shape}"
    assert np.any(want.view(np.uint8) != 0), f"seed {seed}: vacuous check, all-zero expectation"
    out, want = np.ascontiguousarray(out), np.ascontiguousarray(want)
    bad = np.argwhere(out.view(np.uint8) != want.view(np.uint8))
    assert bad.size == 0, f"seed {seed}: {len(bad)} bytes differ, first at {tuple(bad[0])}"


# ---------------------------------------------------------------------------
# get_rows


def gather_loop(a: np.ndarray, idx: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    """out[i3, i2, k] = a[i3, i2, idx[i3, i2, k]] over 4-d/3-d padded shapes."""
    a4 = a.reshape((1,) * (4 - a.ndim) + a.shape)
    i3 = idx.reshape((1,) * (3 - idx.ndim) + idx.shape)
    out = np.empty(a4.shape[:2] + (i3.shape[2], a4.shape[3]), a.dtype)
    for b3 in range(out.shape[0]):
        for b2 in range(out.shape[1]):
            for k in range(out.shape[2]):
                out[b3, b2, k] = a4[b3, b2, i3[b3, b2, k]]
    return out.reshape(out_shape)


@pytest.mark.parametrize("dt", PLAIN)
@pytest.mark.parametrize("a_shape,idx_shape,out_shape", [
    ((7, 5), (11,), (11, 5)),
    ((3, 13, 7), (3, 5), (3, 5, 7)),
    ((2, 3, 5, 11), (2, 3, 4), (2, 3, 4, 11)),
    ((7, 5), (1, 4), (1, 4, 5)),
])
def test_get_rows_plain(rng, seed, dt, a_shape, idx_shape, out_shape):
    view, leaf = transposed("a", a_shape, dt)  # non-contiguous rows
    a = values(rng, a_shape, dt)
    idx = rng.integers(0, a_shape[-2], idx_shape).astype(np.int32)
    ti = input("idx", idx_shape, "i32")
    out = get_rows(view, ti)
    assert out.shape == out_shape and out.dtype.name == ("i32" if dt == "i32" else "f32")
    (got,) = evaluate(out, {leaf: np.swapaxes(a, -1, -2), ti: idx})
    want = gather_loop(a, idx, out_shape)
    same_bytes(got, want.astype(np.int32 if dt == "i32" else np.float32), seed)


@pytest.mark.parametrize("dt", QUANTS)
def test_get_rows_quant(rng, seed, dt):
    # a (2, 5, 64) quantized, viewed as (5, 2, 64): batch axes with non-contiguous strides.
    raw = D.quantize(dt, rng.uniform(-1, 1, (2, 5, 64)))
    w = param("w", raw, dt, shape=(2, 5, 64))
    view = w.permute(1, 0, 2)
    idx = rng.integers(0, 2, (5, 3)).astype(np.int32)
    ti = input("idx", idx.shape, "i32")
    (got,) = evaluate(get_rows(view, ti), {ti: idx})
    want = np.empty((5, 3, 64), np.float32)
    for b in range(5):
        for k in range(3):
            want[b, k] = D.dequantize(dt, raw[idx[b, k], b])
    same_bytes(got, want, seed)


@pytest.mark.parametrize("bad", [-1, 7])
def test_get_rows_index_out_of_range(bad):
    a, ti = input("a", (7, 5)), input("idx", (3,), "i32")
    with pytest.raises(IndexError, match=rf"get_rows: row index {bad} .* 7 rows"):
        evaluate(get_rows(a, ti), {a: np.ones((7, 5)), ti: np.array([0, bad, 1])})


def test_get_rows_errors():
    a = input("emb", (7, 5))
    with pytest.raises(OpError, match=r"get_rows: idx dtype f32 not supported .*'i' \(3,\) f32"):
        get_rows(a, input("i", (3,), "f32"))
    with pytest.raises(OpError, match=r"get_rows: batch axes differ: a has \(1, 2\), idx has \(1, 3\)"):
        get_rows(input("a3", (2, 7, 5)), input("i", (3, 4), "i32"))
    with pytest.raises(OpError, match=r"get_rows: a dtype i8 not supported"):
        get_rows(input("a8", (7, 5), "i8"), input("i", (3,), "i32"))


# ---------------------------------------------------------------------------
# set_rows


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16", "q8_0", "q4_0", "q5_1"])
@pytest.mark.parametrize("idx_dt", ["i64", "i32"])
def test_set_rows(rng, seed, dt, idx_dt):
    rows, cols, n = 13, 64, 5
    kv = state("kv", (rows, cols), dt, init=rng.uniform(-1, 1, (rows, cols)))
    src_view, src_leaf = transposed("src", (n, cols), "f32")  # non-contiguous source rows
    src = values(rng, (n, cols), "f32")
    idx = rng.permutation(rows)[:n]
    ti = input("idx", (n,), idx_dt)
    out = set_rows(kv, src_view, ti)
    assert out.view_src is kv and out.shape == kv.shape and out.dtype == kv.dtype
    (got,) = evaluate(out, {src_leaf: src.T, ti: idx})
    want = kv.data.reshape(got.view(np.uint8).shape).copy()  # the untouched rows, byte for byte
    for k in range(n):
        want[idx[k]] = encode(dt, src[k]).view(np.uint8)
    same_bytes(got.view(np.uint8), want, seed)


def test_set_rows_batched(rng, seed):
    # dst (2, 3, 7, 32); idx (2, 1, 4) tiles over axis -3 (ggml's ne[1] of idx divides ne[2] of dst).
    shape, n = (2, 3, 7, 32), 4
    kv = state("kv", shape, "f16", init=rng.uniform(-1, 1, shape))
    src = values(rng, (2, 3, n, 32), "f32")
    idx = np.stack([rng.permutation(7)[:n] for _ in range(2)]).reshape(2, 1, n)
    ts, ti = input("src", src.shape), input("idx", idx.shape, "i64")
    (got,) = evaluate(set_rows(kv, ts, ti), {ts: src, ti: idx})
    want = kv.data.view(np.float16).reshape(shape).copy()
    for i3 in range(2):
        for i2 in range(3):
            for k in range(n):
                want[i3, i2, idx[i3 % 2, i2 % 1, k]] = src[i3, i2, k].astype(np.float16)
    same_bytes(got, want, seed)


def test_set_rows_index_out_of_range():
    kv, ts, ti = state("kv", (4, 32)), input("src", (2, 32)), input("idx", (2,), "i64")
    with pytest.raises(IndexError, match=r"set_rows: row index 4 .* 4 rows of 'kv'"):
        evaluate(set_rows(kv, ts, ti), {ts: np.ones((2, 32)), ti: np.array([0, 4])})


def test_set_rows_errors():
    kv = state("kv", (8, 32), "f16")
    with pytest.raises(OpError, match=r"set_rows: src dtype f16 not supported .*'s' \(2, 32\) f16"):
        set_rows(kv, input("s", (2, 32), "f16"), input("i", (2,), "i64"))
    with pytest.raises(OpError, match=r"set_rows: row lengths differ: dst has 32, src has 16"):
        set_rows(kv, input("s", (2, 16)), input("i", (2,), "i64"))
    with pytest.raises(OpError, match=r"set_rows: src has 2 rows but idx has 3 indices"):
        set_rows(kv, input("s", (2, 32)), input("i", (3,), "i32"))
    with pytest.raises(OpError, match=r"set_rows: idx dtype f32 not supported"):
        set_rows(kv, input("s", (2, 32)), input("i", (2,), "f32"))
    with pytest.raises(OpError, match=r"set_rows: idx batch axes \(1, 2\) do not tile dst's \(1, 3\)"):
        set_rows(state("kv3", (3, 8, 32)), input("s", (3, 2, 32)), input("i", (2, 2), "i64"))


def test_in_place_writes_into_weights_are_refused():
    """Params are constant (the CUDA mat-vec reads them before the kernel ahead has finished)."""
    w = param("w", np.ones((8, 32), np.float32))
    with pytest.raises(OpError, match=r"set_rows: writes into weights \(a param\): write into a state.*'w' \(8, 32\)"):
        set_rows(w, input("s", (2, 32)), input("i", (2,), "i64"))
    with pytest.raises(OpError, match=r"cpy: writes into weights \(a param\)"):
        cpy(input("s", (4, 32)), w.view((4, 32), w.strides, 0))


# ---------------------------------------------------------------------------
# cpy, dup, cont


@pytest.mark.parametrize("src_dt", PLAIN)
@pytest.mark.parametrize("dst_dt", PLAIN)
def test_cpy_plain(rng, seed, src_dt, dst_dt):
    view, leaf = transposed("a", (5, 12), src_dt)
    a = values(rng, (5, 12), src_dt, scale=100.0)
    dst = state("dst", (3, 4, 5), dst_dt)
    out = cpy(view, dst)
    assert out.view_src is dst and out.shape == (3, 4, 5) and out.dtype.name == dst_dt
    (got,) = evaluate(out, {leaf: a.T})
    flat = a.reshape(3, 4, 5)  # row-major order of the (5, 12) view
    if src_dt != "i32":
        flat = flat.astype(np.float32)
    same_bytes(got, encode(dst_dt, flat), seed)


def test_cpy_into_view(rng, seed):
    # b is a column-major (3, 4) window on a state: the copy follows b's row-major order and strides.
    a = values(rng, (2, 6), "f32")
    ta, kv = input("a", (2, 6)), state("kv", (24,), "f16")
    b = kv.view((3, 4), (2, 6))  # element (i, j) of b is element i + 3*j of kv
    out = cpy(ta, b)
    assert out.view_src is kv and out.strides == (2, 6)
    got, storage = evaluate([out, kv], {ta: a})
    want = np.zeros(24, np.float16)
    for n, v in enumerate(a.reshape(-1)):
        i, j = divmod(n, 4)
        want[i + 3 * j] = v
    same_bytes(storage, want, seed)
    same_bytes(got, a.reshape(3, 4).astype(np.float16), seed)


@pytest.mark.parametrize("src_dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("dst_dt", QUANTS)
def test_cpy_to_quant(rng, seed, src_dt, dst_dt):
    view, leaf = transposed("a", (6, 16), src_dt)
    a = values(rng, (6, 16), src_dt)
    dst = state("dst", (3, 32), dst_dt)
    (got,) = evaluate(cpy(view, dst), {leaf: a.T})
    same_bytes(got, D.quantize(dst_dt, a.astype(np.float32).reshape(3, 32)), seed)


@pytest.mark.parametrize("src_dt", QUANTS)
@pytest.mark.parametrize("dst_dt", ["f32", "f16", "bf16"])
def test_cpy_from_quant(rng, seed, src_dt, dst_dt):
    raw = D.quantize(src_dt, rng.uniform(-1, 1, (3, 2, 64)))
    view = param("w", raw, src_dt, shape=(3, 2, 64)).permute(1, 0, 2)  # (2, 3, 64), non-contiguous
    dst = state("dst", (4, 96), dst_dt)
    (got,) = evaluate(cpy(view, dst))
    vals = np.stack([np.stack([D.dequantize(src_dt, raw[i, j]) for i in range(3)]) for j in range(2)])
    same_bytes(got, encode(dst_dt, vals.reshape(4, 96)), seed)


@pytest.mark.parametrize("dt", QUANTS)
def test_cpy_same_quant_copies_blocks(rng, seed, dt):
    raw = D.quantize(dt, rng.uniform(-1, 1, (3, 2, 64)))
    view = param("w", raw, dt, shape=(3, 2, 64)).permute(1, 0, 2)
    dst = state("dst", (12, 32), dt)
    (got,) = evaluate(cpy(view, dst))
    blocks = [raw[i, j, b * (len(raw[i, j]) // 2):(b + 1) * (len(raw[i, j]) // 2)]
              for j in range(2) for i in range(3) for b in range(2)]
    same_bytes(got, np.stack(blocks), seed)


def test_dup_and_cont(rng, seed):
    view, leaf = transposed("a", (2, 5, 7), "f16")
    a = values(rng, (2, 5, 7), "f16")
    d, c = dup(view), cont(view, (7, 10))
    assert d.is_contiguous() and d.shape == (2, 5, 7) and d.dtype.name == "f16"
    got_d, got_c = evaluate([d, c], {leaf: np.swapaxes(a, -1, -2)})
    same_bytes(got_d, a, seed)
    want_c = np.empty((70,), np.float16)
    for n, (i, j, k) in enumerate(np.ndindex(2, 5, 7)):
        want_c[n] = a[i, j, k]
    same_bytes(got_c, want_c.reshape(7, 10), seed)


def test_cont_quant(rng, seed):
    raw = D.quantize("q4_1", rng.uniform(-1, 1, (3, 2, 64)))
    view = param("w", raw, "q4_1", shape=(3, 2, 64)).permute(1, 0, 2)
    (got,) = evaluate(cont(view, (2, 192)))
    same_bytes(got, np.concatenate([raw[:, 0].reshape(-1), raw[:, 1].reshape(-1)]).reshape(2, -1), seed)


def test_copy_errors():
    a = input("a", (4, 8))
    with pytest.raises(OpError, match=r"cpy: element counts differ: 32 vs 33 \['a' \(4, 8\) f32, 'b' \(33,\) f32\]"):
        cpy(a, state("b", (33,)))
    with pytest.raises(OpError, match=r"cpy: cannot convert i32 to q8_0"):
        cpy(input("i", (32,), "i32"), state("q", (32,), "q8_0"))
    with pytest.raises(OpError, match=r"cpy: cannot convert q8_0 to q4_0"):
        cpy(input("q", (32,), "q8_0"), state("q4", (32,), "q4_0"))
    with pytest.raises(OpError, match=r"cont: cannot hold 32 elements in shape \(5, 7\)"):
        cont(a, (5, 7))
    with pytest.raises(OpError, match=r"cont: q8_0 needs a last axis that is a multiple of 32"):
        cont(input("q", (2, 32), "q8_0"), (4, 16))


# ---------------------------------------------------------------------------
# set, acc


def window_loop(a: np.ndarray, b: np.ndarray, offset: int, strides: tuple[int, ...], add: bool) -> np.ndarray:
    """a (contiguous copy) with b written to / added at byte offset + sum(i*stride)."""
    flat = np.ascontiguousarray(a).reshape(-1).copy()
    isz = a.itemsize
    for i in np.ndindex(b.shape):
        pos = (offset + sum(k * s for k, s in zip(i, strides))) // isz
        flat[pos] = flat[pos] + b[i] if add else b[i]
    return flat.reshape(a.shape)


@pytest.mark.parametrize("op_name", ["set", "acc"])
@pytest.mark.parametrize("b_shape,offset,strides", [
    ((3, 4), (1 * 7 * 9 + 2 * 9 + 3) * 4, None),          # default strides: a sub-block
    ((2, 3, 4), 9 * 4, (7 * 9 * 4, 2 * 9 * 4, 4)),       # every other row
    ((5,), 40, None),
])
def test_set_acc(rng, seed, op_name, b_shape, offset, strides):
    leaf = input("a", (7, 5, 9))
    view = leaf.permute(1, 0, 2)  # (5, 7, 9), non-contiguous
    a = values(rng, (5, 7, 9), "f32")
    tb = input("b", b_shape)
    b = values(rng, b_shape, "f32")
    out = getattr(ops, op_name)(view, tb, offset, strides)
    assert out.shape == (5, 7, 9) and out.view_src is None
    (got,) = evaluate(out, {leaf: a.transpose(1, 0, 2), tb: b})
    default = {2: (9 * 4, 4), 1: (4,)}.get(len(b_shape))
    want = window_loop(a, b, offset, strides or default, op_name == "acc")
    same_bytes(got, want, seed)


def test_set_i32(rng, seed):
    ta, tb = input("a", (6, 5), "i32"), input("b", (2, 2), "i32")
    a, b = values(rng, (6, 5), "i32"), values(rng, (2, 2), "i32")
    (got,) = evaluate(ops.set(ta, tb, 4 * 5 + 8), {ta: a, tb: b})
    same_bytes(got, window_loop(a, b, 28, (20, 4), False), seed)


def test_set_acc_errors():
    a = input("a", (4, 8))
    with pytest.raises(OpError, match=r"set: window of shape \(2, 8\) at offset 96 .* past a's 128 bytes"):
        ops.set(a, input("b", (2, 8)), 96)
    with pytest.raises(OpError, match=r"acc: offset 2 and strides \(32, 4\) must be non-negative multiples of 4"):
        ops.acc(a, input("b", (2, 3)), 2)
    with pytest.raises(OpError, match=r"set: b must be f32 like a, got f16"):
        ops.set(a, input("b", (2, 3), "f16"), 0)
    with pytest.raises(OpError, match=r"acc: a dtype i32 not supported"):
        ops.acc(input("i", (4, 8), "i32"), input("b", (2,), "i32"), 0)
    with pytest.raises(OpError, match=r"set: the last stride must be the element size 4"):
        ops.set(a, input("b", (2, 3)), 0, (32, 8))
