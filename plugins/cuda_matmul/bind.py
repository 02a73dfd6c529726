"""cuda_matmul's binds: specs (specs/) to pre-bound launches, and the Kernel records' paths.

The only module that touches a `CudaContext`: each bind computes its specs once, with the
backend's scratch buffers (`ScratchPool`, by role) kept alive with the launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from opdispatch.backends.cuda import cublas
from opdispatch.backends.cuda.kernels import EMPTY, KernelSpec, chain
from opdispatch.backends.cuda.scratch import Workspace
from opdispatch.hookspecs import Device, Launch
from opdispatch.tensor import Tensor

from . import fusion, support
from .specs import Ptr, Scratch
from .specs.gemm import GemmSpec, Spec, gemm_specs, glu_conversion, norm_conversion, out_prod_specs
from .specs.mmf import addresses_ok, mmf_fused_specs, mmf_specs
from .specs.mmq import mmq_addresses, mmq_specs
from .specs.mmq_id import mmq_id_specs
from .specs.mmq_small import pair_ok as small_pair_ok
from .specs.mmq_small import small_specs
from .specs.mmq_wgmma import b_bytes as wgmma_b_bytes
from .specs.mmq_wgmma import wgmma_id_specs, wgmma_specs
from .specs.mmv import fused_specs, grouped_specs, mmv_id_specs, mmv_specs, quantize_spec

if TYPE_CHECKING:
    from opdispatch.backends.cuda.backend import CudaContext


def scratch_for(ctx: CudaContext, kept: list) -> Scratch:
    """scratch(role, nbytes, zeroed=False) for one bind: the backend's scratch buffer of that role
    (`ScratchPool`); every buffer handed out is appended to `kept`."""

    def get(role: str, nbytes: int, zeroed: bool = False) -> int:
        buf = ctx.backend.scratch.take(Workspace(nbytes, f"cuda_matmul {role}", zeroed))
        kept.append(buf)
        return buf.ptr

    return get


def _gemm_launch(ctx: CudaContext, g: GemmSpec) -> Launch:
    h = cublas.for_backend(ctx.backend)
    at, bt = cublas.DATA_TYPES[g.a_type], cublas.DATA_TYPES[g.b_type]
    ct = cublas.CUDA_R_32F
    if g.kind in ("gemm", "strided"):
        return h.matmul(g.transa, g.transb, g.m, g.n, g.k, g.a, at, g.lda, g.b, bt, g.ldb, g.c, ct, g.ldc, g.strides,
                        g.batch, beta=1.0 if g.addend else 0.0, c_in=g.addend)
    pa, pb, pc = zip(*g.ptrs)
    return h.gemm_batched(g.transa, g.transb, g.m, g.n, g.k, pa, at, g.lda, pb, bt, g.ldb, pc, ct, g.ldc)


def _realize(ctx: CudaContext, specs: Sequence[Spec], kept: Sequence[Any] = ()) -> Launch:
    with ctx.backend.cuda_device:
        parts = [(s.launch(ctx.stream) if isinstance(s, KernelSpec) else _gemm_launch(ctx, s)) for s in specs]
    return chain(parts, kept)


def _bind(ctx: CudaContext, node: Tensor, make: Callable[[Scratch], list]) -> Launch:
    """Specs from `make(scratch)` (with this bind's scratch buffers kept alive) as one launch."""
    if node.size == 0:
        return EMPTY
    kept: list = []
    return _realize(ctx, make(scratch_for(ctx, kept)), kept)


def bind_mmv(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind(ctx, node, lambda scratch: mmv_specs(node, node, ctx.ptr, scratch, device=ctx.device))


def bind_mmf(ctx: CudaContext, node: Tensor) -> Launch:
    """mmf, or cuBLAS should the weights' address not be 16-byte aligned (an arena aligns to 256 bytes)."""
    if not addresses_ok(ctx.ptr, node.srcs[0], None):
        return bind_gemm(ctx, node)
    return _bind(ctx, node, lambda scratch: mmf_specs(node, node, ctx.ptr, scratch, device=ctx.device))


def bind_gemm(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind(ctx, node, lambda scratch: gemm_specs(node, ctx.ptr, scratch))


def bind_mmq(ctx: CudaContext, node: Tensor) -> Launch:
    """mmq; dequant_cublas should an arena place the weights off a 16-byte boundary."""
    if mmq_addresses(ctx.ptr, node.srcs[0]):
        return _bind(ctx, node, lambda scratch: mmq_specs(node, ctx.ptr, scratch))
    return bind_gemm(ctx, node)


def bind_mmq_small(ctx: CudaContext, node: Tensor) -> Launch:
    """mmq_small; dequant_cublas should an arena place the weights off a 16-byte boundary."""
    if mmq_addresses(ctx.ptr, node.srcs[0]):
        return _bind(ctx, node, lambda scratch: small_specs(node, ctx.ptr, scratch, ctx.device))
    return bind_gemm(ctx, node)


def bind_mmq_wgmma(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind(ctx, node, lambda scratch: wgmma_specs(node, ctx.ptr, scratch, ctx.device))


def bind_out_prod(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind(ctx, node, lambda scratch: out_prod_specs(node, ctx.ptr, scratch))


def bind_mmv_id(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind(ctx, node, lambda scratch: mmv_id_specs(node, node, ctx.ptr, scratch, ctx.index_check,
                                                         device=ctx.device))


def bind_mmv_id_grouped(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind(ctx, node, lambda scratch: grouped_specs(node, node, ctx.ptr, scratch, ctx.index_check))


def bind_mmq_id(ctx: CudaContext, node: Tensor) -> Launch:
    """mmq_id; mmv_id_grouped should an arena place the experts off a 16-byte boundary."""
    if mmq_addresses(ctx.ptr, node.srcs[0]):
        return _bind(ctx, node, lambda scratch: mmq_id_specs(node, node, ctx.ptr, scratch, ctx.index_check))
    return bind_mmv_id_grouped(ctx, node)


def bind_mmq_wgmma_id(ctx: CudaContext, node: Tensor) -> Launch:
    """mmq_wgmma_id; mmv_id_grouped should an arena place the experts off a 16-byte boundary."""
    if mmq_addresses(ctx.ptr, node.srcs[0]):
        return _bind(ctx, node, lambda scratch: wgmma_id_specs(node, node, ctx.ptr, scratch, ctx.index_check))
    return bind_mmv_id_grouped(ctx, node)


def bind_fused_share(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    """The SHARE rule's group: the mat-vec with the norm, writing the normed values too."""
    return _bind(ctx, nodes[-1], lambda scratch: fused_specs(nodes, ctx.ptr, scratch, ctx.index_check, ctx.device,
                                                             share=True))


def bind_fused(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    path = support.choose(fusion.parts(nodes)[0][0], ctx.device).path
    if path == "mmf":
        return _bind(ctx, nodes[-1], lambda scratch: mmf_fused_specs(nodes, ctx.ptr, scratch, ctx.device))
    if path in fusion.GEMM_PATHS:  # mul_mat -> add (a bias or a residual), or the rms_norm before one or two
        return _bind(ctx, nodes[-1], lambda scratch: gemm_fused_specs(nodes, ctx.ptr, scratch, ctx.device))
    if path in fusion.B16_PATHS:  # the same, or a glu before one, on the GEMMs of 16-bit b
        return _bind(ctx, nodes[-1], lambda scratch: b16_fused_specs(nodes, ctx.ptr, scratch, ctx.device))
    if path in fusion.ID_GEMM_PATHS and mmq_addresses(ctx.ptr, nodes[0].srcs[0]):  # mul_mat_id -> add_id
        bias = fusion.parts(nodes)[1][0]
        specs = mmq_id_specs if path == "mmq_id" else wgmma_id_specs
        return _bind(ctx, nodes[-1], lambda scratch: specs(nodes[0], nodes[-1], ctx.ptr, scratch, ctx.index_check,
                                                           bias=bias))
    return _bind(ctx, nodes[-1], lambda scratch: fused_specs(nodes, ctx.ptr, scratch, ctx.index_check, ctx.device))


def gemm_fused_specs(nodes: Sequence[Tensor], ptr: Ptr, scratch: Scratch, device: Device | None
                     ) -> list[KernelSpec]:
    """The launches of the quantized GEMMs (mmq or mmq_small, each product's path) for a group on `device`: a
    mul_mat_add writing its add, or the rms_norm before one or two products (rms_norm_mul_mat, PAIR), whose
    quantize_q8_1 launch rounds the normed values once for both (and where both take mmq_small and pair, one
    mmq_small launch runs both: specs/mmq_small.pair_ok). Raises ValueError when the weights are not
    16-byte aligned (the unfused mul_mat falls back to dequant_cublas then; an arena aligns every tensor to 256
    bytes)."""
    prods, biases, _ = fusion.parts(nodes)
    norm = fusion.norm_of(nodes)
    quant = None if norm is None else quantize_spec(norm.x, ptr(norm.x), scratch, ptr(norm.w), norm.eps)
    specs = [] if quant is None else [quant]
    paths = [support.choose(prod, device).path for prod in prods]
    for prod, path in zip(prods, paths):
        if not mmq_addresses(ptr, prod.srcs[0]):
            raise ValueError(f"{path}: the weights of {prod.describe()} are not 16-byte aligned")
    if (len(prods) == 2 and paths == ["mmq_small"] * 2 and biases == [None, None]
            and small_pair_ok(prods[0], prods[1]) is True):  # a pair takes no bias
        return specs + small_specs(prods[0], ptr, scratch, device, out=prods[0], quant=quant, second=prods[1])
    for prod, bias, path in zip(prods, biases, paths):
        epi = dict(out=nodes[-1] if len(prods) == 1 else prod, bias=bias, bias_col=fusion.bias_col(prod, bias),
                   quant=quant)
        specs += mmq_specs(prod, ptr, scratch, **epi) if path == "mmq" else small_specs(prod, ptr, scratch, device,
                                                                                         **epi)
    return specs


def b16_fused_specs(nodes: Sequence[Tensor], ptr: Ptr, scratch: Scratch, device: Device | None) -> list[Spec]:
    """The launches of a group whose products take fusion.B16_PATHS (cuBLAS, mmq_wgmma) on `device`: a fused
    rms_norm (before one or two products) or glu (before one) written as the products' 16-bit b by one conversion
    (convert_norm, convert_glu), then each product reading it; a mul_mat_add's addend added by the product (cuBLAS'
    C, mmq_wgmma's bias), which writes the add."""
    prods, biases, _ = fusion.parts(nodes)
    paths = [support.choose(prod, device).path for prod in prods]
    norm, glu = fusion.norm_of(nodes), fusion.glu_in_of(nodes)
    specs: list[Spec] = []
    b16 = None
    if norm is not None or glu is not None:
        td = fusion.b_form(prods[0], paths[0])
        n, k = prods[0].srcs[1].shape[-2:]
        b16 = scratch("b", wgmma_b_bytes(n, k))
        specs.append(norm_conversion(norm.x, norm.w, norm.eps, td, ptr, b16) if norm is not None
                     else glu_conversion(glu, td, ptr, b16))
    for prod, bias, path in zip(prods, biases, paths):
        out = nodes[-1] if len(prods) == 1 else prod
        if path == "mmq_wgmma":
            specs += wgmma_specs(prod, ptr, scratch, device, out=out, b16=b16, bias=bias,
                                 bias_col=fusion.bias_col(prod, bias))
        else:
            specs += gemm_specs(prod, ptr, scratch, out=out, b16=b16, addend=bias)
    return specs


#: (op, path name, bind) of every Kernel record, in the order they are asked
PATHS: tuple[tuple[str, str, Callable], ...] = (
    ("mul_mat", "mmvf", bind_mmv),
    ("mul_mat", "mmvq_stream", bind_mmv),
    ("mul_mat", "mmvq", bind_mmv),
    ("mul_mat", "mmq_small", bind_mmq_small),
    ("mul_mat", "mmq", bind_mmq),
    ("mul_mat", "mmq_wgmma", bind_mmq_wgmma),
    ("mul_mat", "mmf", bind_mmf),
    ("mul_mat", "cublas", bind_gemm),
    ("mul_mat", "dequant_cublas", bind_gemm),
    ("mul_mat_id", "mmv_id", bind_mmv_id),
    ("mul_mat_id", "mmq_id", bind_mmq_id),
    ("mul_mat_id", "mmq_wgmma_id", bind_mmq_wgmma_id),
    ("mul_mat_id", "mmv_id_grouped", bind_mmv_id_grouped),
    ("out_prod", "cublas_out_prod", bind_out_prod),
)
