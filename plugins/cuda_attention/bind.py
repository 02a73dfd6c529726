"""The binds the hooks register: each turns a node (or a fused group) into its launch specs and pre-binds
them on the context's stream, with the scratch buffers a flash_attn_ext plan needs kept alive."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from opdispatch.backends.cuda.devices import facts
from opdispatch.backends.cuda.kernels import launch_specs
from opdispatch.hookspecs import Launch
from opdispatch.tensor import Tensor

from . import fusion
from .specs.flash import FlashPlan, flash_plan
from .specs.rope import rope_qkv_specs, rope_set_rows_specs, rope_specs
from .specs.softmax import softmax_specs

if TYPE_CHECKING:
    from opdispatch.backends.cuda.backend import CudaContext


def bind_soft_max(ctx: CudaContext, node: Tensor) -> Launch:
    return launch_specs(ctx.stream, softmax_specs(node, ctx.ptr))


def bind_rope(ctx: CudaContext, node: Tensor) -> Launch:
    return launch_specs(ctx.stream, rope_specs(node, ctx.ptr, facts(ctx.device)))


def bind_rope_set_rows(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    return launch_specs(ctx.stream, rope_set_rows_specs(*fusion.parts(nodes), ctx.ptr, ctx.index_check,
                                                        facts(ctx.device)))


def bind_rope_qkv_set_rows(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    return launch_specs(ctx.stream, rope_qkv_specs(*fusion.qkv_parts(nodes), ctx.ptr, ctx.index_check,
                                                   facts(ctx.device)))


def bind_flash_attn_ext(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind_flash(ctx, flash_plan(node, facts(ctx.device), shared=ctx.shared))


def bind_qkv_flash_attn_ext(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    return _bind_flash(ctx, flash_plan(nodes[-1], facts(ctx.device), fusion.fused_qkv(nodes)))


def _bind_flash(ctx: CudaContext, plan: FlashPlan) -> Launch:
    bufs = ctx.backend.scratch.take_all(plan.workspaces)
    return launch_specs(ctx.stream, plan.specs(ctx.ptr, [buf.ptr for buf in bufs], ctx.index_check), bufs)
