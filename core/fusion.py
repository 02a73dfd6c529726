"""Fusion rules: a pattern of consecutive ops run by one kernel.

A rule is data (name, op pattern, check, bind), after tinygrad's pattern
matcher; plugins yield rules through the `fusion_rules` hook. `can_fuse`
is ggml's structural condition; the rule's `check` adds its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import attrs

from .tensor import VIEW_OPS

if TYPE_CHECKING:
    from .backends.base import BindContext, Device, Launch
    from .graph import Graph
    from .tensor import Tensor


def _accept(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    return True


@attrs.frozen
class FusionRule:
    """`pattern` ops, consecutive in execution order, run by one `bind`-ed launch.

    `check(device, nodes, graph)` returns True or a reason not to fuse (types,
    shapes, broadcasting the fused kernel cannot handle). `bind(ctx, nodes)`
    returns one launch that writes the last node's output, and the outputs of
    the nodes at the pattern positions in `outputs`: those may be read outside
    the group (ggml's top-k MoE router also writes the expert ids).
    """

    name: str
    pattern: tuple[str, ...] = attrs.field(converter=tuple)
    bind: Callable[[BindContext, Sequence[Tensor]], Launch]
    check: Callable[[Device, Sequence[Tensor], Graph], bool | str] = _accept
    outputs: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        if len(self.pattern) < 2:
            raise ValueError(f"fusion rule '{self.name}': a pattern needs at least two ops")
        if any(not 0 <= j < len(self.pattern) - 1 for j in self.outputs):
            raise ValueError(f"fusion rule '{self.name}': outputs {self.outputs} must be positions "
                             f"before the last of its {len(self.pattern)} ops")


def can_fuse(graph: Graph, start: int, pattern: Sequence[str], outputs: Sequence[int] = ()) -> bool:
    """ggml's can_fuse: nodes start.. match `pattern` in order, and every node
    but the last is read only inside the group and is not a graph output,
    except those at the positions in `outputs`, which the fused kernel writes,
    and views (no kernel: reading one reads its base) of a tensor the group
    writes or does not touch."""
    nodes = graph.nodes
    end = start + len(pattern)
    if end > len(nodes):
        return False
    group = nodes[start:end]
    if any(n.op != p for n, p in zip(group, pattern)):
        return False
    members = set(group)
    written = {group[-1].base, *(group[j].base for j in outputs)}
    touched = {n.base for n in group if n.op not in VIEW_OPS}
    for j, n in enumerate(group[:-1]):
        if j in outputs:
            continue
        if n.op in VIEW_OPS and (n.base in written or n.base not in touched):
            continue
        if graph.is_output(n):
            return False
        readers = graph.users.get(n, ())
        if not readers or any(r not in members for r in readers):
            return False
    return True

