"""Reductions and sorting: sum, sum_rows, mean, cumsum, argmax, count_equal, argsort, top_k."""

from __future__ import annotations

from ..tensor import Tensor
from .base import FLOATS, check, check_dtype, check_rank, check_tensor, choice_param, int_param, node, op

__all__ = ["sum", "sum_rows", "mean", "cumsum", "argmax", "count_equal", "argsort", "top_k"]

SORT_ORDERS = ("asc", "desc")


def _f32_rows(op_name: str, x: Tensor) -> None:
    check_tensor(op_name, x)
    check_dtype(op_name, x, ("f32",))
    check_rank(op_name, x, 1)


@op("reduce")
def sum(x: Tensor) -> Tensor:  # noqa: A001 - ggml's name
    """Sum of all elements -> (1,), in x's dtype (f32, f16 or bf16; ggml_sum keeps the type)."""
    check_tensor("sum", x)
    check_dtype("sum", x, FLOATS)
    check_rank("sum", x, 1)
    return node("sum", (x,), (1,), x.dtype)


@op("reduce")
def sum_rows(x: Tensor) -> Tensor:
    """x.sum(-1, keepdims=True): f32 (..., C) -> (..., 1)."""
    _f32_rows("sum_rows", x)
    return node("sum_rows", (x,), x.shape[:-1] + (1,), "f32")


@op("reduce")
def mean(x: Tensor) -> Tensor:
    """x.mean(-1, keepdims=True): f32 (..., C) -> (..., 1)."""
    _f32_rows("mean", x)
    return node("mean", (x,), x.shape[:-1] + (1,), "f32")


@op("reduce")
def cumsum(x: Tensor) -> Tensor:
    """np.cumsum(x, -1): inclusive running sum along the last axis; f32."""
    _f32_rows("cumsum", x)
    return node("cumsum", (x,), x.shape, "f32")


@op("reduce")
def argmax(x: Tensor) -> Tensor:
    """Index of each row's maximum: f32 (R, C) or (C,) -> i32 (R,) (or (1,)); at most 2 axes (ggml_argmax).

    Ties give the LAST index holding the maximum (ggml's CPU loop keeps
    updating on equality), unlike np.argmax; NaN rows are unspecified.
    """
    check_tensor("argmax", x)
    check_dtype("argmax", x, ("f32",))
    check_rank("argmax", x, 1, 2)
    return node("argmax", (x,), (x.shape[0] if x.ndim == 2 else 1,), "i32")


@op("reduce")
def count_equal(a: Tensor, b: Tensor) -> Tensor:
    """Number of positions where a == b: i32 tensors of one shape -> i64 (1,)."""
    check_tensor("count_equal", a, "a")
    check_tensor("count_equal", b, "b")
    check_dtype("count_equal", a, ("i32",), "a")
    check_dtype("count_equal", b, ("i32",), "b")
    check_rank("count_equal", a, 1)
    check(a.shape == b.shape, "count_equal", "shapes differ", a, b)
    return node("count_equal", (a, b), (1,), "i64")


@op("reduce")
def argsort(x: Tensor, order: str = "asc") -> Tensor:
    """Indices sorting each row (last axis), i32 of x's shape; order "asc" or "desc"; f32.

    Ties keep their original order (a stable sort) in both orders: where
    ggml's std::sort leaves ties unspecified, this reference decides.
    "asc" = np.argsort(x, -1, kind="stable"), "desc" = np.argsort(-x, -1, kind="stable").
    """
    _f32_rows("argsort", x)
    choice_param("argsort", "order", order, SORT_ORDERS, x)
    return node("argsort", (x,), x.shape, "i32", {"order": order})


@op("reduce")
def top_k(x: Tensor, k: int) -> Tensor:
    """i32 indices of the k largest values of each row: f32 (..., C) -> (..., k), 1 <= k <= C.

    The order of the k indices is unspecified (ggml_top_k); among equal values
    at the boundary, any may be taken. The reference gives them in descending
    order, ties by index.
    """
    _f32_rows("top_k", x)
    k = int_param("top_k", "k", k, x)
    check(1 <= k <= x.shape[-1], "top_k", f"k = {k} must be in 1..{x.shape[-1]} (the row length)", x)
    return node("top_k", (x,), x.shape[:-1] + (k,), "i32", {"k": k})
