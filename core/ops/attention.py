"""Attention pieces: soft_max, rope, flash_attn_ext, diag_mask_inf.

The host-side parameters ggml computes once per op (ALiBi's slopes, YaRN's
correction dims and magnitude) are here too: they are op semantics, which the
reference and the device plugins both import rather than restate.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ..tensor import Tensor
from .base import check, check_dtype, check_rank, check_tensor, choice_param, float_param, int_param, node, op, pad4

__all__ = ["soft_max", "rope", "flash_attn_ext", "diag_mask_inf"]

ROPE_MODES = ("normal", "neox")
KV_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def _check_rows(op_name: str, t: Tensor, what: str) -> None:
    check(t.rows_contiguous(), op_name, f"{what} rows must be contiguous (last stride {t.strides[-1]})", t)


def _check_mask(op_name: str, mask: Tensor, dtypes: tuple[str, ...], rows: int, cols: int, outer: tuple[int, int],
                ref: Tensor) -> None:
    """mask `(M3, M2, >= rows, cols)`, M3 and M2 dividing `outer` (broadcast by modulo)."""
    check_tensor(op_name, mask, "mask")
    check_rank(op_name, mask, 2)
    check_dtype(op_name, mask, dtypes, "mask")
    _check_rows(op_name, mask, "mask")
    m = pad4(mask.shape)
    check(m[3] == cols, op_name, f"mask has {m[3]} columns, expected {cols}", mask, ref)
    check(m[2] >= rows, op_name, f"mask has {m[2]} rows, fewer than the {rows} needed", mask, ref)
    check(outer[0] % m[0] == 0 and outer[1] % m[1] == 0, op_name,
          f"mask outer dims {m[:2]} do not divide {outer} (broadcast by modulo)", mask, ref)


def _check_sinks(op_name: str, sinks: Tensor, n_head: int, ref: Tensor) -> None:
    check_tensor(op_name, sinks, "sinks")
    check_dtype(op_name, sinks, ("f32",), "sinks")
    check(sinks.shape == (n_head,), op_name, f"sinks must have shape ({n_head},), one per head", sinks, ref)


@op("attention")
def soft_max(a: Tensor, mask: Tensor | None = None, scale: float = 1.0, max_bias: float = 0.0,
             sinks: Tensor | None = None) -> Tensor:
    """Softmax over the last axis of ``a*scale + slope_h*mask`` (ggml_soft_max_ext).

    a f32 `(A3, A2, R, C)`, 1..4 dims, rows contiguous; the head h is the
    index on axis A2 (ggml's ne[2]). mask f16/f32 `(M3, M2, >= R, C)`: row r
    of a uses mask row r, and outer indices broadcast by modulo (a's
    i3 % M3, i2 % M2). slope_h = alibi_slopes(A2, max_bias)[h] (1 when
    max_bias <= 0; max_bias > 0 needs a mask, as in ggml). sinks f32 `(A2,)`:
    one extra logit per head, counted in the max and the sum, with no output
    entry. scale and max_bias are finite. Result f32, a's shape.

    A row whose every logit is -inf (and no sink) gives zeros (ggml leaves
    it NaN; the reference decides: the limit of a sink at -inf).
    """
    name = "soft_max"
    check_tensor(name, a, "a")
    check_rank(name, a, 1)
    check_dtype(name, a, ("f32",), "a")
    _check_rows(name, a, "a")
    params = {"scale": float_param(name, "scale", scale, a), "max_bias": float_param(name, "max_bias", max_bias, a)}
    pa = pad4(a.shape)
    if mask is not None:
        _check_mask(name, mask, ("f16", "f32"), pa[2], pa[3], (pa[0], pa[1]), a)
    check(params["max_bias"] <= 0 or mask is not None, name, f"max_bias {max_bias} (ALiBi) needs a mask", a)
    if sinks is not None:
        _check_sinks(name, sinks, pa[1], a)
    return node(name, (a, mask, sinks), a.shape, "f32", params)


@op("attention")
def rope(x: Tensor, pos: Tensor, n_dims: int, mode: str = "normal", freq_base: float = 10000.0,
         freq_scale: float = 1.0, ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
         beta_slow: float = 1.0, n_ctx_orig: int = 0, freq_factors: Tensor | None = None) -> Tensor:
    """Rotary position embedding of the first n_dims of the last axis (ggml_rope_ext), with YaRN.

    x f32/f16 `(B, T, H, D)` (ggml ne = [D, H, T, B]; 1..4 dims, missing
    outer dims 1: the token axis is axis -3), pos i32 `(T,)`, 0 < n_dims <= D,
    n_dims even. For pair i < n_dims/2 of token t:
    theta_ext = pos[t] * freq_base**(-2i/n_dims) / freq_factors[i]
    (freq_factors f32, >= n_dims/2 values, default 1), theta_int =
    freq_scale*theta_ext. With ext_factor != 0 (YaRN): corr(r) =
    n_dims*ln(n_ctx_orig/(2*pi*r)) / (2*ln(freq_base)), lo = max(0,
    floor(corr(beta_fast))), hi = min(n_dims - 1, ceil(corr(beta_slow)))
    (ggml_rope_yarn_corr_dims, in float32: `rope_yarn_corr_dims`),
    mix = ext_factor*(1 - clip((i - lo)/max(0.001, hi - lo), 0, 1)),
    theta = theta_int*(1 - mix) + theta_ext*mix, mscale = attn_factor*(1 +
    0.1*ln(1/freq_scale)); else theta = theta_int, mscale = attn_factor.
    c = cos(theta)*mscale, s = sin(theta)*mscale; (x0, x1) -> (x0*c - x1*s,
    x0*s + x1*c) for the pair (2i, 2i+1) in mode "normal" (ggml mode 0) or
    (i, i + n_dims/2) in mode "neox" (ggml mode 2). Dims >= n_dims pass
    through. Result: x's shape and dtype. The float params are finite,
    freq_base > 0 (its log is taken), freq_scale > 0 with YaRN (ext_factor
    != 0: ln(1/freq_scale)); n_ctx_orig >= 0.
    """
    name = "rope"
    check_tensor(name, x, "x")
    check_tensor(name, pos, "pos")
    check_rank(name, x, 1)
    check_dtype(name, x, ("f32", "f16"), "x")
    check_dtype(name, pos, ("i32",), "pos")
    n_tok = pad4(x.shape)[1]
    check(pos.shape == (n_tok,), name, f"pos must have shape ({n_tok},), one per token (axis -3 of x)", pos, x)
    choice_param(name, "mode", mode, ROPE_MODES, x)
    n_dims = int_param(name, "n_dims", n_dims, x)
    check(0 < n_dims <= x.shape[-1] and n_dims % 2 == 0, name,
          f"n_dims {n_dims} must be even and in 1..{x.shape[-1]}", x)
    floats = {k: float_param(name, k, v, x) for k, v in (
        ("freq_base", freq_base), ("freq_scale", freq_scale), ("ext_factor", ext_factor),
        ("attn_factor", attn_factor), ("beta_fast", beta_fast), ("beta_slow", beta_slow))}
    check(floats["freq_base"] > 0, name, f"freq_base must be > 0, got {freq_base}", x)
    check(floats["ext_factor"] == 0 or floats["freq_scale"] > 0, name,
          f"freq_scale must be > 0 with YaRN (ext_factor {ext_factor}), got {freq_scale}", x)
    if freq_factors is not None:
        check_tensor(name, freq_factors, "freq_factors")
        check_dtype(name, freq_factors, ("f32",), "freq_factors")
        check(freq_factors.ndim == 1 and freq_factors.shape[0] >= n_dims // 2, name,
              f"freq_factors must be a vector of at least n_dims/2 = {n_dims // 2} values", freq_factors)
    n_ctx_orig = int_param(name, "n_ctx_orig", n_ctx_orig, x, lo=0)
    params = {"n_dims": n_dims, "mode": mode, **floats, "n_ctx_orig": n_ctx_orig}
    return node(name, (x, pos, freq_factors), x.shape, x.dtype, params)


@op("attention")
def flash_attn_ext(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float = 1.0,
                   max_bias: float = 0.0, softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """Fused attention ``softmax(scale*q@k^T + slope*mask) @ v`` per head (ggml_flash_attn_ext).

    q f32/f16 `(B, Hq, Tq, Dk)`, k `(B, Hkv, Tk, Dk)`, v `(B, Hkv, Tk, Dv)`,
    k and v each f32/f16/bf16/q8_0/q4_0, all 4-D with rows contiguous, Hq %
    Hkv == 0: query head h reads kv head h // (Hq // Hkv). Logit
    s = scale*(q.k); with softcap != 0, s = softcap*tanh(s/softcap); then
    s += slope_h*mask (ALiBi slopes as soft_max; max_bias > 0 needs a mask).
    mask f16 `(M3, M2, >= Tq, Tk)` (2..4 dims; M3 divides B, M2 divides Hq,
    broadcast by modulo; ggml pads Tq to GGML_KQ_MASK_PAD, we only need >= Tq).
    Entries whose slope*mask is -inf are skipped; sinks f32 `(Hq,)` add one
    logit per head to the softmax; a row with nothing left outputs zeros.
    Result f32 `(B, Tq, Hq, Dv)`: heads and tokens swapped relative to q
    (ggml ne = [Dv, Hq, Tq, B]), ready for the output projection.

    scale, max_bias and softcap are finite.

    The reference dequantizes K/V and accumulates in float64; ggml's CPU
    rounds q to K's dot type (f16/q8_0) and accumulates f16 V in f16.
    """
    name = "flash_attn_ext"
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        check_tensor(name, t, what)
        check(t.ndim == 4, name, f"{what} must be 4-D, got {t.ndim} dims", t)
        _check_rows(name, t, what)
    check_dtype(name, q, ("f32", "f16"), "q")
    check_dtype(name, k, KV_DTYPES, "k")
    check_dtype(name, v, KV_DTYPES, "v")
    params = {k: float_param(name, k, val, q) for k, val in (("scale", scale), ("max_bias", max_bias),
                                                              ("softcap", softcap))}
    b_, hq, tq, dk = q.shape
    check(k.shape[3] == dk, name, f"head size differs: q has {dk}, k has {k.shape[3]}", q, k)
    check(k.shape[:3] == v.shape[:3], name,
          f"k and v differ in (batch, heads, tokens): {k.shape[:3]} vs {v.shape[:3]}", k, v)
    check(k.shape[0] == b_, name, f"batch differs: q has {b_}, k has {k.shape[0]}", q, k)
    check(k.shape[1] > 0 and hq % k.shape[1] == 0, name,
          f"q heads {hq} are not a multiple of kv heads {k.shape[1]}", q, k)
    if mask is not None:
        _check_mask(name, mask, ("f16",), tq, k.shape[2], (b_, hq), q)
    check(params["max_bias"] <= 0 or mask is not None, name, f"max_bias {max_bias} (ALiBi) needs a mask", q)
    if sinks is not None:
        _check_sinks(name, sinks, hq, q)
    return node(name, (q, k, v, mask, sinks), (b_, tq, hq, v.shape[3]), "f32", params)


@op("attention")
def diag_mask_inf(x: Tensor, n_past: int) -> Tensor:
    """Causal mask: ``x[..., r, c]`` becomes -inf where c > n_past + r (ggml_diag_mask_inf).

    x f32, 1..4 dims (r is axis -2, 0 for a vector; c the last axis); every
    other entry is copied. n_past >= 0. Result f32, x's shape.
    """
    name = "diag_mask_inf"
    check_tensor(name, x, "x")
    check_rank(name, x, 1)
    check_dtype(name, x, ("f32",), "x")
    return node(name, (x,), x.shape, "f32", {"n_past": int_param(name, "n_past", n_past, x, lo=0)})


# -- parameters the kernels take, computed on the host as ggml does ------------------------------------


def alibi_bases(n_head: int, max_bias: float) -> tuple[int, float, float] | None:
    """ALiBi's (L, m0, m1): L = 2**floor(log2(n_head)), m0 = 2**(-max_bias/L), m1 = 2**(-max_bias/2/L),
    from which head h's slope is m0**(h+1) for h < L, else m1**(2*(h-L)+1) (what kernels take). None
    when max_bias <= 0 or there are no heads: every slope is 1 (ggml tests max_bias > 0)."""
    n_head = int(n_head)
    if max_bias <= 0 or n_head < 1:
        return None
    n_log2 = 1 << (n_head.bit_length() - 1)  # exact 2**floor(log2(n_head))
    return n_log2, 2.0 ** (-max_bias / n_log2), 2.0 ** (-max_bias / 2.0 / n_log2)


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ALiBi slope of each head, float64 `(n_head,)`, as ggml's soft_max and flash_attn_ext use them
    (`alibi_bases`); all ones when max_bias <= 0."""
    bases = alibi_bases(n_head, max_bias)
    if bases is None:
        return np.ones(max(int(n_head), 0))
    n_log2, m0, m1 = bases
    h = np.arange(int(n_head))
    return np.where(h < n_log2, m0 ** (h + 1), m1 ** (2 * (h - n_log2) + 1))


def rope_yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                        beta_slow: float) -> tuple[float, float]:
    """YaRN's (lo, hi) correction dims, in float32 like ggml_rope_yarn_corr_dims.

    corr(r) = n_dims*ln(n_ctx_orig/(2*pi*r)) / (2*ln(freq_base));
    lo = max(0, floor(corr(beta_fast))), hi = min(n_dims - 1, ceil(corr(beta_slow))).
    float32 so that floor/ceil land where ggml's land. n_ctx_orig = 0 gives
    log(0) = -inf, hence (0, -inf), as in C.
    """
    f32 = np.float32

    def corr(n_rot: float) -> np.float32:
        with np.errstate(divide="ignore"):
            ratio = f32(n_ctx_orig) / (f32(n_rot) * f32(2) * f32(np.pi))
            return f32(n_dims) * np.log(ratio) / (f32(2) * np.log(f32(freq_base)))

    lo = max(0.0, float(np.floor(corr(beta_fast))))
    hi = min(float(n_dims - 1), float(np.ceil(corr(beta_slow))))
    return lo, hi


def rope_yarn(params: Mapping[str, Any]) -> tuple[float, float, float]:
    """(corr_lo, corr_hi, mscale) of a rope node's params: with ext_factor != 0 YaRN's correction dims
    and mscale = attn_factor*(1 + 0.1*ln(1/freq_scale)), else (0, 0, attn_factor)."""
    if params["ext_factor"] == 0.0:
        return 0.0, 0.0, params["attn_factor"]
    lo, hi = rope_yarn_corr_dims(params["n_dims"], params["n_ctx_orig"], params["freq_base"], params["beta_fast"],
                                 params["beta_slow"])
    return lo, hi, params["attn_factor"] * (1.0 + 0.1 * math.log(1.0 / params["freq_scale"]))
