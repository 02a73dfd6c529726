"""leaky_cuda's binds: a node or a fused group to the pre-bound launch of its spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from opdispatch.hookspecs import Launch
from opdispatch.tensor import Tensor

from .specs import leaky_spec

if TYPE_CHECKING:
    from opdispatch.backends.cuda.backend import CudaContext


def bind_leaky(ctx: CudaContext, node: Tensor) -> Launch:
    spec = leaky_spec(ctx.ptr(node.srcs[0]), ctx.ptr(node), node.size, node.params["negative_slope"])
    return spec.launch(ctx.stream)


def bind_scale_leaky(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    scale, leaky = nodes
    spec = leaky_spec(ctx.ptr(scale.srcs[0]), ctx.ptr(leaky), leaky.size, leaky.params["negative_slope"],
                      scale.params["s"])
    return spec.launch(ctx.stream)
