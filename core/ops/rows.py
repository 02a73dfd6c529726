"""Rows and copies: get_rows, set_rows, cpy, dup, cont, set, acc.

Batch axes follow ggml, whose ne[2], ne[3] are our axes -3 and -4; a tensor
with fewer axes counts as having leading axes of size 1.
"""

from __future__ import annotations

from typing import Sequence

from ..tensor import Shape, Tensor, contiguous_strides
from .base import BLOCK_FORMATS, ENCODABLE, FLOATS, check, check_dtype, check_rank, check_tensor, int_param, ints_param, node, op

__all__ = ["get_rows", "set_rows", "cpy", "dup", "cont", "set", "acc"]

#: plain types every pair of which `cpy` converts between
_CONVERTIBLE = FLOATS + ("i32",)


def _padded(shape: Shape, n: int) -> Shape:
    """`shape` with leading 1s up to n axes (ggml's view of a lower-rank tensor)."""
    return (1,) * (n - len(shape)) + tuple(shape)


@op("rows")
def get_rows(a: Tensor, idx: Tensor) -> Tensor:
    """Gather rows: a (A3, A2, R, C), idx i32 (A3, A2, n) -> (A3, A2, n, C), out[i, j, k] = a[i, j, idx[i, j, k]].

    a is f32/f16/bf16/i32 or a block format; rows are converted to f32
    (dequantized), except i32 rows, which stay i32 (as in ggml). The batch
    axes of a and idx must be equal, there is no broadcasting (ggml_get_rows
    asserts a->ne[2] == idx->ne[1] and a->ne[3] == idx->ne[2]); missing
    leading axes count as 1, so a (R, C) with idx (n,) gives (n, C). The result
    has max(a.ndim, idx.ndim + 1) axes. An index outside [0, R) raises
    IndexError when the graph runs.
    """
    check_tensor("get_rows", a, "a")
    check_tensor("get_rows", idx, "idx")
    check_dtype("get_rows", a, FLOATS + ("i32",) + BLOCK_FORMATS, "a")
    check_dtype("get_rows", idx, ("i32",), "idx")
    check_rank("get_rows", a, 2)
    check_rank("get_rows", idx, 1, 3)
    a3, a2, _, cols = _padded(a.shape, 4)
    i2, i1, n = _padded(idx.shape, 3)
    check((a3, a2) == (i2, i1), "get_rows",
          f"batch axes differ: a has {(a3, a2)}, idx has {(i2, i1)} (no broadcasting, as in ggml)", a, idx)
    rank = max(a.ndim, idx.ndim + 1)
    shape = (a3, a2, n, cols)[4 - rank:]
    return node("get_rows", (a, idx), shape, "i32" if a.dtype.name == "i32" else "f32")


@op("rows", inplace=0)
def set_rows(dst: Tensor, src: Tensor, idx: Tensor) -> Tensor:
    """Scatter rows into dst in place: dst[i, j, idx[i % I2, j % I1, k]] = src[i, j, k]; returns dst updated.

    dst (D3, D2, R, C) f32/f16/bf16 or q4_0/q4_1/q5_0/q5_1/q8_0; src f32
    (D3, D2, n, C) with dst's batch axes; idx i64 or i32 (I2, I1, n), each of
    D2, D3 a multiple of I1, I2 (idx tiles over the batch, as in ggml). Rows
    are converted to dst's dtype on write (quantized per row with ggml's
    reference rounding); the other rows keep their bytes. The result aliases
    dst's storage (the KV-cache write). Duplicate indices leave one of the
    written rows, unspecified which (ggml's threads race). An index outside
    [0, R) raises IndexError when the graph runs.
    """
    for t, what in ((dst, "dst"), (src, "src"), (idx, "idx")):
        check_tensor("set_rows", t, what)
    check_dtype("set_rows", dst, FLOATS + ENCODABLE, "dst")
    check_dtype("set_rows", src, ("f32",), "src")
    check_dtype("set_rows", idx, ("i64", "i32"), "idx")
    check_rank("set_rows", dst, 2)
    check_rank("set_rows", src, 1)
    check_rank("set_rows", idx, 1, 3)
    d3, d2, _, cols = _padded(dst.shape, 4)
    s3, s2, n, scols = _padded(src.shape, 4)
    i2, i1, ni = _padded(idx.shape, 3)
    check(scols == cols, "set_rows", f"row lengths differ: dst has {cols}, src has {scols}", dst, src)
    check((s3, s2) == (d3, d2), "set_rows",
          f"batch axes differ: dst has {(d3, d2)}, src has {(s3, s2)}", dst, src)
    check(ni == n, "set_rows", f"src has {n} rows but idx has {ni} indices", src, idx)
    check(d2 % i1 == 0 and d3 % i2 == 0, "set_rows",
          f"idx batch axes {(i2, i1)} do not tile dst's {(d3, d2)}", dst, idx)
    return node("set_rows", (dst, src, idx), dst.shape, dst.dtype, inplace_of=dst)


def _check_conversion(op_name: str, a: Tensor, to: str) -> None:
    """ggml's copy pairs: same dtype (bytes), any pair of f32/f16/bf16/i32, any block format to a float,
    a float to a block format opdispatch can encode."""
    frm = a.dtype.name
    ok = (
        frm == to
        or (frm in _CONVERTIBLE and to in _CONVERTIBLE)
        or (frm in FLOATS and to in ENCODABLE)
        or (frm in BLOCK_FORMATS and to in FLOATS)
    )
    check(ok, op_name, f"cannot convert {frm} to {to}", a)


