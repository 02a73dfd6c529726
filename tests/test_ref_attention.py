"""Reference kernels of soft_max, rope, flash_attn_ext and diag_mask_inf against independent formulas.

The formulas walk rows, heads and rotation pairs one at a time in float64
(softmax as exp and sum written out, rope as a complex rotation per (pos,
pair), attention as a plain softmax(q.K)V per query row), on inputs rounded
to their stored dtype.
"""

from __future__ import annotations

import cmath
import itertools
import math

import numpy as np
import pytest

import opdispatch as od
from opdispatch.dtypes import from_float
from opdispatch.errors import OpError
from opdispatch.ops import OPS, diag_mask_inf, flash_attn_ext, rope, soft_max
from opdispatch.reference import REFERENCE
from opdispatch.ops.attention import alibi_bases, alibi_slopes, rope_yarn, rope_yarn_corr_dims

from helpers import assert_close, evaluate, stored, uniform


def slope_formula(h: int, n_head: int, max_bias: float) -> float:
    """ALiBi slope of head h, ggml's formula written out with math (not the op module's helpers)."""
    if max_bias == 0:
        return 1.0
    n_log2 = 2 ** math.floor(math.log2(n_head))
    if h < n_log2:
        return (2 ** (-max_bias / n_log2)) ** (h + 1)
    return (2 ** (-max_bias / 2 / n_log2)) ** (2 * (h - n_log2) + 1)


