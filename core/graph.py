"""Graph: the nodes needed for some outputs, in topological (execution) order."""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from .errors import OpError
from .tensor import Flag, Tensor


@attrs.define(eq=False)
class Graph:
    """Built from its outputs by a depth-first walk, sources before users (ggml's order).

    `nodes` are the op nodes in execution order, `leafs` the tensors without an
    op (inputs, params, states). `users[t]` lists the nodes reading `t`, in
    execution order, once per source slot (ggml's use count is its length).
    """

    outputs: tuple[Tensor, ...]
    nodes: list[Tensor]
    leafs: list[Tensor]
    users: dict[Tensor, list[Tensor]]
    #: leafs_with's answers, by flag value: a graph's leafs do not change once built, and Plan.run
    #: asks for the inputs on every run (enum Flag arithmetic per leaf is slow on a hot path)
    _with: dict[int, tuple[Tensor, ...]] = attrs.field(init=False, factory=dict, repr=False)

    @classmethod
    def build(cls, outputs: Tensor | Sequence[Tensor]) -> Graph:
        try:
            outs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
        except TypeError:
            raise OpError(f"Graph: outputs must be a Tensor or a sequence of Tensors, got {outputs!r}") from None
        if not outs:
            raise OpError("Graph: no outputs given")
        nodes: list[Tensor] = []
        leafs: list[Tensor] = []
        seen: set[Tensor] = set()
        users: dict[Tensor, list[Tensor]] = {}
        for out in outs:
            if not isinstance(out, Tensor):
                raise OpError(f"Graph: outputs must be Tensors, got {type(out).__name__}")
            # Iterative DFS: decoder graphs are deeper than Python's recursion limit.
            stack: list[tuple[Tensor, int]] = [(out, 0)]
            while stack:
                t, i = stack.pop()
                if t in seen:
                    continue
                srcs = [s for s in t.srcs if s is not None]
                if i < len(srcs):
                    stack.append((t, i + 1))
                    if srcs[i] not in seen:
                        stack.append((srcs[i], 0))
                    continue
                seen.add(t)
                (leafs if t.is_leaf else nodes).append(t)
                for s in srcs:
                    users.setdefault(s, []).append(t)
        return cls(outs, nodes, leafs, users)

    def __len__(self) -> int:
        return len(self.nodes)

    def is_output(self, t: Tensor) -> bool:
        return any(t is o for o in self.outputs)

    def leafs_with(self, flag: Flag) -> list[Tensor]:
        """The leafs with any of `flag`'s bits, in leaf order (computed once per flag, then cached)."""
        got = self._with.get(flag.value)
        if got is None:
            got = self._with[flag.value] = tuple(t for t in self.leafs if t.flags & flag)
        return list(got)

    @property
    def inputs(self) -> list[Tensor]:
        return self.leafs_with(Flag.INPUT)

    @property
    def params(self) -> list[Tensor]:
        return self.leafs_with(Flag.PARAM)

    @property
    def states(self) -> list[Tensor]:
        return self.leafs_with(Flag.STATE)

    def use_count(self, t: Tensor) -> int:
        return len(self.users.get(t, ()))

    def key(self) -> tuple[Any, ...]:
        """Structural key: equal for graphs with the same ops, params, shapes,
        dtypes, strides and wiring, whatever the data. Plans are cached by it."""
        index: dict[Tensor, int] = {}
        parts: list[Any] = []
        for t in [*self.leafs, *self.nodes]:
            index[t] = len(index)
            parts.append((
                t.op,
                _freeze(t.params),
                t.shape,
                t.dtype.name,
                t.strides,
                t.flags.value,
                tuple(index[s] if s is not None else -1 for s in t.srcs),
                index.get(t.view_src, -1) if t.view_src is not None else -1,
                t.view_offset,
                t.uid if t.flags & (Flag.PARAM | Flag.STATE) else -1,  # weights are identity, not structure
            ))
        parts.append(tuple(index[o] for o in self.outputs))
        return tuple(parts)


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, float):
        return v.hex()  # -0.0 == 0.0, yet x * -0.0 is not x * 0.0: graphs differing so must not share a plan
    return v
