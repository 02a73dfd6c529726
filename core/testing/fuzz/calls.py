"""`Call`: an op node seen as the builder call that made it, so one argument can be swapped and the
call made again.

The builder's signature says which arguments are tensors (annotated `Tensor`) and what kind each
other one is (int, float, str, bool, a sequence of ints, pairs of ints); a node's sources fill the
tensor arguments in order and its params, stored under the argument names, the others.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import attrs

from ... import ops
from ...ops.base import OPS
from ...tensor import Tensor

#: argument kinds, read off the builders' annotations (most specific first)
KINDS = (("Sequence[Sequence[int]]", "pairs"), ("Sequence[int]", "ints"), ("bool", "bool"), ("int", "int"),
         ("float", "float"), ("str", "str"))


@attrs.frozen
class Arg:
    """One argument of a builder: its kind ('tensor' or one of KINDS'), and whether None is allowed."""

    name: str
    kind: str
    optional: bool
    default: Any = inspect.Parameter.empty


def _kind(annotation: str) -> str:
    if "Tensor" in annotation:
        return "tensor"
    for pattern, kind in KINDS:
        if pattern in annotation:
            return kind
    raise TypeError(f"unknown argument annotation {annotation!r}")


def signature(builder: Callable[..., Tensor]) -> tuple[Arg, ...]:
    return tuple(Arg(p.name, _kind(str(p.annotation)), "None" in str(p.annotation), p.default)
                 for p in inspect.signature(builder).parameters.values())


def builder_of(node: Tensor) -> Callable[..., Tensor]:
    """The builder that made `node`: OPS' entry, or glu_split for a glu node with two sources."""
    if node.op == "glu" and node.srcs[1] is not None:
        return ops.glu_split
    return OPS[node.op].build


@attrs.frozen
class Call:
    """`builder(**tensors, **params)`: the op under test's arguments, by name."""

    op: str
    builder: Callable[..., Tensor] = attrs.field(repr=False)
    tensors: dict[str, Tensor | None]
    params: dict[str, Any]

    @classmethod
    def of(cls, node: Tensor) -> Call:
        builder = builder_of(node)
        args = signature(builder)
        names = [a.name for a in args if a.kind == "tensor"]
        tensors = dict(zip(names, node.srcs))
        params = {}
        for a in args:
            if a.kind == "tensor":
                continue
            if a.name in node.params:
                params[a.name] = node.params[a.name]
            elif a.default is not inspect.Parameter.empty:
                params[a.name] = a.default
            else:
                raise KeyError(f"{node.op}: argument '{a.name}' is neither in the node's params nor defaulted")
        return cls(node.op, builder, tensors, params)

    @property
    def args(self) -> tuple[Arg, ...]:
        return signature(self.builder)

    def arg(self, name: str) -> Arg:
        return next(a for a in self.args if a.name == name)

    def t(self, name: str) -> Tensor:
        """The tensor argument `name` (it must be given)."""
        t = self.tensors[name]
        if t is None:
            raise KeyError(f"{self.op}: no tensor '{name}'")
        return t

    @property
    def split(self) -> bool:
        """A glu over two tensors (glu_split)."""
        return self.builder is ops.glu_split

    def with_tensor(self, name: str, t: Tensor | None) -> Call:
        return attrs.evolve(self, tensors={**self.tensors, name: t})

    def with_param(self, name: str, value: Any) -> Call:
        return attrs.evolve(self, params={**self.params, name: value})

    def invoke(self) -> Tensor:
        return self.builder(**self.tensors, **self.params)
