"""Reference kernels of the elementwise, unary and glu ops.

Sources are read as float64 and every formula is evaluated in float64, then
rounded once on store (to f32 first, then to f16/bf16, as ggml holds results).
For + - * / of f32 values this gives exactly ggml's f32 results; for the
transcendental ops it is the correctly rounded value, which ggml's f32 libm
calls approach within an ulp or two.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..tensor import Tensor
from . import load, reference, store

Fn = Callable[[np.ndarray], np.ndarray]

# ggml's constants (ggml-cpu/vec.h)
GELU_COEF_A = 0.044715
GELU_QUICK_COEF = 1.702
SQRT_2_OVER_PI = 0.79788456080286535587989211986876
SQRT_2_INV = 0.70710678118654752440084436210484

# numpy has no erf; math.erf is exact to double precision.
_erf: Fn = np.frompyfunc(math.erf, 1, 1)


def _f64(arr: np.ndarray, t: Tensor) -> np.ndarray:
    return load(arr, t).astype(np.float64)


def _repeat(b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """b tiled into `shape` by modulo in every axis (ggml's can_repeat broadcast)."""
    b = b.reshape((1,) * (len(shape) - b.ndim) + b.shape)
    return np.tile(b, tuple(n // m for n, m in zip(shape, b.shape)))


# -- binary ----------------------------------------------------------------------

_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
}


@reference(*_BINARY)
def _binary(node: Tensor, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    x = _f64(a, node.srcs[0])
    y = _repeat(_f64(b, node.srcs[1]), x.shape)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # inf/nan as C gives them
        store(out, _BINARY[node.op](x, y), node)


@reference("add1")
def _add1(node: Tensor, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    store(out, _f64(a, node.srcs[0]) + _f64(b, node.srcs[1]).reshape(()), node)


@reference("add_id")
def _add_id(node: Tensor, out: np.ndarray, a: np.ndarray, b: np.ndarray, ids: np.ndarray) -> None:
    n_expert = b.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise ValueError(
            f"add_id: ids must lie in [0, {n_expert}), got {ids.min()}..{ids.max()} "
            f"[{', '.join(t.describe() for t in node.srcs)}]"
        )
    store(out, _f64(a, node.srcs[0]) + _f64(b, node.srcs[1])[ids], node)


# -- maps ------------------------------------------------------------------------


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)))


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x * SQRT_2_INV).astype(np.float64))


def _gelu_quick(x: np.ndarray) -> np.ndarray:
    return x * _sigmoid(GELU_QUICK_COEF * x)


def _relu(x: np.ndarray) -> np.ndarray:
    # where, not maximum: NaN gives 0 as ggml's (x > 0 ? x : 0) does
    return np.where(x > 0, x, 0.0)


def _hardsigmoid(x: np.ndarray) -> np.ndarray:
    return np.minimum(1.0, np.maximum(0.0, (x + 3.0) / 6.0))


#: op name -> float64 formula; the comparisons follow ggml's C so NaN maps alike
_MAPS: dict[str, Fn] = {
    "sqr": lambda x: x * x,
    "sqrt": np.sqrt,
    "log": np.log,
    "sin": np.sin,
    "cos": np.cos,
    "abs": np.abs,
    "sgn": lambda x: np.where(x > 0, 1.0, np.where(x < 0, -1.0, 0.0)),
    "neg": np.negative,
    "step": lambda x: np.where(x > 0, 1.0, 0.0),
    "tanh": np.tanh,
    "elu": lambda x: np.where(x > 0, x, np.expm1(x)),
    "relu": _relu,
    "sigmoid": _sigmoid,
    "gelu": _gelu,
    "gelu_erf": _gelu_erf,
    "gelu_quick": _gelu_quick,
    "silu": lambda x: x * _sigmoid(x),
    "hardswish": lambda x: x * _hardsigmoid(x),
    "hardsigmoid": _hardsigmoid,
    "exp": np.exp,
    "expm1": np.expm1,
    "softplus": lambda x: np.where(x > 20.0, x, np.log1p(np.exp(x))),
    "floor": np.floor,
    "ceil": np.ceil,
    # roundf: halves away from zero (np.rint would round them to even). Exact for
    # f32 inputs: |x| + 0.5 is exact in float64 below 2**52, above it x is an even integer.
    "round": lambda x: np.copysign(np.floor(np.abs(x) + 0.5), x),
    "trunc": np.trunc,
}


@reference(*_MAPS)
def _map(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    with np.errstate(all="ignore"):  # log(0), sqrt(-1), exp overflow: inf/nan as C gives them
        store(out, _MAPS[node.op](_f64(x, node.srcs[0])), node)


@reference("scale")
def _scale(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    store(out, _f64(x, node.srcs[0]) * node.params["s"] + node.params["bias"], node)


@reference("clamp")
def _clamp(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    lo, hi = node.params["min"], node.params["max"]
    v = _f64(x, node.srcs[0])
    v = np.where(v < hi, v, hi)  # ggml: MAX(MIN(x, max), min) with C's ternary macros
    store(out, np.where(v > lo, v, lo), node)


@reference("leaky_relu")
def _leaky_relu(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    v = _f64(x, node.srcs[0])
    store(out, np.where(v > 0, v, 0.0) + node.params["negative_slope"] * np.where(v < 0, v, 0.0), node)


# -- glu -------------------------------------------------------------------------

_GLU_ACT: dict[str, Fn] = {
    "reglu": _relu,
    "geglu": _gelu,
    "swiglu": lambda x: x * _sigmoid(x),
    "geglu_erf": _gelu_erf,
    "geglu_quick": _gelu_quick,
}


@reference("glu")
def _glu(node: Tensor, out: np.ndarray, a: np.ndarray, b: np.ndarray | None) -> None:
    p = node.params
    if b is None:
        x = _f64(a, node.srcs[0])
        nc = x.shape[-1] // 2
        gate, up = x[..., :nc], x[..., nc : 2 * nc]
        if p["swapped"]:
            gate, up = up, gate
    else:
        gate, up = _f64(a, node.srcs[0]), _f64(b, node.srcs[1])
    with np.errstate(over="ignore", invalid="ignore"):  # sigmoid of a very negative gate 0; inf * 0 NaN, as C
        if p["kind"] == "swiglu_oai":
            g = np.minimum(gate, p["limit"])
            u = np.clip(up, -p["limit"], p["limit"])
            y = g * _sigmoid(p["alpha"] * g) * (u + 1.0)
        else:
            y = _GLU_ACT[p["kind"]](gate) * up
    store(out, y, node)
