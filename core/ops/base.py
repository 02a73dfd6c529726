"""The op registry and the helpers every op builder uses.

An op builder validates its sources at graph-build time, infers the result's
shape and dtype and returns a new node. `OPS` maps each op name to its
`OpDef`, so the CLI, the conformance harness and plugins can enumerate ops.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import attrs

from ..errors import OpError
from ..dtypes import DType, dtype as as_dtype
from ..tensor import Shape, Tensor, contiguous_strides


@attrs.frozen
class OpDef:
    """One op of the catalogue."""

    name: str
    build: Callable[..., Tensor]
    family: str  # matmul | elementwise | unary | glu | norm | attention | rows | shape | reduce | view
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


def fail(op_name: str, msg: str, *tensors: Tensor) -> None:
    """Raise OpError: `op: msg (a 'x' (2, 3) f32, b ...)`."""
    described = ", ".join(t.describe() for t in tensors)
    raise OpError(f"{op_name}: {msg}" + (f" [{described}]" if described else ""))


def check(cond: bool, op_name: str, msg: str, *tensors: Tensor) -> None:
    if not cond:
        fail(op_name, msg, *tensors)


def check_tensor(op_name: str, t: Any, what: str = "source") -> Tensor:
    if not isinstance(t, Tensor):
        raise OpError(f"{op_name}: {what} must be a Tensor, got {type(t).__name__}")
    return t


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
QUANTS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")


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
    shape = tuple(int(n) for n in shape)
    if inplace_of is not None:
        # params are constant (a kernel may read them before the kernel ahead of it has finished)
        check(not inplace_of.base.is_constant, op_name, "writes into weights (a param): write into a state",
              inplace_of)
        return Tensor(
            shape, dt, inplace_of.strides, op=op_name, params=dict(params or {}), srcs=srcs,
            view_src=inplace_of, view_offset=0,
        )
    return Tensor(shape, dt, contiguous_strides(shape, dt), op=op_name, params=dict(params or {}), srcs=srcs)
