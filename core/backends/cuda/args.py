"""Named kernel arguments: one attrs record per kernel signature, its fields in C order.

A plugin declares, for each `__global__` kernel it launches, a subclass of
`KernelArgs` whose fields carry the C parameter names in order and whose
converters (`ptr`, `i32`, `i64`, `f32`, `f64`, ...) make the exact numpy scalar the
launcher passes, refusing a value the C type cannot hold (a silent wrap would
index the wrong memory). Variants are `attrs.evolve(args, field=...)`, never
slices of positional tuples. tests/test_kernel_args.py parses every kernel's
parameter list and checks each record against it.

    @attrs.frozen
    class GroupNormArgs(KernelArgs):
        KERNELS = ("group_norm_f32",)
        x: np.uint64 = ptr()
        dst: np.uint64 = ptr()
        channels: np.int32 = i32()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import attrs
import numpy as np

if TYPE_CHECKING:
    from ...tensor import Tensor


def _checked(dtype: type[np.generic], c_name: str) -> Any:
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None

    def convert(value: Any) -> np.generic:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"a kernel's {c_name} argument must be an integer, not {value!r}")
        if not info.min <= int(value) <= info.max:
            raise OverflowError(f"{value} does not fit a kernel's {c_name} argument [{info.min}, {info.max}]")
        return dtype(value)

    return convert


def _float(dtype: type[np.generic]) -> Any:
    def convert(value: Any) -> np.generic:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"a kernel's floating-point argument must be a number, not {value!r}")
        return dtype(value)

    return convert


def _bool(value: Any) -> np.bool_:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"a kernel's bool argument must be a bool, not {value!r}")
    return np.bool_(value)


def ptr() -> Any:
    """A device address (`T*`), passed as a 64-bit unsigned integer."""
    return attrs.field(converter=_checked(np.uint64, "pointer"))


def i32() -> Any:
    """A C `int`."""
    return attrs.field(converter=_checked(np.int32, "int"))


def u32() -> Any:
    """A C `unsigned`."""
    return attrs.field(converter=_checked(np.uint32, "unsigned"))


def i64() -> Any:
    """A C `long long`."""
    return attrs.field(converter=_checked(np.int64, "long long"))


def u64() -> Any:
    """A C `unsigned long long`."""
    return attrs.field(converter=_checked(np.uint64, "unsigned long long"))


def f32() -> Any:
    """A C `float`."""
    return attrs.field(converter=_float(np.float32))


def f64() -> Any:
    """A C `double`."""
    return attrs.field(converter=_float(np.float64))


def boolean() -> Any:
    """A C `bool`."""
    return attrs.field(converter=_bool)


@attrs.frozen
class ArgGroup:
    """A run of parameters several kernels declare alike (a macro such as `OD_LAYOUT_PARAMS(a)`):
    as a field `a` of a record, its fields stand for the C parameters `a` + their names; as a
    field whose name begins with `_` (`_shape: Shape4`), for their names alone."""

    def values(self) -> tuple[np.generic, ...]:
        return tuple(v for f in attrs.fields(type(self)) for v in _values(getattr(self, f.name)))

    def __getattr__(self, name: str) -> Any:
        """A parameter of a `_` group by its C name (`args.a0` for `_head: MatvecHead`), as the kernel reads it."""
        if not name.startswith("_"):
            for f in attrs.fields(type(self)):
                group = getattr(self, f.name) if f.name.startswith("_") else None
                if isinstance(group, ArgGroup) and name in attrs.fields_dict(type(group)):
                    return getattr(group, name)
        raise AttributeError(f"{type(self).__name__} has no argument {name!r}")

    @classmethod
    def names(cls, prefix: str = "") -> tuple[str, ...]:
        """The C parameter names of the fields, in order (groups inside expanded)."""
        out: list[str] = []
        for f in attrs.fields(attrs.resolve_types(cls)):
            kind = f.type if isinstance(f.type, type) else None
            if kind is not None and issubclass(kind, ArgGroup):
                out += kind.names(prefix if f.name.startswith("_") else prefix + f.name)
            else:
                out.append(prefix + f.name.rstrip("_"))  # a trailing _ spells a Python keyword (`in_`)
        return tuple(out)


@attrs.frozen
class Shape4(ArgGroup):
    """Four dims (`int n0..n3`) and four strides (`long long s0..s3`), outermost first: the
    geometry a strided kernel walks."""

    n0: np.int32 = i32()
    n1: np.int32 = i32()
    n2: np.int32 = i32()
    n3: np.int32 = i32()
    s0: np.int64 = i64()
    s1: np.int64 = i64()
    s2: np.int64 = i64()
    s3: np.int64 = i64()


@attrs.frozen
class IndexCheck(ArgGroup):
    """`OD_INDEX_CHECK_PARAMS` (common.cuh), the last parameters of a kernel that reads indices from data:
    the plan's error word on the device (0: checking off) and the tag of this use of an index tensor
    (opdispatch.errorword). A record declares it as its field `err_` (C names `err_word`, `err_tag`)."""

    word: np.uint64 = ptr()
    tag: np.uint32 = u32()


#: a kernel launched in a mode that reads no index (mmvq_stream for mul_mat), or with checking off
UNCHECKED = IndexCheck(0, 0)

#: guard(node, index, bound, what, instead): the IndexCheck of a launch of `node` whose kernel reads
#: `index`'s values as indices into [0, bound) (`what` they pick, what it does `instead` with a bad
#: one): a bind's `ctx.index_check`, which registers the use in the plan's table; tests pass fakes.
Guard = Callable[["Tensor", "Tensor", int, str, str], IndexCheck]
#: what the kernels do `instead` with a bad index
NOT_WRITTEN = "that row is not written"
NAN_ROW = "its output row is filled with NaN"


def _values(v: Any) -> tuple[np.generic, ...]:
    return v.values() if isinstance(v, ArgGroup) else (v,)


@attrs.frozen
class KernelArgs(ArgGroup):
    """The arguments of one launch, by name; `KERNELS` names the `__global__` functions
    (without template arguments) whose parameter list the fields follow, in order. A field
    whose type is an `ArgGroup` stands for that group's parameters, prefixed by its name."""

    KERNELS: ClassVar[tuple[str, ...]] = ()


def cpp(value: bool | int | str) -> str:
    """A C++ template argument's spelling: `true`/`false` for bools, digits for ints, names as they are."""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    return str(int(value)) if isinstance(value, (int, np.integer)) else str(value)


def instance(kernel: str, *params: bool | int | str) -> str:
    """The NVRTC name expression of a template instance: `instance("k", 128, True)` -> `k<128, true>`."""
    return f"{kernel}<{', '.join(cpp(p) for p in params)}>" if params else kernel


__all__: Sequence[str] = ["ArgGroup", "KernelArgs", "Shape4", "IndexCheck", "UNCHECKED", "Guard", "NOT_WRITTEN",
                          "NAN_ROW", "ptr", "i32", "u32", "i64", "u64", "f32", "f64",
                          "boolean", "cpp", "instance"]
