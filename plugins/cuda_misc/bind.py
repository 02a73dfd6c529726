"""cuda_misc's binds: a node's (or fused group's) specs made into one pre-bound launch on the context's
stream, with the device's facts, the plan's index checks (`ctx.index_check`: get_rows, set_rows, add_id,
the greedy pick) and, for argmax_split, scratch from the backend's pool.

The only module of the plugin that touches a `CudaContext`; what each launch is, is decided by the
pure functions of `specs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from opdispatch.backends.cuda.devices import facts
from opdispatch.backends.cuda.kernels import KernelSpec, launch_specs
from opdispatch.hookspecs import Launch
from opdispatch.tensor import Tensor

from .specs import Ptr
from .specs.elementwise import add_id_spec, binary_spec, multi_add_spec
from .specs.reduce import argmax_split_specs, greedy_specs, split_workspaces
from .specs.rows import copy_specs, get_rows_specs, set_rows_specs
from .specs.sort import argsort_specs, chunk_limit, moe_specs, top_k_specs
from .specs.unary import UNARY_CODES, glu_spec, map_params, unary_spec

if TYPE_CHECKING:
    from opdispatch.backends.cuda.backend import CudaContext

#: a pure specs function of the shape `(node, ptr, SM count) -> specs`
NodeSpecs = Callable[[Tensor, Ptr, int], list[KernelSpec]]


def binder(specs: NodeSpecs) -> Callable[[CudaContext, Tensor], Launch]:
    """The bind of a node whose launches `specs` gives."""
    def bind(ctx: CudaContext, node: Tensor) -> Launch:
        return launch_specs(ctx.stream, specs(node, ctx.ptr, facts(ctx.device).sm_count))

    bind.__name__ = f"bind_{specs.__name__.removesuffix('_specs')}"
    return bind


# -- elementwise, unary, glu --------------------------------------------------------------------------


def bind_binary(ctx: CudaContext, node: Tensor) -> Launch:
    """add, sub, mul, div; add1 is an add of a one-element b."""
    a, b = node.srcs
    op = "add" if node.op == "add1" else node.op
    return launch_specs(ctx.stream, [binary_spec(op, a, b, node, ctx.ptr, facts(ctx.device).sm_count)])


def bind_add_id(ctx: CudaContext, node: Tensor) -> Launch:
    return launch_specs(ctx.stream, [add_id_spec(node, ctx.ptr, ctx.index_check, facts(ctx.device).sm_count)])


def bind_map(ctx: CudaContext, node: Tensor) -> Launch:
    p0, p1 = map_params(node)
    spec = unary_spec(UNARY_CODES[node.op], node.srcs[0], node, p0, p1, ctx.ptr, facts(ctx.device).sm_count)
    return launch_specs(ctx.stream, [spec])


def bind_glu(ctx: CudaContext, node: Tensor) -> Launch:
    return launch_specs(ctx.stream, [glu_spec(node, ctx.ptr, facts(ctx.device).sm_count)])


def bind_multi_add(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    return launch_specs(ctx.stream, [multi_add_spec(nodes, ctx.ptr, facts(ctx.device).sm_count)])


def bind_softcap(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    """scale -> tanh -> scale as unary.cu's softcap: s2 * tanh(s1 * x)."""
    s1, _, s2 = nodes
    spec = unary_spec(UNARY_CODES["softcap"], s1.srcs[0], s2, s1.params["s"], s2.params["s"], ctx.ptr,
                      facts(ctx.device).sm_count)
    return launch_specs(ctx.stream, [spec])


# -- copies, rows --------------------------------------------------------------------------------------


def bind_copy(ctx: CudaContext, node: Tensor) -> Launch:
    # cpy's result aliases its second source: writing `node` writes b.
    return launch_specs(ctx.stream, copy_specs(node.srcs[0], node, ctx.ptr, facts(ctx.device).sm_count))


def bind_get_rows(ctx: CudaContext, node: Tensor) -> Launch:
    return launch_specs(ctx.stream, get_rows_specs(node, ctx.ptr, ctx.index_check))


def bind_set_rows(ctx: CudaContext, node: Tensor) -> Launch:
    return launch_specs(ctx.stream, set_rows_specs(node, ctx.ptr, ctx.index_check))


# -- argmax_split: scratch from the pool ------------------------------------------------------------------


def _split(ctx: CudaContext, x: Tensor, make: Callable[[Sequence[int], int], list[KernelSpec]]) -> Launch:
    """argmax_split over x's rows: its workspaces taken at bind, then the specs `make(their addresses, SMs)`,
    the buffers kept alive with the launch."""
    sms = facts(ctx.device).sm_count
    bufs = ctx.backend.scratch.take_all(split_workspaces(x, sms))
    return launch_specs(ctx.stream, make([buf.ptr for buf in bufs], sms), bufs)


def bind_argmax_split(ctx: CudaContext, node: Tensor) -> Launch:
    x = node.srcs[0]
    return _split(ctx, x, lambda ws, sms: argmax_split_specs(x, node, ctx.ptr, ws, sms))


def bind_greedy_pick(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    return _split(ctx, nodes[0].srcs[0], lambda ws, sms: greedy_specs(nodes, ctx.ptr, ctx.index_check, ws, sms))


# -- sorting -------------------------------------------------------------------------------------------------


def bind_argsort(ctx: CudaContext, node: Tensor) -> Launch:
    return launch_specs(ctx.stream, argsort_specs(node, ctx.ptr, chunk_limit(ctx.device)))


def bind_top_k(ctx: CudaContext, node: Tensor) -> Launch:
    return launch_specs(ctx.stream, top_k_specs(node, ctx.ptr, chunk_limit(ctx.device)))


def bind_moe(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    return launch_specs(ctx.stream, moe_specs(nodes, ctx.ptr))
