"""Tensor: one value of a compute graph, a leaf (input, param, state) or an op node.

Shapes are in numpy order (last axis contiguous) and strides are in bytes.
For block-quantized dtypes the last axis counts elements but its stride is the
byte size of one block: a row of K elements holds K // 32 blocks.

A view (view, reshape, permute, transpose) and the result of an in-place op
(set_rows, cpy) own no storage: `view_src` names the tensor whose storage
they use and `view_offset` where they start in it.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any, Sequence

import attrs
import numpy as np

from .dtypes import DType, dtype as as_dtype, from_float

Shape = tuple[int, ...]

#: Ops that only reinterpret storage; they need no kernel.
VIEW_OPS = frozenset({"view", "reshape", "permute", "transpose"})


class Flag(enum.Flag):
    NONE = 0
    INPUT = enum.auto()  # data set for each run
    PARAM = enum.auto()  # weights: data fixed at build time
    STATE = enum.auto()  # persistent buffer kept across runs (a KV cache)


_ids = itertools.count()


def contiguous_strides(shape: Shape, dt: DType) -> Shape:
    """Byte strides of a C-contiguous tensor (last stride = one block)."""
    if not shape:
        return ()
    strides = [0] * len(shape)
    strides[-1] = dt.block_bytes
    step = dt.row_bytes(shape[-1])
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = step
        step *= shape[i]
    return tuple(strides)


@attrs.define(eq=False, repr=False)
class Tensor:
    """A leaf or an op node. Identity is object identity (hashable, not comparable)."""

    shape: Shape = attrs.field(converter=tuple)
    dtype: DType = attrs.field(converter=as_dtype)
    strides: Shape = attrs.field(converter=tuple)
    op: str | None = None
    params: dict[str, Any] = attrs.field(factory=dict)
    srcs: tuple[Tensor, ...] = attrs.field(default=(), converter=tuple)
    name: str = ""
    flags: Flag = Flag.NONE
    view_src: Tensor | None = None
    view_offset: int = 0
    data: np.ndarray | None = None  # host storage of a param or an initialised state
    uid: int = attrs.field(factory=lambda: next(_ids), init=False)

    def __attrs_post_init__(self) -> None:
        if not self.name:
            self.name = f"{self.op or 'leaf'}.{self.uid}"
        if self.view_src is not None and self.view_src.view_src is not None:
            # Always point at the storage owner, so aliasing is one hop.
            self.view_offset += self.view_src.view_offset
            self.view_src = self.view_src.view_src

    # -- geometry -----------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def is_leaf(self) -> bool:
        return self.op is None

    @property
    def is_view(self) -> bool:
        return self.view_src is not None

    @property
    def is_constant(self) -> bool:
        """A param or a view of one: data fixed at build time, which no op writes (ops refuse to
        write into params), so kernels may read it before the kernel ahead of them has finished."""
        b = self.base
        return b.is_leaf and bool(b.flags & Flag.PARAM)

    @property
    def base(self) -> Tensor:
        """The tensor that owns this one's storage."""
        return self.view_src if self.view_src is not None else self

    def _counts(self) -> Shape:
        """Extent of each axis in addressable units (blocks on the last axis)."""
        if not self.shape:
            return ()
        return self.shape[:-1] + (self.shape[-1] // self.dtype.block_size,)

    @property
    def nbytes(self) -> int:
        """Bytes spanned from the first to the last element (storage needed)."""
        counts = self._counts()
        if any(c == 0 for c in counts):
            return 0
        return sum((c - 1) * s for c, s in zip(counts, self.strides)) + self.dtype.block_bytes

    def is_contiguous(self) -> bool:
        """C-contiguous: rows packed, axes in order, no gaps (size-1 axes ignored)."""
        want = contiguous_strides(self.shape, self.dtype)
        return all(n == 1 or s == w for n, s, w in zip(self.shape, self.strides, want))

    def rows_contiguous(self) -> bool:
        """The last axis is packed (any strides on the outer axes)."""
        return not self.shape or self.shape[-1] == 1 or self.strides[-1] == self.dtype.block_bytes

    # -- host data ------------------------------------------------------------
    def array_layout(self) -> tuple[Shape, Shape, np.dtype]:
        """(shape, byte strides, numpy dtype) of this tensor seen as an array.

        Plain dtypes map to their numpy dtype; block formats to raw uint8 rows
        of shape (..., K // 32 * block_bytes).
        """
        dt = self.dtype
        if dt.is_quant:
            return self.shape[:-1] + (dt.row_bytes(self.shape[-1]),), self.strides[:-1] + (1,), np.dtype(np.uint8)
        return self.shape, self.strides, dt.numpy

    def host_view(self, storage: np.ndarray, offset: int = 0) -> np.ndarray:
        """This tensor as a numpy view of `storage` (a uint8 buffer), zero-copy."""
        shape, strides, np_dtype = self.array_layout()
        return np.ndarray(shape, dtype=np_dtype, buffer=storage, offset=offset, strides=strides)

    def describe(self) -> str:
        """'name' (shape) dtype, for error messages."""
        return f"'{self.name}' {self.shape} {self.dtype.name}"

    def __repr__(self) -> str:
        kind = self.op or ("/".join(f.name.lower() for f in Flag if f & self.flags) or "leaf")
        return f"<Tensor {self.describe()} {kind}>"

    # -- convenience views (builders live in opdispatch.ops.views) -------------
    def view(self, shape: Sequence[int], strides: Sequence[int] | None = None, offset: int = 0) -> Tensor:
        from .ops.views import view

        return view(self, shape, strides, offset)

    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        from .ops.views import reshape

        return reshape(self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)

    def permute(self, *axes: int) -> Tensor:
        from .ops.views import permute

        return permute(self, axes)

    def transpose(self) -> Tensor:
        from .ops.views import transpose

        return transpose(self)

    @property
    def T(self) -> Tensor:  # noqa: N802 - numpy's name
        return self.transpose()


def _leaf(name: str, shape: Sequence[int], dt: str | DType, flags: Flag, data: np.ndarray | None = None) -> Tensor:
    dt = as_dtype(dt)
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"tensor '{name}': negative dimension in shape {shape}")
    if dt.is_quant and (not shape or shape[-1] % dt.block_size):
        raise ValueError(
            f"tensor '{name}': {dt.name} needs a last axis that is a multiple of {dt.block_size}, got shape {shape}"
        )
    return Tensor(shape, dt, contiguous_strides(shape, dt), name=name, flags=flags, data=data)


