"""Elementwise ops: binary arithmetic with broadcasting, maps, unary activations, GLU.

Shapes are numpy order (ggml's ne[0] is our last axis). Every op here reads
f32/f16/bf16 sources with any strides and writes a contiguous result of the
first source's shape and dtype, except `glu`, whose last axis is halved.
"""

from __future__ import annotations

from typing import Callable

from ..tensor import Tensor
from .base import (FLOATS, bool_param, can_repeat, check, check_dtype, check_rank, check_tensor, choice_param,
                   float_param, node, op)

__all__ = [
    "add", "sub", "mul", "div", "add1", "add_id", "scale", "clamp", "leaky_relu",
    "sqr", "sqrt", "log", "sin", "cos",
    "abs", "sgn", "neg", "step", "tanh", "elu", "relu", "sigmoid", "gelu", "gelu_erf",
    "gelu_quick", "silu", "hardswish", "hardsigmoid", "exp", "expm1", "softplus",
    "floor", "ceil", "round", "trunc",
    "glu", "glu_split", "UNARY_OPS", "GLU_KINDS",
]


def _float_source(op_name: str, t: Tensor, what: str = "source") -> Tensor:
    """Validate a float tensor of 1..4 dims (the shape every op here accepts)."""
    check_tensor(op_name, t, what)
    check_dtype(op_name, t, FLOATS, what)
    check_rank(op_name, t, 1, 4)
    return t


# -- binary arithmetic ------------------------------------------------------------


def _binary(op_name: str, a: Tensor, b: Tensor) -> Tensor:
    _float_source(op_name, a, "a")
    _float_source(op_name, b, "b")
    check(
        can_repeat(b.shape, a.shape), op_name,
        f"b {b.shape} does not broadcast into a {a.shape}: each of a's dims must be a multiple of b's "
        "(b may have fewer dims, aligned on the last axis)", a, b,
    )
    return node(op_name, (a, b), a.shape, a.dtype)


@op("elementwise", reuses_src0=True)
def add(a: Tensor, b: Tensor) -> Tensor:
    """a + b, b repeated into a by modulo in every axis (ggml_add); a's shape and dtype.

    `out[i] = a[i] + b[i % b.shape]`, with b's shape padded by leading 1s to a's
    rank: unlike numpy broadcasting, a b axis of any size dividing a's tiles.
    """
    return _binary("add", a, b)


@op("elementwise", reuses_src0=True)
def sub(a: Tensor, b: Tensor) -> Tensor:
    """a - b, b repeated into a by modulo in every axis (ggml_sub); a's shape and dtype."""
    return _binary("sub", a, b)


@op("elementwise", reuses_src0=True)
def mul(a: Tensor, b: Tensor) -> Tensor:
    """a * b, b repeated into a by modulo in every axis (ggml_mul); a's shape and dtype."""
    return _binary("mul", a, b)


@op("elementwise", reuses_src0=True)
def div(a: Tensor, b: Tensor) -> Tensor:
    """a / b, b repeated into a by modulo in every axis (ggml_div); a's shape and dtype."""
    return _binary("div", a, b)


@op("elementwise")
def add1(a: Tensor, b: Tensor) -> Tensor:
    """a + b where b holds one element, added to every element of a (ggml_add1)."""
    _float_source("add1", a, "a")
    _float_source("add1", b, "b")
    check(b.size == 1, "add1", f"b must hold exactly one element, got shape {b.shape}", a, b)
    return node("add1", (a, b), a.shape, a.dtype)


@op("elementwise")
def add_id(a: Tensor, b: Tensor, ids: Tensor) -> Tensor:
    """Per-expert bias: a (T, U, C), b (E, C), i32 ids (T, U) -> out[t, u] = a[t, u] + b[ids[t, u]].

    ggml_add_id (ggml: a ne = [C, U, T], b [C, E], ids [U, T]). Result: a's
    shape and dtype. Every id must lie in [0, E); the reference checks at run time.
    """
    _float_source("add_id", a, "a")
    _float_source("add_id", b, "b")
    check_tensor("add_id", ids, "ids")
    check_dtype("add_id", ids, ("i32",), "ids")
    check(a.ndim == 3 and b.ndim == 2 and ids.ndim == 2, "add_id",
          "expected a (T, U, C), b (E, C) and ids (T, U)", a, b, ids)
    check(a.shape[2] == b.shape[1], "add_id",
          f"C differs: a has {a.shape[2]}, b has {b.shape[1]}", a, b, ids)
    check(ids.shape == a.shape[:2], "add_id",
          f"ids must have a's (T, U) = {a.shape[:2]}, got {ids.shape}", a, b, ids)
    return node("add_id", (a, b, ids), a.shape, a.dtype)


