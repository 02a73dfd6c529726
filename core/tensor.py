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
import math
from typing import Any, Sequence

import attrs
import ml_dtypes
import numpy as np

from .dtypes import DType, dtype as as_dtype, from_float
from .errors import OpError

Shape = tuple[int, ...]

#: The bound on every dim, element count and byte span of a tensor: sizes and offsets are signed 64-bit on
#: every device (ggml's int64_t ne, CUDA's ptrdiff_t). Sizes are Python ints, which never wrap, so a larger
#: tensor is refused at build time instead of wrapping to a small one.
MAX_EXTENT = 2**63 - 1

#: Ops that only reinterpret storage; they need no kernel.
VIEW_OPS = frozenset({"view", "reshape", "permute", "transpose"})


class Flag(enum.Flag):
    NONE = 0
    INPUT = enum.auto()  # data set for each run
    PARAM = enum.auto()  # weights: data fixed at build time
    STATE = enum.auto()  # persistent buffer kept across runs (a KV cache)


_ids = itertools.count()


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool (True is not a dimension, an axis or a count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def op_error(who: str, msg: str, *tensors: Tensor) -> OpError:
    """OpError `who: msg ['x' (2, 3) f32, ...]`: what raised, what is wrong, the tensors concerned."""
    described = ", ".join(t.describe() for t in tensors)
    return OpError(f"{who}: {msg}" + (f" [{described}]" if described else ""))


def as_ints(who: str, what: str, values: Any, *tensors: Tensor) -> tuple[int, ...]:
    """`values` (a sequence) as a tuple of Python ints; a float (2.0 too), a bool, a str or a non-sequence
    raise OpError naming `who` and `what`."""
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        given = tuple(values)
    except TypeError:
        raise op_error(who, f"{what} must be a sequence of integers, got {values!r}", *tensors) from None
    bad = [v for v in given if not is_int(v)]
    if bad:
        raise op_error(who, f"{what} must hold integers, got {bad[0]!r} ({type(bad[0]).__name__}) in {given!r}",
                       *tensors)
    return tuple(int(v) for v in given)


def as_shape(who: str, shape: Any, what: str = "shape", *tensors: Tensor) -> Shape:
    """`shape` as a tuple of Python ints in [0, MAX_EXTENT] (`as_ints`, then each dim's range)."""
    dims = as_ints(who, what, shape, *tensors)
    if any(n < 0 for n in dims):
        raise op_error(who, f"negative dimension in {what} {dims}", *tensors)
    if any(n > MAX_EXTENT for n in dims):
        raise op_error(who, f"a dimension of {what} {dims} is 2**63 or more (a device addresses less)", *tensors)
    return dims


def check_extent(who: str, t: Tensor) -> Tensor:
    """`t` itself, if its element count and byte span stay within MAX_EXTENT; else OpError naming `who`."""
    if t.size > MAX_EXTENT or t.nbytes > MAX_EXTENT:
        raise op_error(who, f"shape {t.shape} {t.dtype.name} holds {t.size} elements in {t.nbytes} bytes, "
                       "2**63 or more (a device addresses less)")
    return t


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
    #: the model layer a param or state belongs to (a model sets it): a layer split keeps each
    #: layer's leafs and the ops reading them on one device (core/placement.py)
    layer: int | None = None
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
        return math.prod(self.shape)  # Python ints: no int64 wrap

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
    if not isinstance(name, str):
        raise OpError(f"a tensor's name must be a str, got {name!r} ({type(name).__name__})")
    who = f"tensor '{name}'"
    dt = _dtype(who, dt)
    shape = as_shape(who, shape)
    if dt.is_quant and (not shape or shape[-1] % dt.block_size):
        raise OpError(f"{who}: {dt.name} needs a last axis that is a multiple of {dt.block_size}, got shape {shape}")
    return check_extent(who, Tensor(shape, dt, contiguous_strides(shape, dt), name=name, flags=flags, data=data))


def _dtype(who: str, dt: Any) -> DType:
    try:
        return as_dtype(dt)
    except (TypeError, ValueError) as e:
        raise OpError(f"{who}: {e}") from None


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
    who = f"param '{name}'"
    if shape is not None:
        if dtype is None:
            raise OpError(f"{who}: raw data needs a dtype")
        t = _leaf(name, shape, dtype, Flag.PARAM)
        try:
            raw = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
        except (TypeError, ValueError) as e:
            raise OpError(f"{who}: raw data must be an array of plain bytes ({type(e).__name__}: {e})") from None
        want = t.nbytes
        if raw.size != want:
            raise OpError(f"{who}: {t.dtype.name} {t.shape} needs {want} bytes, got {raw.size}")
        t.data = raw
        return t
    arr = host_array(who, values, OpError)
    if dtype is None and arr.dtype.kind not in "fiuV":
        raise OpError(f"{who}: values must be numbers, got {arr.dtype} values")
    dt = _dtype(who, dtype if dtype is not None else (arr.dtype if arr.dtype != np.float64 else "f32"))
    t = _leaf(name, arr.shape, dt, Flag.PARAM)
    t.data = _storage(t, arr)
    return t


def _storage(t: Tensor, values: Any) -> np.ndarray:
    """Contiguous uint8 storage of `t` holding `values` (broadcast to its shape)."""
    who = f"tensor '{t.name}'"
    arr = check_values(who, t, host_array(who, values, OpError), OpError)
    try:
        arr = np.broadcast_to(arr, t.shape)
    except ValueError:
        raise OpError(f"{who}: values of shape {arr.shape} do not broadcast to {t.shape}") from None
    host = from_float(t.dtype, arr) if not t.dtype.is_int else arr.astype(t.dtype.numpy)
    # Always copy: the caller may mutate its array after building the graph.
    return np.array(host, order="C", copy=True).view(np.uint8).reshape(-1)


def host_array(who: str, value: Any, error: type[Exception]) -> np.ndarray:
    """`value` as a host numpy array (`to_numpy`); `error` naming `who` when it is not one (a ragged list)."""
    try:
        return to_numpy(value)
    except (TypeError, ValueError, BufferError, RuntimeError) as e:
        raise error(f"{who}: cannot be read as an array ({type(e).__name__}: {e})") from None


def check_values(who: str, t: Tensor, arr: np.ndarray, error: type[Exception]) -> np.ndarray:
    """`arr` itself if `t` can hold its numbers, else `error` naming `who`.

    Float and block dtypes take float and integer arrays; integer dtypes take integer arrays whose values
    fit (a float array is refused rather than truncated, a value out of range rather than wrapped).
    Strings, objects, bools and complex numbers are refused: none is a number these tensors store.
    """
    kind = arr.dtype.kind
    if t.dtype.is_int:
        if kind not in "iu":
            raise error(f"{who}: {t.dtype.name} takes integer values, got {arr.dtype} values")
        if arr.size and not np.can_cast(arr.dtype, t.dtype.numpy):
            info = np.iinfo(t.dtype.numpy)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise error(f"{who}: values {lo}..{hi} do not fit {t.dtype.name} ({info.min}..{info.max})")
    elif kind not in "fiuV" or (kind == "V" and arr.dtype != np.dtype(ml_dtypes.bfloat16)):
        raise error(f"{who}: {t.dtype.name} takes float or integer values, got {arr.dtype} values")
    return arr


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
