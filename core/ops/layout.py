"""Layout ops (family "shape"): concat, repeat, pad, pad_reflect_1d, roll, arange, fill, diag, tri,
timestep_embedding."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..tensor import Tensor
from .base import (can_repeat, check, check_dtype, check_rank, check_tensor, choice_param, fail, float_param, int_param,
                   ints_param, node, op)

__all__ = [
    "concat", "repeat", "pad", "pad_reflect_1d", "roll", "arange", "fill", "diag", "tri",
    "timestep_embedding",
]

TRI_KINDS = ("lower", "upper", "lower_diag", "upper_diag")


@op("shape")
def concat(a: Tensor, b: Tensor, axis: int) -> Tensor:
    """np.concatenate((a, b), axis): same dtype (any, block formats included), same rank, other axes equal."""
    check_tensor("concat", a, "a")
    check_tensor("concat", b, "b")
    check_rank("concat", a, 1)
    check(a.dtype == b.dtype, "concat", f"dtypes differ: {a.dtype.name} vs {b.dtype.name}", a, b)
    check(a.ndim == b.ndim, "concat", f"ranks differ: {a.ndim} vs {b.ndim}", a, b)
    axis = int_param("concat", "axis", axis, a, b)
    check(-a.ndim <= axis < a.ndim, "concat", f"axis {axis} out of range for {a.ndim} axes", a, b)
    axis %= a.ndim
    same = all(na == nb for i, (na, nb) in enumerate(zip(a.shape, b.shape)) if i != axis)
    check(same, "concat", f"shapes differ outside axis {axis}", a, b)
    shape = tuple(na + nb if i == axis else na for i, (na, nb) in enumerate(zip(a.shape, b.shape)))
    return node("concat", (a, b), shape, a.dtype, {"axis": axis})


@op("shape")
def repeat(a: Tensor, shape: Sequence[int]) -> Tensor:
    """Tile a to `shape` (np.tile): each axis of shape a multiple of a's (a padded with leading 1s).

    ggml_repeat; dtypes f32, f16, bf16, i16, i32 (ggml's CPU).
    """
    check_tensor("repeat", a)
    check_dtype("repeat", a, ("f32", "f16", "bf16", "i16", "i32"))
    check_rank("repeat", a, 1)
    shape = ints_param("repeat", "shape", shape, None, a)
    check(a.ndim <= len(shape) <= 4, "repeat", f"target shape {shape} needs {a.ndim}..4 axes", a)
    check(can_repeat(a.shape, shape), "repeat", f"target shape {shape} is not a multiple of a's shape", a)
    return node("repeat", (a,), shape, a.dtype, {"shape": shape})


@op("shape")
def pad(x: Tensor, pads: Sequence[Sequence[int]]) -> Tensor:
    """np.pad(x, pads) with zeros: pads holds one (before, after) pair per axis (ggml_pad_ext); f32."""
    check_tensor("pad", x)
    check_dtype("pad", x, ("f32",))
    check_rank("pad", x, 1)
    try:
        pairs = tuple(ints_param("pad", "pads", pair, 2, x) for pair in pads)
    except TypeError:
        fail("pad", f"pads must be (before, after) pairs, got {pads!r}", x)
    check(len(pairs) == x.ndim, "pad", f"{len(pairs)} (before, after) pairs for {x.ndim} axes", x)
    check(all(lo >= 0 and hi >= 0 for lo, hi in pairs), "pad", f"negative padding in {pairs}", x)
    shape = tuple(n + lo + hi for n, (lo, hi) in zip(x.shape, pairs))
    return node("pad", (x,), shape, x.dtype, {"pads": pairs})


@op("shape")
def pad_reflect_1d(x: Tensor, p0: int, p1: int) -> Tensor:
    """np.pad(x, ..., mode="reflect") on the last axis: p0 before, p1 after, edge not repeated; f32.

    [a, b, c, d] with p0 = p1 = 1 -> [b, a, b, c, d, c]; 0 <= p0, p1 < x.shape[-1].
    """
    check_tensor("pad_reflect_1d", x)
    check_dtype("pad_reflect_1d", x, ("f32",))
    check_rank("pad_reflect_1d", x, 1)
    p0, p1 = int_param("pad_reflect_1d", "p0", p0, x), int_param("pad_reflect_1d", "p1", p1, x)
    n = x.shape[-1]
    check(0 <= p0 < n and 0 <= p1 < n, "pad_reflect_1d",
          f"padding ({p0}, {p1}) must be non-negative and less than the last axis {n}", x)
    return node("pad_reflect_1d", (x,), x.shape[:-1] + (n + p0 + p1,), x.dtype, {"p0": p0, "p1": p1})


@op("shape")
def roll(x: Tensor, shifts: Sequence[int]) -> Tensor:
    """np.roll on every axis: out[..., i, ...] = x[..., (i - shifts[axis]) % n, ...]; f32.

    One shift per axis, |shift| < the axis length (ggml_roll asserts it).
    """
    check_tensor("roll", x)
    check_dtype("roll", x, ("f32",))
    check_rank("roll", x, 1)
    shifts = ints_param("roll", "shifts", shifts, x.ndim, x)
    check(all(abs(s) < max(n, 1) for s, n in zip(shifts, x.shape)), "roll",
          f"each |shift| must be less than its axis length, got {shifts}", x)
    return node("roll", (x,), x.shape, x.dtype, {"shifts": shifts})


@op("shape")
def arange(start: float, stop: float, step: float = 1.0) -> Tensor:
    """f32 [start, start + step, ...] below stop: ceil((stop - start) / step) values start + step*i.

    Computed in float32 as ggml does (start, stop, step are rounded to f32);
    finite, stop > start and step > 0. A node without sources.
    """
    given = [float_param("arange", k, v) for k, v in (("start", start), ("stop", stop), ("step", step))]
    with np.errstate(over="ignore"):  # a finite float64 beyond f32's range rounds to inf: refused below
        start32, stop32, step32 = (np.float32(v) for v in given)
    check(all(np.isfinite(v) for v in (start32, stop32, step32)), "arange",
          f"start, stop and step must be finite in float32, got ({start}, {stop}, {step})")
    check(stop32 > start32 and step32 > 0, "arange", f"needs stop > start and step > 0, got ({start}, {stop}, {step})")
    with np.errstate(over="ignore"):
        count = np.ceil((stop32 - start32) / step32)
    check(bool(np.isfinite(count)), "arange", f"({start}, {stop}, {step}) gives more values than float32 counts")
    n = int(count)
    params = {"start": float(start32), "stop": float(stop32), "step": float(step32)}
    return node("arange", (), (n,), "f32", params)


@op("shape")
def fill(x: Tensor, value: float) -> Tensor:
    """A tensor of x's shape and dtype (f32 or f16) with every element `value` (ggml_fill; +-inf too, not
    NaN); x is not read."""
    check_tensor("fill", x)
    check_dtype("fill", x, ("f32", "f16"))
    check_rank("fill", x, 1)
    return node("fill", (x,), x.shape, x.dtype, {"value": float_param("fill", "value", value, x, finite=False)})


@op("shape")
def diag(x: Tensor) -> Tensor:
    """Rows to diagonal matrices (ggml_diag): x (..., 1, N) or (N,) -> (..., N, N); f32.

    out[..., i, i] = x[..., 0, i], zero elsewhere.
    """
    check_tensor("diag", x)
    check_dtype("diag", x, ("f32",))
    check_rank("diag", x, 1)
    n = x.shape[-1]
    if x.ndim == 1:
        return node("diag", (x,), (n, n), x.dtype)
    check(x.shape[-2] == 1, "diag", f"expected a row per matrix (axis -2 of size 1), got {x.shape[-2]}", x)
    return node("diag", (x,), x.shape[:-2] + (n, n), x.dtype)


@op("shape")
def tri(x: Tensor, kind: str) -> Tensor:
    """Keep a triangle of square matrices (..., N, N), zero elsewhere (ggml_tri); f32.

    kind: "lower" = np.tril(x, -1) (strict), "lower_diag" = np.tril(x),
    "upper" = np.triu(x, 1) (strict), "upper_diag" = np.triu(x).
    """
    check_tensor("tri", x)
    check_dtype("tri", x, ("f32",))
    check_rank("tri", x, 2)
    choice_param("tri", "kind", kind, TRI_KINDS, x)
    check(x.shape[-1] == x.shape[-2], "tri", f"matrices must be square, got {x.shape[-2:]}", x)
    return node("tri", (x,), x.shape, x.dtype, {"kind": kind})


@op("shape")
def timestep_embedding(t: Tensor, dim: int, max_period: int = 10000) -> Tensor:
    """Sinusoidal embedding of timesteps t f32 (N,) -> f32 (N, dim) (ggml_timestep_embedding).

    half = dim // 2, freq[j] = exp(-ln(max_period) * j / half);
    out[:, :half] = cos(t * freq), out[:, half:2*half] = sin(t * freq), and
    for odd dim the last column is 0.
    """
    check_tensor("timestep_embedding", t)
    check_dtype("timestep_embedding", t, ("f32",))
    check_rank("timestep_embedding", t, 1, 1)
    dim = int_param("timestep_embedding", "dim", dim, t)
    max_period = int_param("timestep_embedding", "max_period", max_period, t)
    check(dim >= 1 and max_period >= 1, "timestep_embedding",
          f"dim and max_period must be positive, got {dim}, {max_period}", t)
    return node("timestep_embedding", (t,), (t.shape[0], dim), "f32", {"dim": dim, "max_period": max_period})