def random_mask(gen: np.random.Generator, shape: tuple[int, ...], full_row: int | None = None) -> np.ndarray:
    """Values in [-1, 1] with -inf blocks: a causal-like band, a random block, optionally a fully masked row.

    Column 0 stays finite except in `full_row`, so every other row keeps a logit.
    """
    m = uniform(gen, shape)
    rows, cols = shape[-2], shape[-1]
    r, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
    m[..., (c > r + cols // 2)] = -np.inf
    r0, c0 = gen.integers(0, rows), gen.integers(1, cols)
    m[..., r0:r0 + 3, c0:c0 + 4] = -np.inf
    if full_row is not None:
        m[..., full_row, :] = -np.inf
    return m


# ---------------------------------------------------------------------------- helpers


@pytest.mark.parametrize("n_head,max_bias,want", [
    (8, 8.0, [2.0 ** -(h + 1) for h in range(8)]),
    (12, 8.0, [2.0 ** -(h + 1) for h in range(8)] + [2.0 ** -(0.5 + h) for h in range(4)]),
    (1, 8.0, [2.0 ** -8]),
    (5, 0.0, [1.0] * 5),
])
def test_alibi_slopes(n_head, max_bias, want):
    np.testing.assert_allclose(alibi_slopes(n_head, max_bias), want, rtol=1e-12)
    np.testing.assert_allclose(alibi_slopes(n_head, max_bias),
                               [slope_formula(h, n_head, max_bias) for h in range(n_head)], rtol=1e-12)


def test_rope_yarn_corr_dims():
    def corr(r: float) -> float:
        return 64 * math.log(4096 / (2 * math.pi * r)) / (2 * math.log(10000.0))

    assert rope_yarn_corr_dims(64, 4096, 10000.0, 32.0, 1.0) == (max(0, math.floor(corr(32))),
                                                                 min(63, math.ceil(corr(1))))
    # by hand: corr(32) = 10.47, corr(1) = 22.5
    assert rope_yarn_corr_dims(64, 4096, 10000.0, 32.0, 1.0) == (10.0, 23.0)


def test_alibi_bases():
    assert alibi_bases(12, 8.0) == (8, 2.0 ** -1, 2.0 ** -0.5)  # L = 8 for 12 heads
    assert alibi_bases(1, 4.0) == (1, 2.0 ** -4, 2.0 ** -2)
    assert alibi_bases(8, 0.0) is None and alibi_bases(0, 8.0) is None


def test_rope_yarn():
    params = dict(n_dims=64, n_ctx_orig=4096, freq_base=10000.0, freq_scale=0.25, ext_factor=1.0, attn_factor=1.2,
                  beta_fast=32.0, beta_slow=1.0)
    lo, hi, mscale = rope_yarn(params)
    assert (lo, hi) == (10.0, 23.0)
    assert mscale == pytest.approx(1.2 * (1 + 0.1 * math.log(4)), rel=1e-15)
    assert rope_yarn({**params, "ext_factor": 0.0}) == (0.0, 0.0, 1.2)  # no YaRN: attn_factor alone


# ---------------------------------------------------------------------------- soft_max


def soft_max_formula(a: np.ndarray, mask: np.ndarray | None, scale: float, max_bias: float,
                     sinks: np.ndarray | None) -> np.ndarray:
    """Row by row: w = a*scale + slope*mask; exp(w - max) / (sum + sink term)."""
    n3, n_head, rows, cols = a.shape
    out = np.empty_like(a)
    for i3, h, r in itertools.product(range(n3), range(n_head), range(rows)):
        w = a[i3, h, r] * scale
        if mask is not None:
            w = w + slope_formula(h, n_head, max_bias) * mask[i3 % mask.shape[0], h % mask.shape[1], r]
        logits = list(w) + ([sinks[h]] if sinks is not None else [])
        top = max(logits)
        if top == -math.inf:
            out[i3, h, r] = 0.0
            continue
        e = np.array([math.exp(x - top) for x in w])
        total = sum(e) + (math.exp(sinks[h] - top) if sinks is not None else 0.0)
        out[i3, h, r] = e / total
    return out


SOFT_MAX_CASES = [(None, None, 1.0, 0.0), (None, None, 0.1, 0.0)] + [
    (mask_dt, outer, scale, max_bias)
    for mask_dt, outer, (scale, max_bias) in itertools.product(
        ("f16", "f32"), ((1, 1), (2, 5)), ((1.0, 0.0), (0.1, 8.0)))
]  # ALiBi needs a mask


@pytest.mark.parametrize("mask_dt,mask_outer,scale,max_bias", SOFT_MAX_CASES)
@pytest.mark.parametrize("sinks", [False, True])
def test_soft_max(rng, seed, mask_dt, mask_outer, sinks, scale, max_bias):
    gen = rng
    shape = (2, 5, 7, 13)
    av = uniform(gen, shape) * 4
    a = od.input("a", shape)
    feeds = {a: av}
    mask = sink = None
    mv = sv = None
    if mask_dt is not None:
        mv = random_mask(gen, (*mask_outer, shape[2] + 3, shape[3]))  # more mask rows than a's: allowed
        mask = od.input("mask", mv.shape, mask_dt)
        feeds[mask] = mv
    if sinks:
        sv = uniform(gen, (shape[1],)) * 2
        sink = od.input("sinks", sv.shape)
        feeds[sink] = sv
    node = soft_max(a, mask, scale=scale, max_bias=max_bias, sinks=sink)
    assert node.shape == shape and node.params == {"scale": scale, "max_bias": max_bias}
    (out,) = evaluate(node, feeds)
    ref = soft_max_formula(av, stored(mv, mask_dt) if mv is not None else None, scale, max_bias, sv)
    assert_close(out, ref, seed, 1e-7)


def test_soft_max_noncontiguous_and_ranks(rng, seed):
    gen = rng
    leaf = od.input("a", (5, 3, 4, 11))
    a = leaf.permute(1, 0, 2, 3)  # (3, 5, 4, 11): rows contiguous, outer axes swapped
    av = uniform(gen, leaf.shape)
    v1 = od.input("v", (9,))
    vv = uniform(gen, (9,))
    m2 = od.input("m", (4, 11), "f16")  # a 2-D mask broadcast over every head
    mv = random_mask(gen, (4, 11))
    out, out1 = evaluate([soft_max(a, m2, scale=0.5), soft_max(v1)], {leaf: av, v1: vv, m2: mv})
    ref = soft_max_formula(av.transpose(1, 0, 2, 3), stored(mv, "f16")[None, None], 0.5, 0.0, None)
    assert_close(out, ref, seed)
    assert_close(out1, soft_max_formula(vv[None, None, None], None, 1.0, 0.0, None)[0, 0, 0], seed)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_soft_max_fully_masked_row_is_zero(rng, seed, with_sinks):
    gen = rng
    a, mask = od.input("a", (1, 2, 3, 8)), od.input("mask", (3, 8), "f16")
    mv = uniform(gen, (3, 8))
    mv[1] = -np.inf
    feeds = {a: uniform(gen, a.shape), mask: mv}
    sink = None
    if with_sinks:
        sink = od.input("s", (2,))
        feeds[sink] = uniform(gen, (2,))
    (out,) = evaluate(soft_max(a, mask, sinks=sink), feeds)
    assert np.all(out[:, :, 1] == 0) and np.all(np.isfinite(out)), f"seed {seed}"
    sums = out[:, :, [0, 2]].sum(-1)
    assert np.all(sums < 1) if with_sinks else np.allclose(sums, 1), f"seed {seed}"


def test_soft_max_errors():
    a = od.input("a", (2, 4, 7, 13))
    cases = [
        ("a dtype f16", lambda: soft_max(od.input("h", (7, 13), "f16"))),
        ("mask dtype bf16", lambda: soft_max(a, od.input("m", (7, 13), "bf16"))),
        ("mask has 12 columns, expected 13", lambda: soft_max(a, od.input("m", (7, 12)))),
        ("mask has 6 rows, fewer than the 7", lambda: soft_max(a, od.input("m", (6, 13)))),
        (r"mask outer dims \(1, 3\) do not divide \(2, 4\)", lambda: soft_max(a, od.input("m", (3, 7, 13)))),
        ("needs a mask", lambda: soft_max(a, max_bias=8.0)),
        (r"sinks must have shape \(4,\)", lambda: soft_max(a, sinks=od.input("s", (3,)))),
        ("sinks dtype f16", lambda: soft_max(a, sinks=od.input("s", (4,), "f16"))),
        ("rows must be contiguous", lambda: soft_max(od.input("t", (13, 7)).T)),
    ]
    for match, build in cases:
        with pytest.raises(OpError, match=match) as info:
            build()
        assert str(info.value).startswith("soft_max:") and "(" in str(info.value)


# ---------------------------------------------------------------------------- rope


def rope_formula(x: np.ndarray, pos: np.ndarray, n_dims: int, mode: str, freq_base: float, freq_scale: float,
                 ext_factor: float, attn_factor: float, beta_fast: float, beta_slow: float, n_ctx_orig: int,
                 ff: np.ndarray | None) -> np.ndarray:
    """Per (token, pair): multiply the pair, read as a complex number, by mscale*e^(i*theta)."""
    y = x.copy()
    half = n_dims // 2

    def corr(r: float) -> float:
        return n_dims * math.log(n_ctx_orig / (2 * math.pi * r)) / (2 * math.log(freq_base))

    for t, i in itertools.product(range(x.shape[1]), range(half)):
        theta_ext = pos[t] / freq_base ** (2 * i / n_dims) / (ff[i] if ff is not None else 1.0)
        theta_int = freq_scale * theta_ext
        if ext_factor:
            lo, hi = max(0, math.floor(corr(beta_fast))), min(n_dims - 1, math.ceil(corr(beta_slow)))
            mix = ext_factor * (1 - min(1.0, max(0.0, (i - lo) / max(0.001, hi - lo))))
            theta = theta_int * (1 - mix) + theta_ext * mix
            mscale = attn_factor * (1 + 0.1 * math.log(1 / freq_scale))
        else:
            theta, mscale = theta_int, attn_factor
        j0, j1 = (2 * i, 2 * i + 1) if mode == "normal" else (i, i + half)
        z = (x[:, t, :, j0] + 1j * x[:, t, :, j1]) * cmath.rect(mscale, theta)
        y[:, t, :, j0], y[:, t, :, j1] = z.real, z.imag
    return y


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("d,n_dims", [(64, 64), (80, 32)])
@pytest.mark.parametrize("freq_factors", [False, True])
@pytest.mark.parametrize("yarn", [False, True])
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rope(rng, seed, mode, d, n_dims, freq_factors, yarn, dt):
    gen = rng
    b, t, h = 2, 7, 3
    kw = dict(freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0,
              n_ctx_orig=0)
    if yarn:
        kw.update(freq_scale=0.25, ext_factor=1.0, attn_factor=0.9, n_ctx_orig=4096)
    # non-contiguous x: a (B, H, T, D) tensor seen as (B, T, H, D)
    leaf = od.input("x", (b, h, t, d), dt)
    x = leaf.permute(0, 2, 1, 3)
    pos = od.input("pos", (t,), "i32")
    xv, pv = uniform(gen, leaf.shape), gen.integers(0, 512, t)
    feeds = {leaf: xv, pos: pv}
    ffv = ff = None
    if freq_factors:
        ffv = gen.uniform(1.0, 8.0, n_dims // 2)
        ff = od.input("ff", ffv.shape)
        feeds[ff] = ffv
    node = rope(x, pos, n_dims, mode, freq_factors=ff, **kw)
    assert node.shape == (b, t, h, d) and node.dtype.name == dt
    (out,) = evaluate(node, feeds)
    ref = rope_formula(stored(xv, dt).transpose(0, 2, 1, 3), pv, n_dims, mode, ff=ffv, **kw)
    # f16 output: both sides round to f16, ours through f32 (a double rounding may differ by an ulp)
    assert_close(out.astype(np.float64), stored(ref, dt), seed, 1e-7 if dt == "f32" else 1e-6)
    if n_dims < d:
        assert np.array_equal(out[..., n_dims:], from_float(dt, xv.transpose(0, 2, 1, 3)[..., n_dims:]))


def test_rope_3d(rng, seed):
    gen = rng
    x, pos = od.input("x", (5, 2, 16)), od.input("pos", (5,), "i32")
    xv, pv = uniform(gen, x.shape), gen.integers(0, 512, 5)
    (out,) = evaluate(rope(x, pos, 16, "neox", freq_base=500000.0), {x: xv, pos: pv})
    ref = rope_formula(xv[None], pv, 16, "neox", 500000.0, 1.0, 0.0, 1.0, 32.0, 1.0, 0, None)[0]
    assert_close(out, ref, seed)


def test_rope_errors():
    x, pos = od.input("x", (1, 7, 4, 64)), od.input("pos", (7,), "i32")
    cases = [
        (r"pos must have shape \(7,\)", lambda: rope(x, od.input("p", (6,), "i32"), 64)),
        ("pos dtype i64", lambda: rope(x, od.input("p", (7,), "i64"), 64)),
        ("x dtype bf16", lambda: rope(od.input("b", (7, 4, 64), "bf16"), pos, 64)),
        ("n_dims 63 must be even", lambda: rope(x, pos, 63)),
        ("n_dims 66 must be even", lambda: rope(x, pos, 66)),
        ("mode 'glm'", lambda: rope(x, pos, 64, "glm")),
        ("at least n_dims/2 = 32", lambda: rope(x, pos, 64, freq_factors=od.input("f", (16,)))),
    ]
    for match, build in cases:
        with pytest.raises(OpError, match=match) as info:
            build()
        assert str(info.value).startswith("rope:")


# ---------------------------------------------------------------------------- flash_attn_ext


def attention_formula(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, scale: float,
                      max_bias: float, softcap: float, sinks: np.ndarray | None) -> np.ndarray:
    """Per (batch, head, query): softmax over the unmasked keys of the capped, biased scores, times V."""
    n_b, n_head, n_q, _ = q.shape
    group = n_head // k.shape[1]
    out = np.zeros((n_b, n_q, n_head, v.shape[-1]))
    for b, h, t in itertools.product(range(n_b), range(n_head), range(n_q)):
        kk, vv = k[b, h // group], v[b, h // group]
        s = scale * (kk @ q[b, h, t])
        if softcap:
            s = softcap * np.tanh(s / softcap)
        keep = np.ones(len(s), bool)
        if mask is not None:
            row = slope_formula(h, n_head, max_bias) * mask[b % mask.shape[0], h % mask.shape[1], t]
            keep = row != -np.inf
            s = s + np.where(keep, row, 0.0)
        logits = list(s[keep]) + ([sinks[h]] if sinks is not None else [])
        if not logits:
            continue  # nothing to attend to: zeros
        top = max(logits)
        e = np.exp(s[keep] - top)
        total = e.sum() + (math.exp(sinks[h] - top) if sinks is not None else 0.0)
        out[b, t, h] = (e @ vv[keep]) / total
    return out


FA_FEATURES = {
    "plain": {},
    "mask": {"mask": True},
    "mask_sinks": {"mask": True, "sinks": True},
    "alibi": {"mask": True, "max_bias": 8.0},
    "softcap": {"mask": True, "softcap": 10.0},
}


# quantized K/V need a head size of whole 32-value blocks: q8_0 with 64 only
@pytest.mark.parametrize("d,kv_dt", [(64, "f32"), (64, "f16"), (64, "q8_0"), (80, "f32"), (80, "f16")])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("feature", list(FA_FEATURES))
def test_flash_attn_ext(rng, seed, d, gqa, kv_dt, feature):
    _run_flash_attn(rng, seed, d=d, dv=d, gqa=gqa, kv_dt=kv_dt, **FA_FEATURES[feature])


@pytest.mark.parametrize("case", [
    dict(d=64, dv=64, gqa=4, kv_dt="q4_0", mask=True, sinks=True),
    dict(d=64, dv=64, gqa=1, kv_dt="bf16", mask=True, max_bias=8.0, softcap=10.0, sinks=True),
    dict(d=64, dv=32, gqa=2, kv_dt="f16", q_dt="f16", mask=True),
    dict(d=80, dv=80, gqa=4, kv_dt="f16", mask=True, mask_per_head=True, sinks=True),
    dict(d=64, dv=64, gqa=1, kv_dt="f32", n_q=1, n_kv=113, mask=True),
])
def test_flash_attn_ext_more(rng, seed, case):
    _run_flash_attn(rng, seed, **case)


def _run_flash_attn(rng, seed, d: int, dv: int, gqa: int, kv_dt: str, q_dt: str = "f32", n_q: int = 7, n_kv: int = 33,
                    mask: bool = False, mask_per_head: bool = False, sinks: bool = False, max_bias: float = 0.0,
                    softcap: float = 0.0) -> None:
    gen = rng
    n_b, n_kv_head = 2, 2
    n_head = n_kv_head * gqa
    scale = 1.0 / math.sqrt(d)
    # q as llama.cpp builds it: a (B, Tq, Hq, D) tensor permuted to (B, Hq, Tq, D)
    q_leaf = od.input("q", (n_b, n_q, n_head, d), q_dt)
    q = q_leaf.permute(0, 2, 1, 3)
    # k, v: the first n_kv tokens of a larger cache (non-contiguous views)
    k_cache = od.input("k_cache", (n_b, n_kv_head, n_kv + 5, d), kv_dt)
    v_cache = od.input("v_cache", (n_b, n_kv_head, n_kv + 5, dv), kv_dt)
    k = k_cache.view((n_b, n_kv_head, n_kv, d), k_cache.strides)
    v = v_cache.view((n_b, n_kv_head, n_kv, dv), v_cache.strides)
    qv, kv, vv = uniform(gen, q_leaf.shape), uniform(gen, k_cache.shape), uniform(gen, v_cache.shape)
    feeds = {q_leaf: qv, k_cache: kv, v_cache: vv}
    m = s = mv = sv = None
    if mask:
        outer = (n_b, n_head) if mask_per_head else (1, 1)
        mv = random_mask(gen, (*outer, n_q + 3, n_kv), full_row=min(3, n_q - 1) if n_q > 1 else None)
        m = od.input("mask", mv.shape, "f16")
        feeds[m] = mv
    if sinks:
        sv = uniform(gen, (n_head,)) * 2
        s = od.input("sinks", sv.shape)
        feeds[s] = sv
    node = flash_attn_ext(q, k, v, m, scale=scale, max_bias=max_bias, softcap=softcap, sinks=s)
    assert node.shape == (n_b, n_q, n_head, dv) and node.dtype.name == "f32"
    (out,) = evaluate(node, feeds)
    ref = attention_formula(
        stored(qv, q_dt).transpose(0, 2, 1, 3), stored(kv, kv_dt)[:, :, :n_kv], stored(vv, kv_dt)[:, :, :n_kv],
        stored(mv, "f16") if mv is not None else None, scale, max_bias, softcap, sv,
    )
    assert_close(out, ref, seed)
    if mask and n_q > 1:
        assert np.all(out[:, min(3, n_q - 1)] == 0), f"fully masked row must be zero (seed {seed})"


def test_flash_attn_ext_errors():
    q, k, v = od.input("q", (1, 8, 7, 64)), od.input("k", (1, 2, 33, 64), "f16"), od.input("v", (1, 2, 33, 64), "f16")
    mask = od.input("mask", (1, 1, 7, 33), "f16")
    flash_attn_ext(q, k, v, mask, max_bias=8.0)  # valid
    cases = [
        ("head size differs: q has 64, k has 80", lambda: flash_attn_ext(q, od.input("k", (1, 2, 33, 80)), v)),
        ("not a multiple of kv heads 3", lambda: flash_attn_ext(
            q, od.input("k", (1, 3, 33, 64)), od.input("v", (1, 3, 33, 64)))),
        ("k and v differ", lambda: flash_attn_ext(q, k, od.input("v", (1, 2, 32, 64)))),
        ("batch differs", lambda: flash_attn_ext(
            od.input("q", (2, 8, 7, 64)), k, v)),
        ("k dtype q4_1", lambda: flash_attn_ext(q, od.input("k", (1, 2, 33, 64), "q4_1"), v)),
        ("q dtype bf16", lambda: flash_attn_ext(od.input("q", (1, 8, 7, 64), "bf16"), k, v)),
        ("mask dtype f32", lambda: flash_attn_ext(q, k, v, od.input("m", (1, 1, 7, 33)))),
        ("mask has 32 columns, expected 33", lambda: flash_attn_ext(q, k, v, od.input("m", (7, 32), "f16"))),
        ("mask has 6 rows", lambda: flash_attn_ext(q, k, v, od.input("m", (6, 33), "f16"))),
        ("mask outer dims", lambda: flash_attn_ext(q, k, v, od.input("m", (3, 7, 33), "f16"))),
        ("needs a mask", lambda: flash_attn_ext(q, k, v, max_bias=8.0)),
        (r"sinks must have shape \(8,\)", lambda: flash_attn_ext(q, k, v, sinks=od.input("s", (2,)))),
        ("q must be 4-D", lambda: flash_attn_ext(od.input("q", (8, 7, 64)), k, v)),
    ]
    for match, build in cases:
        with pytest.raises(OpError, match=match) as info:
            build()
        assert str(info.value).startswith("flash_attn_ext:") and "(" in str(info.value)


# ---------------------------------------------------------------------------- diag_mask_inf


@pytest.mark.parametrize("shape", [(11,), (7, 11), (2, 3, 7, 11)])
@pytest.mark.parametrize("n_past", [0, 3])
def test_diag_mask_inf(rng, seed, shape, n_past):
    gen = rng
    x = od.input("x", shape)
    xv = uniform(gen, shape)
    (out,) = evaluate(diag_mask_inf(x, n_past), {x: xv})
    ref = stored(xv, "f32")
    grid = ref.reshape((-1, 1, shape[0]) if len(shape) == 1 else (-1, *shape[-2:]))  # a view: writes reach ref
    for z, r, c in itertools.product(range(grid.shape[0]), range(grid.shape[1]), range(grid.shape[2])):
        if c > n_past + r:
            grid[z, r, c] = -np.inf
    assert_close(out, ref, seed, 0.0)


def test_diag_mask_inf_noncontiguous_and_errors(rng, seed):
    gen = rng
    leaf = od.input("x", (9, 5))
    xv = uniform(gen, leaf.shape)
    (out,) = evaluate(diag_mask_inf(leaf.T, 1), {leaf: xv})
    ref = xv.T.astype(np.float32).astype(np.float64)
    ref[np.arange(5)[:, None] + 1 < np.arange(9)[None, :]] = -np.inf
    assert_close(out, ref, seed, 0.0)
    with pytest.raises(OpError, match="diag_mask_inf: n_past must be >= 0"):
        diag_mask_inf(leaf, -1)
    with pytest.raises(OpError, match=r"diag_mask_inf: x dtype f16 .*\(9, 5\)"):
        diag_mask_inf(od.input("h", (9, 5), "f16"), 0)


def test_registered():
    for name in ("soft_max", "rope", "flash_attn_ext", "diag_mask_inf"):
        assert OPS[name].family == "attention" and name in REFERENCE
        assert OPS[name].doc, name