def input(name: str, shape: Sequence[int], dtype: str | DType = "f32") -> Tensor:  # noqa: A001
    """A graph input: its values are given at each run."""
    return _leaf(name, shape, dtype, Flag.INPUT)


def state(name: str, shape: Sequence[int], dtype: str | DType = "f32", init: Any = None) -> Tensor:
    """Persistent storage kept across runs (a KV cache): zero at first unless `init` is given."""
    t = _leaf(name, shape, dtype, Flag.STATE)
    if init is not None:
        t.data = _storage(t, init)
    return t


def param(name: str, values: Any, dtype: str | DType | None = None, *, shape: Sequence[int] | None = None) -> Tensor:
    """A weight with fixed values.

    `values` are converted to `dtype` (quantized for block formats). With
    `shape`, `values` are the raw storage bytes instead (e.g. a GGUF tensor).
    """
    if shape is not None:
        if dtype is None:
            raise ValueError(f"param '{name}': raw data needs a dtype")
        t = _leaf(name, shape, dtype, Flag.PARAM)
        raw = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
        want = t.nbytes
        if raw.size != want:
            raise ValueError(f"param '{name}': {dtype} {tuple(shape)} needs {want} bytes, got {raw.size}")
        t.data = raw
        return t
    arr = np.asarray(values)
    dt = as_dtype(dtype if dtype is not None else (arr.dtype if arr.dtype != np.float64 else "f32"))
    t = _leaf(name, arr.shape, dt, Flag.PARAM)
    t.data = _storage(t, arr)
    return t


def _storage(t: Tensor, values: Any) -> np.ndarray:
    """Contiguous uint8 storage of `t` holding `values` (broadcast to its shape)."""
    arr = np.broadcast_to(np.asarray(values), t.shape)
    host = from_float(t.dtype, arr) if not t.dtype.is_int else arr.astype(t.dtype.numpy)
    # Always copy: the caller may mutate its array after building the graph.
    return np.array(host, order="C", copy=True).view(np.uint8).reshape(-1)


def to_numpy(obj: Any) -> np.ndarray:
    """A host numpy array from a numpy array, array-like or DLPack object."""
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack__"):
        try:
            return np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError):
            pass  # device-resident producer: fall back to its own conversion
        if hasattr(obj, "get"):
            return obj.get()  # CuPy
        if hasattr(obj, "cpu"):
            return obj.cpu().numpy()  # torch
    return np.asarray(obj)