# -- maps with parameters -------------------------------------------------------


@op("elementwise", reuses_src0=True)
def scale(x: Tensor, s: float, bias: float = 0.0) -> Tensor:
    """x * s + bias (ggml_scale / ggml_scale_bias); x's shape and dtype. s and bias are finite."""
    _float_source("scale", x)
    params = {"s": float_param("scale", "s", s, x), "bias": float_param("scale", "bias", bias, x)}
    return node("scale", (x,), x.shape, x.dtype, params)


@op("elementwise", reuses_src0=True)
def clamp(x: Tensor, min: float, max: float) -> Tensor:  # noqa: A002 - ggml's parameter names
    """max(min(x, max), min) (ggml_clamp, in its order: min wins when min > max); either bound may be infinite."""
    _float_source("clamp", x)
    params = {"min": float_param("clamp", "min", min, x, finite=False),
              "max": float_param("clamp", "max", max, x, finite=False)}
    return node("clamp", (x,), x.shape, x.dtype, params)


@op("elementwise", reuses_src0=True)
def leaky_relu(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    """x where x > 0, else negative_slope * x (ggml_leaky_relu)."""
    _float_source("leaky_relu", x)
    params = {"negative_slope": float_param("leaky_relu", "negative_slope", negative_slope, x)}
    return node("leaky_relu", (x,), x.shape, x.dtype, params)


# -- maps without parameters: one builder per op name ---------------------------------


def _map_op(family: str, name: str, formula: str) -> Callable[[Tensor], Tensor]:
    """A registered builder `name(x)` for an elementwise map; same shape and dtype out."""

    def build(x: Tensor) -> Tensor:
        _float_source(name, x)
        return node(name, (x,), x.shape, x.dtype)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"{formula}, elementwise (ggml_{name}); f32/f16/bf16, any strides, same shape and dtype out."
    return op(family, name, reuses_src0=True)(build)


sqr = _map_op("elementwise", "sqr", "x * x")
sqrt = _map_op("elementwise", "sqrt", "sqrt(x)")
log = _map_op("elementwise", "log", "natural log of x")
sin = _map_op("elementwise", "sin", "sin(x)")
cos = _map_op("elementwise", "cos", "cos(x)")

# ggml's GGML_OP_UNARY family; constants are ggml's (ggml-cpu/vec.h).
abs = _map_op("unary", "abs", "|x|")  # noqa: A001
sgn = _map_op("unary", "sgn", "sign of x: 1, -1, or 0 at 0")
neg = _map_op("unary", "neg", "-x")
step = _map_op("unary", "step", "1 where x > 0 else 0")
tanh = _map_op("unary", "tanh", "tanh(x)")
elu = _map_op("unary", "elu", "x where x > 0 else expm1(x)")
relu = _map_op("unary", "relu", "x where x > 0 else 0")
sigmoid = _map_op("unary", "sigmoid", "1 / (1 + exp(-x))")
gelu = _map_op("unary", "gelu", "0.5*x*(1 + tanh(0.7978845608*x*(1 + 0.044715*x*x))) (tanh approximation)")
gelu_erf = _map_op("unary", "gelu_erf", "0.5*x*(1 + erf(x / sqrt(2))) (exact GELU)")
gelu_quick = _map_op("unary", "gelu_quick", "x * sigmoid(1.702*x)")
silu = _map_op("unary", "silu", "x * sigmoid(x)")
hardswish = _map_op("unary", "hardswish", "x * min(1, max(0, (x + 3) / 6))")
hardsigmoid = _map_op("unary", "hardsigmoid", "min(1, max(0, (x + 3) / 6))")
exp = _map_op("unary", "exp", "exp(x)")
expm1 = _map_op("unary", "expm1", "exp(x) - 1")
softplus = _map_op("unary", "softplus", "log(1 + exp(x)), x itself where x > 20")
floor = _map_op("unary", "floor", "floor(x)")
ceil = _map_op("unary", "ceil", "ceil(x)")
round = _map_op("unary", "round", "x rounded to the nearest integer, halves away from zero (C roundf)")  # noqa: A001
trunc = _map_op("unary", "trunc", "x rounded toward zero")

#: the unary op names (each its own builder and node op), for the conformance harness
UNARY_OPS: tuple[str, ...] = (
    "abs", "sgn", "neg", "step", "tanh", "elu", "relu", "sigmoid", "gelu", "gelu_erf", "gelu_quick",
    "silu", "hardswish", "hardsigmoid", "exp", "expm1", "softplus", "floor", "ceil", "round", "trunc",
)


# -- gated linear units -------------------------------------------------------------

#: glu kinds: the activation applied to the gate half
GLU_KINDS: tuple[str, ...] = ("reglu", "geglu", "swiglu", "geglu_erf", "geglu_quick", "swiglu_oai")


def _glu_params(kind: str, swapped: bool, alpha: float, limit: float, *srcs: Tensor) -> dict:
    """alpha finite; limit may be +inf (no clipping); alpha and limit are kept for every kind so that all
    glu nodes carry the same params."""
    return {"kind": choice_param("glu", "kind", kind, GLU_KINDS, *srcs),
            "swapped": bool_param("glu", "swapped", swapped, *srcs),
            "alpha": float_param("glu", "alpha", alpha, *srcs),
            "limit": float_param("glu", "limit", limit, *srcs, finite=False)}


def _glu_source(t: Tensor, what: str) -> None:
    _float_source("glu", t, what)
    check(t.rows_contiguous(), "glu", f"{what} rows (last axis) must be contiguous, got strides {t.strides}", t)


@op("glu")
def glu(x: Tensor, kind: str, swapped: bool = False, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """Gated linear unit over fused halves: act(gate) * up, last axis halved (ggml_glu).

    With nc = x.shape[-1] // 2 (x.shape[-1] must be even), gate = x[..., :nc]
    and up = x[..., nc:], or the other way round when `swapped`. act per kind:
    reglu relu, geglu tanh-GELU, swiglu SiLU, geglu_erf erf-GELU, geglu_quick
    x*sigmoid(1.702x); swiglu_oai (gpt-oss): g = min(gate, limit),
    u = clip(up, -limit, limit), out = g*sigmoid(alpha*g) * (u + 1). Rows
    (the last axis) must be contiguous. Sources are (x, None); `glu_split`
    builds the same op with two sources.
    """
    _glu_source(x, "x")
    check(x.shape[-1] % 2 == 0, "glu", f"last axis must be even to split into gate and up, got {x.shape[-1]}", x)
    params = _glu_params(kind, swapped, alpha, limit, x)
    return node("glu", (x, None), x.shape[:-1] + (x.shape[-1] // 2,), x.dtype, params)


def glu_split(a: Tensor, b: Tensor, kind: str, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """Gated linear unit over separate tensors: act(a) * b, a's shape and dtype (ggml_glu_split).

    Node op "glu" with sources (a, b) and swapped=False; a is the gate, b the
    up projection (for swiglu_oai: g = min(a, limit), u = clip(b, -limit, limit)).
    a and b share shape and dtype, rows contiguous. Not a separate entry of
    OPS: it is a second constructor of the "glu" op.
    """
    _glu_source(a, "a")
    _glu_source(b, "b")
    check(a.shape == b.shape and a.dtype == b.dtype, "glu",
          f"a and b must have the same shape and dtype, got {a.shape} {a.dtype} and {b.shape} {b.dtype}", a, b)
    params = _glu_params(kind, False, alpha, limit, a, b)
    return node("glu", (a, b), a.shape, a.dtype, params)
