"""Views: new shapes and strides over the same storage; they cost nothing."""

from __future__ import annotations

from typing import Sequence

from ..tensor import Tensor, as_shape, check_extent, contiguous_strides
from .base import check, check_tensor, fail, int_param, ints_param, op


def _view_node(op_name: str, a: Tensor, shape: Sequence[int], strides: Sequence[int], offset: int,
               params: dict) -> Tensor:
    return check_extent(op_name, Tensor(
        tuple(shape), a.dtype, tuple(strides), op=op_name, params=params, srcs=(a,),
        view_src=a.base, view_offset=a.view_offset + offset,
    ))


@op("view")
def view(a: Tensor, shape: Sequence[int], strides: Sequence[int] | None = None, offset: int = 0) -> Tensor:
    """A window on `a`'s storage: `shape`, byte `strides` (default contiguous), byte `offset` into `a`.

    Like ggml_view_Nd (whose strides are unsigned): strides and offset are
    non-negative integers. The window must lie inside `a`'s bytes.
    """
    check_tensor("view", a)
    shape = as_shape("view", shape, "shape", a)
    offset = int_param("view", "offset", offset, a, lo=0)
    if a.dtype.is_quant:
        check(bool(shape) and shape[-1] % a.dtype.block_size == 0, "view",
              f"{a.dtype.name} views need a last axis that is a multiple of {a.dtype.block_size}, got {shape}", a)
    strides = ints_param("view", "strides", strides, None, a) if strides is not None else \
        contiguous_strides(shape, a.dtype)
    check(len(strides) == len(shape), "view", f"shape {shape} and strides {strides} differ in rank", a)
    check(all(st >= 0 for st in strides), "view", f"strides {strides} must be >= 0", a)
    probe = Tensor(shape, a.dtype, strides)
    check(offset >= 0 and offset + probe.nbytes <= a.nbytes, "view",
          f"window of {probe.nbytes} bytes at offset {offset} exceeds the source's {a.nbytes} bytes", a)
    return _view_node("view", a, shape, strides, offset, {"shape": shape, "strides": strides, "offset": offset})


@op("view")
def reshape(a: Tensor, shape: Sequence[int]) -> Tensor:
    """`a` with a new shape (one -1 allowed); `a` must be contiguous, as in ggml."""
    check_tensor("reshape", a)
    shape = ints_param("reshape", "shape", shape, None, a)
    check(all(n >= -1 for n in shape), "reshape", f"negative dimension in shape {shape}", a)
    if shape.count(-1) > 1:
        fail("reshape", f"more than one -1 in {shape}", a)
    if -1 in shape:
        rest = 1
        for n in shape:
            rest *= n if n != -1 else 1
        check(rest > 0 and a.size % rest == 0, "reshape", f"cannot infer -1 in {shape}", a)
        shape = tuple(a.size // rest if n == -1 else n for n in shape)
    size = 1
    for n in shape:
        size *= n
    check(size == a.size, "reshape", f"cannot reshape {a.size} elements into {shape}", a)
    check(a.is_contiguous(), "reshape", "source is not contiguous (use cont first)", a)
    if a.dtype.is_quant:
        check(shape[-1] % a.dtype.block_size == 0, "reshape",
              f"{a.dtype.name} needs a last axis that is a multiple of {a.dtype.block_size}, got {shape}", a)
    return _view_node("reshape", a, shape, contiguous_strides(shape, a.dtype), 0, {"shape": shape})


@op("view")
def permute(a: Tensor, axes: Sequence[int]) -> Tensor:
    """numpy's transpose(a, axes): output axis i is `a`'s axis axes[i].

    (ggml_permute's argument is the inverse mapping; we use numpy's meaning.)
    """
    check_tensor("permute", a)
    given = ints_param("permute", "axes", axes, a.ndim, a)
    check(all(-a.ndim <= x < a.ndim for x in given), "permute", f"axes {given} out of range for {a.ndim} axes", a)
    axes = tuple(x % a.ndim for x in given)
    check(sorted(axes) == list(range(a.ndim)), "permute", f"axes {given} are not a permutation of {a.ndim} axes", a)
    if a.dtype.is_quant:
        check(axes[-1] == a.ndim - 1, "permute", f"{a.dtype.name} blocks must stay on the last axis", a)
    shape = tuple(a.shape[i] for i in axes)
    strides = tuple(a.strides[i] for i in axes)
    return _view_node("permute", a, shape, strides, 0, {"axes": axes})


@op("view")
def transpose(a: Tensor) -> Tensor:
    """Swap the last two axes (ggml_transpose)."""
    check_tensor("transpose", a)
    check(a.ndim >= 2, "transpose", "needs at least 2 dimensions", a)
    check(not a.dtype.is_quant, "transpose", f"{a.dtype.name} blocks must stay on the last axis", a)
    shape = a.shape[:-2] + (a.shape[-1], a.shape[-2])
    strides = a.strides[:-2] + (a.strides[-1], a.strides[-2])
    return _view_node("transpose", a, shape, strides, 0, {})