@op("rows", inplace=1)
def cpy(a: Tensor, b: Tensor) -> Tensor:
    """Copy a's values into b, converting to b's dtype; returns b updated (aliases b's storage).

    a and b have the same number of elements, any shapes and strides: the
    i-th element of a in row-major order lands on the i-th element of b in
    row-major order. Same dtype: bytes are copied (block formats block by
    block, bit-exact). Conversions: any pair of f32/f16/bf16/i32 (through f32,
    as ggml: float to i32 truncates toward zero, out-of-range values are
    unspecified), f32/f16/bf16 to a block format (quantized with ggml's
    reference rounding, 32 consecutive row-major values per block) and back.
    """
    check_tensor("cpy", a, "a")
    check_tensor("cpy", b, "b")
    check_rank("cpy", a, 1)
    check_rank("cpy", b, 1)
    check(a.size == b.size, "cpy", f"element counts differ: {a.size} vs {b.size}", a, b)
    _check_conversion("cpy", a, b.dtype.name)
    return node("cpy", (a, b), b.shape, b.dtype, inplace_of=b)


@op("rows")
def dup(a: Tensor) -> Tensor:
    """A contiguous copy of a: same shape, same dtype, bytes copied (ggml_dup)."""
    check_tensor("dup", a)
    check_rank("dup", a, 1)
    return node("dup", (a,), a.shape, a.dtype)


@op("rows")
def cont(a: Tensor, shape: Sequence[int] | None = None) -> Tensor:
    """A contiguous copy of a, optionally with a new shape of as many elements (ggml_cont / ggml_cont_Nd).

    Elements keep their row-major order: cont(a, s) == a.reshape(-1).reshape(s)
    in numpy, for any strides of a.
    """
    check_tensor("cont", a)
    check_rank("cont", a, 1)
    shape = a.shape if shape is None else ints_param("cont", "shape", shape, None, a)
    check(1 <= len(shape) <= 4 and all(n >= 0 for n in shape), "cont", f"invalid shape {shape}", a)
    size = 1
    for n in shape:
        size *= n
    check(size == a.size, "cont", f"cannot hold {a.size} elements in shape {shape}", a)
    if a.dtype.is_quant:
        check(shape[-1] % a.dtype.block_size == 0, "cont",
              f"{a.dtype.name} needs a last axis that is a multiple of {a.dtype.block_size}, got {shape}", a)
    return node("cont", (a,), shape, a.dtype, {"shape": shape})


def _window(op_name: str, a: Tensor, b: Tensor, offset: int, strides: Sequence[int] | None) -> tuple[int, Shape]:
    """Check the byte window (offset, strides) of b's shape inside a's contiguous layout."""
    size = a.dtype.block_bytes
    offset = int_param(op_name, "offset", offset, a, b)
    if strides is None:
        strides = contiguous_strides(_padded(a.shape, max(a.ndim, b.ndim)), a.dtype)[-b.ndim:]
    strides = ints_param(op_name, "strides", strides, None, a, b)
    check(len(strides) == b.ndim, op_name, f"{len(strides)} strides for {b.ndim} axes of b", a, b)
    check(strides[-1] == size, op_name,
          f"the last stride must be the element size {size} (ggml's nb0), got {strides[-1]}", a, b)
    check(offset >= 0 and offset % size == 0 and all(s >= 0 and s % size == 0 for s in strides), op_name,
          f"offset {offset} and strides {strides} must be non-negative multiples of {size} bytes", a, b)
    end = offset + sum((n - 1) * s for n, s in zip(b.shape, strides)) + size
    check(b.size == 0 or end <= a.size * size, op_name,
          f"window of shape {b.shape} at offset {offset} with strides {strides} ends at byte {end}, "
          f"past a's {a.size * size} bytes", a, b)
    return offset, strides


@op("rows")
def set(a: Tensor, b: Tensor, offset: int, strides: Sequence[int] | None = None) -> Tensor:  # noqa: A001 - ggml's name
    """A copy of a with a window overwritten by b (ggml_set, not in place).

    The window has b's shape, starts at byte `offset` of the result (laid out
    contiguously with a's shape) and steps by the byte `strides` (one per axis
    of b, the last = the element size; default: the result's own strides for
    b's trailing axes, so set(a, b, off) writes a sub-block like
    ggml_set_1d/ggml_set_2d). a and b are both f32 or both i32 (ggml's CPU).
    In numpy: out = a.copy(); as_strided(out.ravel()[offset // isz:], b.shape, strides)[...] = b.
    """
    return _set_or_acc("set", a, b, offset, strides, ("f32", "i32"))


@op("rows")
def acc(a: Tensor, b: Tensor, offset: int, strides: Sequence[int] | None = None) -> Tensor:
    """A copy of a with b added to a window (ggml_acc, not in place); a and b f32.

    The window is as in `set`: out = a.copy(); w = as_strided(out.ravel()[offset // 4:],
    b.shape, strides); w[...] = a's window + b.
    """
    return _set_or_acc("acc", a, b, offset, strides, ("f32",))


def _set_or_acc(op_name: str, a: Tensor, b: Tensor, offset: int, strides: Sequence[int] | None,
                dtypes: tuple[str, ...]) -> Tensor:
    check_tensor(op_name, a, "a")
    check_tensor(op_name, b, "b")
    check_dtype(op_name, a, dtypes, "a")
    check(b.dtype == a.dtype, op_name, f"b must be {a.dtype.name} like a, got {b.dtype.name}", a, b)
    check_rank(op_name, a, 1)
    check_rank(op_name, b, 1)
    check(b.size <= a.size, op_name, f"b has more elements ({b.size}) than a ({a.size})", a, b)
    offset, strides = _window(op_name, a, b, offset, strides)
    return node(op_name, (a, b), a.shape, a.dtype, {"offset": offset, "strides": strides})
