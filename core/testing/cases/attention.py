"""Cases of the attention pieces (soft_max, rope, flash_attn_ext, diag_mask_inf) and rope+view+set_rows."""

from __future__ import annotations

import itertools
import math
from typing import Iterator

import numpy as np

from ... import ops
from ...tensor import Tensor
from .base import NON_FINITE, Case, Inputs, bound, dims
from .registry import fused, generator


def soft_max_case(shape: tuple[int, ...], mask: str | None = None, scale: float = 1.0, max_bias: float = 0.0,
                  sinks: bool = False, mask_shape: tuple[int, ...] | None = None) -> Case:
    def make(inp: Inputs) -> Tensor:
        m = inp.mask(mask_shape or (1, 1, *shape[-2:]), mask) if mask else None
        s = inp.uniform((shape[-3],)) if sinks else None
        return ops.soft_max(inp.uniform(shape), m, scale, max_bias, s)

    label = f"{dims(shape)} mask={mask and dims(mask_shape or (1, 1, *shape[-2:]))}:{mask} scale={scale:g} " \
            f"max_bias={max_bias:g} sinks={sinks}"
    return Case("soft_max", label, make, bound("soft_max"))


@generator("soft_max")
def _soft_max(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield soft_max_case((1, 32, 2, 16))
        yield soft_max_case((1, 4, 7, 32), "f16", 0.1)
        yield soft_max_case((2, 4, 5, 13), "f32", 1.0, 8.0, True, (2, 1, 8, 13))
        return
    for cols, mask, scale, max_bias, sinks in itertools.product(
            (16, 1023, 4096), (None, "f16", "f32"), (1.0, 0.1), (0.0, 8.0), (False, True)):
        if max_bias and not mask:
            continue
        yield soft_max_case((2, 4, 3, cols), mask, scale, max_bias, sinks)
    for mask_shape in ((1, 1, 3, 33), (2, 1, 3, 33), (1, 4, 16, 33), (2, 4, 3, 33)):
        yield soft_max_case((2, 4, 3, 33), "f16", 0.1, 8.0, True, mask_shape)
    yield soft_max_case((1, 3, 2, 200001))
    yield soft_max_case((1, 3, 2, 200001), "f32", 0.1, 8.0, True)


#: soft_max edge rows: all -inf (zeros), a NaN, a +inf (the row NaN), mostly -inf
SOFTMAX_EDGE_ROWS = ((-np.inf,), (0.3, np.nan, -0.2), (0.1, np.inf, -0.5), (-np.inf, 0.5, -np.inf, -np.inf))


def soft_max_edge_case(shape: tuple[int, ...], scale: float = 1.0, masked: bool = False, sinks: bool = False) -> Case:
    """soft_max over rows of edge values (SOFTMAX_EDGE_ROWS first, then values in [-1, 1) with some
    infinities and NaN); `masked`: an f16 mask that empties every other row."""
    def make(inp: Inputs) -> Tensor:
        a = inp.special(shape, "f32", NON_FINITE, 0.05, rows=SOFTMAX_EDGE_ROWS)
        m = inp.mask((1, 1, *shape[-2:]), "f16", empty_rows=True) if masked else None
        s = inp.uniform((shape[-3],)) if sinks else None
        return ops.soft_max(a, m, scale, 0.0, s)

    return Case("soft_max", f"edges {dims(shape)} scale={scale:g} masked={masked} sinks={sinks}", make,
                bound("soft_max"))


@generator("soft_max")
def _soft_max_edges(op: str, full: bool) -> Iterator[Case]:
    yield soft_max_edge_case((1, 2, 6, 13))
    yield soft_max_edge_case((1, 2, 6, 64), -1.0, masked=True)
    yield soft_max_edge_case((1, 1, 4, 40000), sinks=True)  # rows read twice (the online pass)
    if full:
        for cols, scale, masked, sinks in itertools.product((13, 64, 1023), (1.0, -1.0), (False, True), (False, True)):
            yield soft_max_edge_case((2, 2, 6, cols), scale, masked, sinks)


def rope_case(dt: str, mode: str, shape: tuple[int, ...], n_dims: int, freq_factors: bool = False,
              yarn: bool = False, layout: str = "contig") -> Case:
    b, t, h, d = shape
    params = dict(freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0, beta_fast=32.0,
                  beta_slow=1.0, n_ctx_orig=0)
    if yarn:
        params.update(freq_base=500000.0, freq_scale=0.25, ext_factor=1.0, attn_factor=1.2, n_ctx_orig=4096)

    def make(inp: Inputs) -> Tensor:
        ff = inp.uniform((n_dims // 2,), lo=0.9, hi=1.1) if freq_factors else None
        x = inp.uniform(shape, dt, layout=layout)
        return ops.rope(x, inp.ints((t,), 0, 512), n_dims, mode, freq_factors=ff, **params)

    label = f"{dt} {mode} {dims(shape)} n_dims={n_dims} ff={freq_factors} yarn={yarn} {layout}"
    return Case("rope", label, make, bound("rope", dt))


@generator("rope")
def _rope(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield rope_case("f32", "normal", (1, 7, 4, 64), 64)
        yield rope_case("f16", "neox", (2, 5, 3, 128), 64, freq_factors=True)
        yield rope_case("f32", "neox", (1, 5, 4, 80), 80, yarn=True, layout="perm")
        return
    for dt, mode, d, partial, ff, yarn, layout in itertools.product(
            ("f32", "f16"), ("normal", "neox"), (64, 80, 128), (False, True), (False, True), (False, True),
            ("contig", "perm")):
        yield rope_case(dt, mode, (2, 13, 4, d), d // 2 if partial else d, ff, yarn, layout)


def fa_case(d: int, n_kv: int, hq: int, hkv: int, n_q: int, kv: str = "f16", mask: bool = True,
            batch: int = 1, sinks: bool = False, max_bias: float = 0.0, softcap: float = 0.0,
            q_dtype: str = "f32", dv: int | None = None, empty_rows: bool = False, mask_batch: bool = False) -> Case:
    dv = dv or d
    pad = -(-n_q // 16) * 16  # mask rows padded, as ggml pads them to GGML_KQ_MASK_PAD

    def make(inp: Inputs) -> Tensor:
        q = inp.uniform((batch, hq, n_q, d), q_dtype, layout="perm")
        k = inp.uniform((batch, hkv, n_kv, d), kv, layout="perm")
        v = inp.uniform((batch, hkv, n_kv, dv), kv, layout="perm")
        m = inp.mask((batch if mask_batch else 1, 1, pad, n_kv), "f16", empty_rows) if mask or max_bias else None
        s = inp.uniform((hq,)) if sinks else None
        return ops.flash_attn_ext(q, k, v, m, 1.0 / math.sqrt(d), max_bias, softcap, s)

    label = (f"d={d}{f'/{dv}' if dv != d else ''} kv={n_kv} h={hq}/{hkv} q={n_q} b={batch} {q_dtype}/{kv} "
             f"mask={mask or bool(max_bias)}{'(b)' if mask_batch else ''}{' empty-rows' if empty_rows else ''} "
             f"sinks={sinks} max_bias={max_bias:g} softcap={softcap:g}")
    flops = 2 * batch * hq * n_q * n_kv * (d + dv)
    return Case("flash_attn_ext", label, make, bound("flash_attn_ext"), flops)


@generator("flash_attn_ext")
def _flash_attn_ext(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield fa_case(64, 113, 4, 4, 1)
        yield fa_case(128, 113, 8, 2, 7, mask=False)
        yield fa_case(80, 113, 4, 1, 3, "bf16", batch=2, sinks=True, softcap=10.0, mask_batch=True)
        yield fa_case(64, 113, 4, 4, 2, "q8_0", max_bias=8.0)
        return
    for d, n_kv, gqa, mask in itertools.product((64, 80, 96, 128, 256), (113, 512, 1024), (1, 4, 8), (False, True)):
        yield fa_case(d, n_kv, 2 * gqa, 2, 1 if n_kv != 512 else 35, mask=mask)
    for d, kv in itertools.product((64, 128), ("f32", "f16", "bf16", "q8_0", "q4_0")):
        yield fa_case(d, 512, 8, 2, 7, kv, sinks=True)
        yield fa_case(d, 512, 8, 2, 7, kv, max_bias=8.0)
        yield fa_case(d, 512, 8, 2, 7, kv, softcap=10.0)
        yield fa_case(d, 113, 4, 4, 35, kv, batch=2, mask_batch=True)
    yield fa_case(128, 113, 4, 2, 5, q_dtype="f16")
    yield fa_case(192, 113, 4, 1, 5, dv=128)
    yield fa_case(64, 113, 4, 2, 8, empty_rows=True)
    yield fa_case(64, 113, 4, 2, 8, empty_rows=True, sinks=True)


@generator("diag_mask_inf")
def _diag_mask_inf(op: str, full: bool) -> Iterator[Case]:
    def one(shape: tuple[int, ...], n_past: int, layout: str) -> Case:
        return Case(op, f"{dims(shape)} n_past={n_past} {layout}",
                    lambda inp: ops.diag_mask_inf(inp.uniform(shape, layout=layout), n_past), bound(op))

    yield one((2, 3, 10, 10), 5, "contig")
    yield one((1, 5, 13), 0, "perm")
    if full:
        for shape, n_past, layout in itertools.product(((3, 7, 7), (2, 5, 16)), (0, 3), ("T", "strided")):
            yield one(shape, n_past, layout)


@fused("rope_set_rows", needs=("rope", "view", "set_rows"))
def _rope_set_rows(name: str, full: bool) -> Iterator[Case]:
    def one(cache: str, mode: str, n_tok: int, heads: int, d: int, rows: int, idx: str) -> Case:
        def make(inp: Inputs) -> Tensor:
            k = ops.rope(inp.uniform((1, n_tok, heads, d)), inp.ints((n_tok,), 0, 512), d, mode)
            dst = inp.uniform((rows, heads * d), cache)
            return ops.set_rows(dst, k.view((n_tok, heads * d)), inp.ids((n_tok,), rows, idx))

        return Case("set_rows", f"cache={cache} {mode} t={n_tok} h={heads} d={d} rows={rows} idx={idx}", make,
                    bound("set_rows", cache, n_tok * heads * d), fused=name)

    yield one("f16", "neox", 1, 4, 64, 32, "i64")
    yield one("f32", "normal", 5, 2, 128, 16, "i32")
    if full:
        for cache, mode, n_tok in itertools.product(("f32", "f16", "bf16", "q8_0"), ("normal", "neox"), (1, 7, 64)):
            yield one(cache, mode, n_tok, 8, 128, 256, "i64")


def fa_edge_case(d: int, n_kv: int, hq: int, hkv: int, n_q: int, sinks: bool = False) -> Case:
    """flash_attn_ext with keys 5..11 hidden from every query by the mask and NaN in their K rows
    (garbage under the mask is skipped); with several query rows, every other one fully masked (zeros)."""
    pad = -(-n_q // 16) * 16

    def make(inp: Inputs) -> Tensor:
        q = inp.uniform((1, hq, n_q, d), layout="perm")
        keys = inp.rng.uniform(-1.0, 1.0, (1, hkv, n_kv, d))
        keys[:, :, 5:12, :] = np.nan
        v = inp.uniform((1, hkv, n_kv, d), "f16", layout="perm")
        m = inp.mask((1, 1, pad, n_kv), "f16", empty_rows=n_q > 1, hidden=(5, 12))
        s = inp.uniform((hq,)) if sinks else None
        return ops.flash_attn_ext(q, inp.given(keys, "f16"), v, m, 1.0 / math.sqrt(d), 0.0, 0.0, s)

    return Case("flash_attn_ext", f"edges d={d} kv={n_kv} h={hq}/{hkv} q={n_q} NaN K under the mask"
                f"{', empty rows' if n_q > 1 else ''} sinks={sinks}", make, bound("flash_attn_ext"),
                4 * hq * n_q * n_kv * d)


@generator("flash_attn_ext")
def _flash_attn_ext_edges(op: str, full: bool) -> Iterator[Case]:
    yield fa_edge_case(64, 113, 4, 2, 1)  # the split-K decode kernel
    yield fa_edge_case(64, 113, 4, 2, 40, sinks=True)  # the tensor-core prefill
    if full:
        for d, n_q, sinks in itertools.product((128, 256), (3, 70), (False, True)):
            yield fa_edge_case(d, 512, 8, 2, n_q, sinks)
