"""Matching fusion rules: patterns against the graph, rules indexed by their first op.

A rule is data (hookspecs.FusionRule: name, op pattern, check, bind), after
tinygrad's pattern matcher; plugins yield rules through the `fusion_rules`
hook. `gather` collects a rule's group from a node (consecutive, or past independent nodes of the
rule's `hoist` ops, which then run first); `can_fuse` is ggml's structural condition on it; the rule's
`check` adds its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection, Iterable, Sequence, TypeVar

from .tensor import VIEW_OPS

if TYPE_CHECKING:
    from .graph import Graph
    from .hookspecs import FusionRule, PatternOp
    from .tensor import Tensor

R = TypeVar("R")


def op_matches(op: str, at: PatternOp) -> bool:
    """Does `op` fit a pattern position: that op, or one of a set of them?"""
    return op == at if isinstance(at, str) else op in at


def pattern_matches(ops: Sequence[str], pattern: Sequence[PatternOp]) -> bool:
    """Do `ops` fit `pattern`, position by position (and in number)?"""
    return len(ops) == len(pattern) and all(op_matches(o, p) for o, p in zip(ops, pattern))


def first_ops(pattern: Sequence[PatternOp]) -> frozenset[str]:
    """The ops a node may have for `pattern` to start at it."""
    head = pattern[0]
    return frozenset((head,)) if isinstance(head, str) else head


def index_by_first_op(rules: Iterable[tuple[R, FusionRule]]) -> dict[str, list[tuple[R, FusionRule]]]:
    """(owner, rule) pairs by the ops their patterns start with, each list in the given order:
    trying fusions at a node looks only at the rules that can start there."""
    index: dict[str, list[tuple[R, FusionRule]]] = {}
    for owner, rule in rules:
        for op in sorted(first_ops(rule.pattern)):
            index.setdefault(op, []).append((owner, rule))
    return index


def gather(nodes: Sequence[Tensor], start: int, pattern: Sequence[PatternOp], hoist: Collection[str] = (),
           end: int | None = None) -> tuple[list[Tensor], list[Tensor]] | None:
    """The nodes from `start` (before `end`) that match `pattern` in order, and those skipped between them,
    or None. A node that does not fit the next position is skipped when its op is in `hoist` and it is
    independent of the group so far (`hoistable`): the group then runs after the skipped nodes, which
    must not need its results. With `hoist` empty the group is nodes start.. exactly (ggml's contiguity)."""
    stop = len(nodes) if end is None else end
    group: list[Tensor] = []
    skipped: list[Tensor] = []
    i = start
    while len(group) < len(pattern):
        if i >= stop:
            return None
        n = nodes[i]
        if op_matches(n.op, pattern[len(group)]):
            group.append(n)
        elif group and n.op in hoist and hoistable(n, group):
            skipped.append(n)
        else:
            return None
        i += 1
    return group, skipped


def hoistable(node: Tensor, group: Sequence[Tensor]) -> bool:
    """May `node` run before `group`, which precedes it? Not if it reads a group node or a buffer the
    group writes in place (a KV cache), or itself writes in place a buffer the group reads or writes."""
    members = set(group)
    written = {n.base for n in group if n.op not in VIEW_OPS}
    if any(s is not None and (s in members or s.base in written) for s in node.srcs):
        return False
    if node.op in VIEW_OPS or node.base is node:
        return True
    touched = written | {s.base for n in group for s in n.srcs if s is not None}
    return node.base not in touched


def can_fuse(graph: Graph, group: Sequence[Tensor], pattern: Sequence[PatternOp], outputs: Sequence[int] = ()
             ) -> bool:
    """ggml's can_fuse: `group` (as `gather` collects it) matches `pattern` in order, and every node
    but the last is read only inside the group and is not a graph output, except those at the positions
    in `outputs`, which the fused kernel writes, and views (no kernel: reading one reads its base) of a
    tensor the group writes or does not touch."""
    if not pattern_matches([n.op for n in group], pattern):
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
