"""When a norm and the mul (and add) after it run as one kernel.

The groups are ggml's: rms_norm -> mul (the weight) and rms_norm -> mul ->
add (the residual), and the same for norm. Each op after the norm combines
the previous result with one more tensor, on either side; the fused kernel
handles that tensor broadcast by modulo over rows and columns, as mul and
add allow, with contiguous rows. `check` declines with a reason anything
else, and the group then runs unfused.
"""

from __future__ import annotations

from typing import Sequence

from opdispatch.hookspecs import Device
from opdispatch.graph import Graph
from opdispatch.support import first_failure
from opdispatch.tensor import Tensor

from . import support

#: what the other source of each op after the norm is
ROLES = ("weight", "residual")


def operands(nodes: Sequence[Tensor]) -> list[Tensor]:
    """The tensor each op after the norm combines with: [weight] or [weight, residual]."""
    return [n.srcs[1] if n.srcs[0] is prev else n.srcs[0] for prev, n in zip(nodes, nodes[1:])]


def check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """True if the fused kernel computes `nodes` (norm, mul[, add]) exactly; else why not."""
    norm = nodes[0]
    ok = support.row_norm(device, norm)
    if ok is not True:
        return f"{norm.op}: {ok}"
    inside = set(nodes)
    for prev, node, other, role in zip(nodes, nodes[1:], operands(nodes), ROLES):
        if prev not in node.srcs:
            return f"{node.op} does not read the {prev.op} before it"
        if node.shape != norm.shape:
            return f"{node.op} broadcasts the {norm.op} result into {node.shape}"
        if other in inside:
            return f"the {role} of {node.op} is computed inside the group"
        ok = first_failure(other, support.operand_rules(norm))
        if ok is not True:
            return f"the {role} {other.describe()} {ok}"
        if node.dtype.name != "f32" or not node.is_contiguous():
            return f"{node.op} must give a contiguous f32 result"
    return True
