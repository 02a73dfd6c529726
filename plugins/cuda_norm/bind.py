"""cuda_norm's binds: a node (or a fused group) to the pre-bound launch of its spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from opdispatch.hookspecs import Launch
from opdispatch.tensor import Tensor

from . import fusion
from .specs import group_spec, row_spec

if TYPE_CHECKING:
    from opdispatch.backends.cuda.backend import CudaContext


def bind_row_norm(ctx: CudaContext, node: Tensor) -> Launch:
    return row_spec(node.op, node.srcs[0], node, node.params["eps"], ctx.ptr).launch(ctx.stream)


def bind_group_norm(ctx: CudaContext, node: Tensor) -> Launch:
    x = node.srcs[0]
    return group_spec(x, node, node.params["groups"], node.params["eps"], ctx.ptr).launch(ctx.stream)


def bind_fused(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    norm = nodes[0]
    spec = row_spec(norm.op, norm.srcs[0], nodes[-1], norm.params["eps"], ctx.ptr, *fusion.operands(nodes))
    return spec.launch(ctx.stream)
