"""The op registry and the helpers every op builder uses.

An op builder validates its sources and params at graph-build time, infers the
result's shape and dtype and returns a new node. `OPS` maps each op name to its
`OpDef`, so the CLI, the conformance harness and plugins can enumerate ops.
Params go through the `*_param` checks: a wrong type or range raises OpError
naming the op and the param here, not a TypeError from a kernel later, and a
float is never truncated to an int (nor a bool taken for one).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, NoReturn, Sequence

import attrs
import numpy as np

from ..errors import OpError
from ..dtypes import DTYPES, DType, dtype as as_dtype
from ..quants import FORMATS
from ..tensor import Shape, Tensor, as_ints, as_shape, check_extent, contiguous_strides, is_int, op_error


@attrs.frozen
class OpDef:
    """One op of the catalogue."""

    name: str
    build: Callable[..., Tensor]
    family: str  # matmul | elementwise | unary | glu | norm | attention | rows | shape | reduce | view | collective
    #: index of the source whose storage the result aliases (set_rows, cpy), or None
    inplace: int | None = None
    #: kernels must be correct when the output aliases source 0 (same layout), so the memory
    #: plan may write the result over source 0's bytes when it reads them for the last time
    #: (ggml's in-place rule: elementwise maps and norms)
    reuses_src0: bool = False

    @property
    def doc(self) -> str:
        return (self.build.__doc__ or "").strip().splitlines()[0] if self.build.__doc__ else ""


OPS: dict[str, OpDef] = {}


def op(family: str, name: str | None = None, inplace: int | None = None, reuses_src0: bool = False) -> Callable:
    """Register a builder in `OPS` under `name` (default: the function's name)."""

    def register(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        key = name or fn.__name__
        if key in OPS:
            raise RuntimeError(f"op '{key}' registered twice")
        OPS[key] = OpDef(key, fn, family, inplace, reuses_src0)
        return fn

    return register


def fail(op_name: str, msg: str, *tensors: Tensor) -> NoReturn:
    """Raise OpError: `op: msg ['x' (2, 3) f32, ...]`."""
    raise op_error(op_name, msg, *tensors)


def check(cond: bool, op_name: str, msg: str, *tensors: Tensor) -> None:
    if not cond:
        fail(op_name, msg, *tensors)


def check_tensor(op_name: str, t: Any, what: str = "source") -> Tensor:
    if not isinstance(t, Tensor):
        raise OpError(f"{op_name}: {what} must be a Tensor, got {type(t).__name__}")
    return t


def int_param(op_name: str, name: str, value: Any, *tensors: Tensor, lo: int | None = None,
              hi: int | None = None) -> int:
    """`value` as a Python int in [lo, hi] (either bound optional) and in int64's range (op params are
    64-bit at most, as ggml's); a float, a bool or anything else raises."""
    if not is_int(value):
        fail(op_name, f"{name} must be an integer, got {value!r} ({type(value).__name__})", *tensors)
    v = int(value)
    if not -2**63 <= v < 2**63:
        fail(op_name, f"{name} must fit in 64 bits, got {v}", *tensors)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        fail(op_name, f"{name} must be {_range(lo, hi)}, got {v}", *tensors)
    return v


def float_param(op_name: str, name: str, value: Any, *tensors: Tensor, finite: bool = True,
                lo: float | None = None) -> float:
    """`value` (a real number: ints are fine) as a Python float, never NaN, finite unless `finite=False`,
    >= `lo` if given; a str, None, a bool, a list raise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        fail(op_name, f"{name} must be a real number, got {value!r} ({type(value).__name__})", *tensors)
    v = float(value)
    if math.isnan(v) or (finite and math.isinf(v)):
        fail(op_name, f"{name} must be {'finite' if finite else 'a number, not NaN'}, got {v}", *tensors)
    if lo is not None and v < lo:
        fail(op_name, f"{name} must be >= {lo}, got {v}", *tensors)
    return v


def bool_param(op_name: str, name: str, value: Any, *tensors: Tensor) -> bool:
    """`value` as a bool; only True and False (numpy's included) are."""
    if not isinstance(value, (bool, np.bool_)):
        fail(op_name, f"{name} must be True or False, got {value!r} ({type(value).__name__})", *tensors)
    return bool(value)


def choice_param(op_name: str, name: str, value: Any, choices: Sequence[str], *tensors: Tensor) -> str:
    """`value`, one of the strings `choices`."""
    if not isinstance(value, str) or value not in choices:
        fail(op_name, f"{name} {value!r} is not one of {', '.join(choices)}", *tensors)
    return value


def ints_param(op_name: str, name: str, values: Any, n: int | None = None, *tensors: Tensor) -> tuple[int, ...]:
    """`values` as a tuple of Python ints (`n` of them if given): one per axis, a shape, strides."""
    given = as_ints(op_name, name, values, *tensors)
    if n is not None and len(given) != n:
        fail(op_name, f"{name} needs {n} entries, one per axis, got {len(given)}: {given!r}", *tensors)
    return given


def _range(lo: int | None, hi: int | None) -> str:
    return f"in {lo}..{hi}" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"


def check_dtype(op_name: str, t: Tensor, allowed: Iterable[str], what: str = "") -> None:
    allowed = tuple(allowed)
    check(
        t.dtype.name in allowed,
        op_name,
        f"{what or 'source'} dtype {t.dtype.name} not supported (expected one of {', '.join(allowed)})",
        t,
    )


def check_rank(op_name: str, t: Tensor, lo: int, hi: int = 4) -> None:
    check(lo <= t.ndim <= hi, op_name, f"expected {lo}..{hi} dimensions, got {t.ndim}", t)


def can_repeat(b: Shape, a: Shape) -> bool:
    """ggml's can_repeat: b broadcasts into a by modulo (each a dim a multiple of b's)."""
    if len(b) > len(a):
        return False
    b = (1,) * (len(a) - len(b)) + tuple(b)
    return all(nb != 0 and na % nb == 0 for na, nb in zip(a, b))


def pad4(shape: Shape) -> Shape:
    """`shape` with leading 1s up to 4 dims (ggml's missing outer dims)."""
    return (1,) * (4 - len(shape)) + tuple(shape)


FLOATS = ("f32", "f16", "bf16")
#: ggml's 32-value block formats (the conformance sweep's quantized cases)
QUANTS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
#: every block format of the dtype table: what ops that only read blocks take (mul_mat, mul_mat_id,
#: out_prod, get_rows, copies to a float)
BLOCK_FORMATS = tuple(name for name, t in DTYPES.items() if t.is_quant)
#: the block formats opdispatch can write (an encoder in opdispatch.quants): copies from a float, set_rows
ENCODABLE = tuple(name for name in BLOCK_FORMATS if FORMATS[name].encode is not None)


def node(
    op_name: str,
    srcs: Sequence[Tensor | None],
    shape: Sequence[int],
    dtype: str | DType = "f32",
    params: dict[str, Any] | None = None,
    *,
    inplace_of: Tensor | None = None,
) -> Tensor:
    """A new op node with contiguous storage, or aliasing `inplace_of`'s storage.

    Optional sources may be None; they are kept in place so that a source's
    index means the same thing for every node of an op.
    """
    dt = as_dtype(dtype)
    shape = as_shape(op_name, shape)
    if inplace_of is not None:
        # params are constant (a kernel may read them before the kernel ahead of it has finished)
        check(not inplace_of.base.is_constant, op_name, "writes into weights (a param): write into a state",
              inplace_of)
        return Tensor(
            shape, dt, inplace_of.strides, op=op_name, params=dict(params or {}), srcs=srcs,
            view_src=inplace_of, view_offset=0,
        )
    return check_extent(op_name, Tensor(shape, dt, contiguous_strides(shape, dt), op=op_name,
                                        params=dict(params or {}), srcs=srcs))
