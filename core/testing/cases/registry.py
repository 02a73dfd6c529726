"""The registry of case generators, per op and per fused pattern, and the groups the sweep runs."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from ...ops.base import OPS
from .base import Case

Generator = Callable[[str, bool], Iterable[Case]]
#: op name -> its generators(op, full), in registration order (an op's edge-value cases come from a second one)
GENERATORS: dict[str, list[Generator]] = {}
#: fused pattern name -> (ops it needs, generator(name, full))
FUSED: dict[str, tuple[tuple[str, ...], Generator]] = {}


def generator(*op_names: str) -> Callable[[Generator], Generator]:
    def register(fn: Generator) -> Generator:
        for name in op_names:
            GENERATORS.setdefault(name, []).append(fn)
        return fn

    return register


def fused(name: str, needs: Sequence[str]) -> Callable[[Generator], Generator]:
    def register(fn: Generator) -> Generator:
        FUSED[name] = (tuple(needs), fn)
        return fn

    return register


def groups() -> list[str]:
    """Every op of `OPS`, then every fused pattern, in the order the sweep runs them."""
    return [*OPS, *(f"fused:{name}" for name in FUSED)]


def cases(group: str, full: bool = False) -> list[Case]:
    """The cases of one group (an op name or 'fused:<pattern>'); [] when it has none.

    A group without cases is an op with no generator, or a fused pattern
    whose ops are not all in `OPS` yet: callers report it, never skip it.
    """
    if group not in groups():
        raise KeyError(f"unknown op '{group}' (known: {', '.join(groups())})")
    if group.startswith("fused:"):
        name = group[len("fused:"):]
        return list(FUSED[name][1](name, full)) if available(group) else []
    return [case for gen in GENERATORS.get(group, ()) for case in gen(group, full)]


def available(group: str) -> bool:
    """An op of `OPS`, or a fused pattern whose ops all are."""
    if group.startswith("fused:"):
        return all(n in OPS for n in FUSED[group[len("fused:"):]][0])
    return group in OPS

