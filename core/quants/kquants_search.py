"""ggml's per-sub-block scale searches for the K-quants, vectorized across sub-blocks.

make_qkx2_quants (q2_K, q4_K, q5_K: scale and min), make_q3_quants (q3_K)
and make_qx_quants (q6_K), as ggml-quants.c writes them without importance
weights. Every float32 operation is C's, in C's order: a sum over a
sub-block runs value by value (numpy's pairwise `sum` rounds differently),
``a*b*c`` is ``(a*b)*c``, an int code meets a float as float32, and codes
round by `nearest_int`. So the codes and scales, hence the bytes, are ggml's.

Layout: values arrive as (n, M), the n values of a sub-block down axis 0 and
the M sub-blocks of all super-blocks across axis 1, so each step of C's loop
over a sub-block is one contiguous numpy row and runs on every sub-block at once.
"""

from __future__ import annotations

import numpy as np

from .common import nearest_int

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)  # ggml: a sub-block with max |x| below this is all zero


def seq_sum(terms: np.ndarray) -> np.ndarray:
    """C's ``float s = 0; for (i) s += terms[i];`` over axis 0, rounding after every add."""
    s = F32(0) + terms[0]
    for t in terms[1:]:
        s = s + t
    return s


def chain_sum(terms: np.ndarray) -> np.ndarray:
    """As seq_sum, but starting from terms[0] itself (C: ``float s = terms[0]; for (i = 1..)``)."""
    s = terms[0]
    for t in terms[1:]:
        s = s + t
    return s


def first_absmax(x: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(amax, max): the largest |x| along `axis` and the first value with it, sign kept.

    ggml scans with ``if (ax > amax)`` from amax = 0, so the first of tied
    values wins, a NaN never does (a search's overflowed scale can be one),
    and a line of zeros gives max = +0.
    """
    ax = np.abs(x)
    ax = np.where(np.isnan(ax), F32(0), ax)
    amax = ax.max(axis=axis, keepdims=True)
    at = np.argmax(ax == amax, axis=axis)
    mx = np.take_along_axis(x, np.expand_dims(at, axis), axis=axis)
    amax = amax.squeeze(axis)
    return amax, np.where(amax > 0, mx.squeeze(axis), F32(0))


def _codes(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """MAX(lo, MIN(hi, nearest_int(v))): int32."""
    return np.clip(nearest_int(v), lo, hi)


def _error(scale: np.ndarray, lf: np.ndarray, mn: np.ndarray, x: np.ndarray, w: np.ndarray, mad: bool) -> np.ndarray:
    """sum of w*|scale*l + min - x| (mad) or w*(scale*l + min - x)**2, summed as C does."""
    diff = scale * lf + mn - x
    return seq_sum(w * (np.abs(diff) if mad else diff * diff))


def make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, w (n, M) -> (codes (n, M) int32 in 0..nmax, scale (M,), the_min (M,)): x ~ scale*code - the_min.

    The min is clamped to <= 0. Starting from the grid nmax/(max - min), it
    tries the grids (rmin + rdelta*is + nmax)/(max - min) for is = 0..nstep,
    fits scale and min to each by weighted least squares, and keeps a fit
    whose weighted error (|.| if use_mad, else squared) is strictly lower.
    A sub-block whose values are all equal and <= 0 gets codes 0, scale 0,
    the_min = -that value.
    """
    # ggml: min = max = x[0], then strict compares, so a NaN counts only as the first value
    mn0 = np.where(np.isnan(x[0]), x[0], np.fmin.reduce(x, axis=0))
    mx = np.where(np.isnan(x[0]), x[0], np.fmax.reduce(x, axis=0))
    sum_w = chain_sum(w)
    sum_x = chain_sum(w * x)
    mn0 = np.where(mn0 > 0, F32(0), mn0)
    flat = mx == mn0
    iscale = F32(nmax) / (mx - mn0)
    scale = F32(1) / iscale
    codes = _codes(iscale * (x - mn0), 0, nmax)
    best = _error(scale, codes.astype(F32), mn0, x, w, use_mad)
    mn = mn0
    for step in range(nstep + 1):
        # ggml reuses `min` here, which a kept fit has moved: the grid follows the best min so far
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (mx - mn)
        aux = _codes(iscale * (x - mn), 0, nmax)
        lf = aux.astype(F32)
        wl = w * lf
        sum_l, sum_l2, sum_xl = seq_sum(wl), seq_sum(wl * lf), seq_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min = np.where(positive, F32(0), this_min)
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        err = _error(this_scale, lf, this_min, x, w, use_mad)
        better = (det > 0) & (err < best)
        codes = np.where(better, aux, codes)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    return np.where(flat, 0, codes), np.where(flat, F32(0), scale), -np.where(flat, mn0, mn)


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """x (n, M) -> (codes (n, M) int32 in 0..2*nmax-1, scale (M,)): x ~ scale*(code - nmax); ggml's do_rmse path.

    Codes start at nearest_int(-nmax/max * x); then up to 5 passes of
    coordinate descent move one code at a time to its best value for the
    weighted (w = x*x) least-squares scale of the others, keeping a move that
    raises sumlx**2/suml2. ggml stops after a pass without a move; such a
    pass leaves the state as it was, so every later pass would too, and
    running all 5 on every sub-block gives ggml's result. An all-zero
    sub-block (max |x| < 1e-15) gets codes 0 and scale 0.
    """
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    iscale = F32(-nmax) / mx
    codes = _codes(iscale * x, -nmax, nmax - 1)
    w = x * x
    wx = w * x
    lf = codes.astype(F32)
    sumlx, suml2 = seq_sum(wx * lf), seq_sum(w * lf * lf)
    for _ in range(5):
        for i in range(x.shape[0]):
            li = lf[i]
            rest_lx = sumlx - wx[i] * li  # the sums without value i
            rest_l2 = suml2 - w[i] * li * li
            new = _codes(x[i] * rest_l2 / rest_lx, -nmax, nmax - 1)
            nf = new.astype(F32)
            slx = rest_lx + wx[i] * nf
            sl2 = rest_l2 + w[i] * nf * nf
            take = (rest_lx > 0) & (new != codes[i]) & (sl2 > 0) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            codes[i] = np.where(take, new, codes[i])
            lf[i] = np.where(take, nf, li)
            sumlx = np.where(take, slx, sumlx)
            suml2 = np.where(take, sl2, suml2)
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    return np.where(zero, 0, codes + nmax), np.where(zero, F32(0), scale)


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """x (n, M) -> (codes (n, M) int32 in 0..2*nmax-1, scale (M,)): x ~ scale*(code - nmax); rmse_type 1.

    Codes nearest_int(iscale*x) for iscale = -(nmax + 0.1*is)/max, is = 0 and
    then -9..9; a grid is kept when its weighted (w = x*x) least-squares fit
    is strictly better (sumlx**2/suml2 above the best so far). An all-zero
    sub-block gets codes 0 and scale 0.
    """
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    wx = w * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        l = _codes(iscale * x, -nmax, nmax - 1)
        lf = l.astype(F32)
        return l, seq_sum(wx * lf), seq_sum(w * lf * lf)

    codes, sumlx, suml2 = fit(F32(-nmax) / mx)
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        l, sumlx, suml2 = fit(-(F32(nmax) + F32(0.1) * F32(step)) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        codes = np.where(better, l, codes)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(zero, 0, codes + nmax), np.where(zero, F32(0), scale)
