"""kernels/mmv.cu's and mmv_id.cu's launches (mat-vecs, quantize_q8_1, the MoE routing) and the choice, per node, between
them and mmvq_stream: argument records and pure spec functions of shapes, strides and addresses.

A block-format node whose path is mmvq_stream still gets the two-launch mmvq when the device
addresses do not suit the stream kernel (stream.stream_addresses) or its shared memory does not fit.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.args import NAN_ROW, UNCHECKED, Guard, IndexCheck, KernelArgs, f32, i32, i64, ptr
from opdispatch.backends.cuda.kernels import GLU_CODES, KernelSpec
from opdispatch.hookspecs import Device
from opdispatch.tensor import Tensor

from .. import fusion, support
from . import (BLOCK, EPI_BIAS, EPI_GLU, EPI_NONE, MMV_CU, MMV_ID_CU, QROWS, QUANT_BLOCK, QWARPS_MAX, ROUTE_BLOCK,
               ROUTE_NAME, ROWS, MatvecHead, Ptr, Scratch, StreamConfig, addr, elem_stride, geometry, grouped_name, grouped_nts,
               mmv_id_name, mmv_name, mmvq_id_name, mmvq_name, nt_for, qgrouped_name, quant_nts, quantize_name)
from .stream import StreamArgs, stream_addresses, stream_spec


@attrs.frozen
class QuantizeArgs(KernelArgs):
    KERNELS = ("quantize_q8_1",)
    b: np.uint64 = ptr()
    es: np.int64 = i64()
    s1: np.int64 = i64()
    s2: np.int64 = i64()
    s3: np.int64 = i64()
    n1: np.int32 = i32()
    n2: np.int32 = i32()
    K: np.int32 = i32()
    nbp: np.int32 = i32()
    bq: np.uint64 = ptr()
    bds: np.uint64 = ptr()
    nw: np.uint64 = ptr()
    eps: np.float32 = f32()


@attrs.frozen
class MmvArgs(KernelArgs):
    KERNELS = ("mmv",)
    _head: MatvecHead = attrs.field()
    preload: np.int32 = i32()


@attrs.frozen
class MmvqArgs(KernelArgs):
    KERNELS = ("mmvq",)
    a0: np.uint64 = ptr()
    a1: np.uint64 = ptr()
    a_row: np.int64 = i64()
    a_s2: np.int64 = i64()
    a_s3: np.int64 = i64()
    r2: np.int32 = i32()
    r3: np.int32 = i32()
    bq: np.uint64 = ptr()
    bds: np.uint64 = ptr()
    nbp: np.int32 = i32()
    out: np.uint64 = ptr()
    M: np.int32 = i32()
    K: np.int32 = i32()
    N: np.int32 = i32()
    bias0: np.uint64 = ptr()
    bias1: np.uint64 = ptr()
    bias_col: np.int64 = i64()
    glu_kind: np.int32 = i32()
    alpha: np.float32 = f32()
    limit: np.float32 = f32()


@attrs.frozen
class MmvIdArgs(KernelArgs):
    KERNELS = ("mmv_id",)
    as0: np.uint64 = ptr()
    as1: np.uint64 = ptr()
    a_row: np.int64 = i64()
    a_e: np.int64 = i64()
    E: np.int32 = i32()
    ids: np.uint64 = ptr()
    ids_t: np.int64 = i64()
    ids_u: np.int64 = i64()
    b: np.uint64 = ptr()
    b_t: np.int64 = i64()
    b_u: np.int64 = i64()
    Ub: np.int32 = i32()
    b_es: np.int64 = i64()
    out: np.uint64 = ptr()
    M: np.int32 = i32()
    K: np.int32 = i32()
    bias0: np.uint64 = ptr()
    bias1: np.uint64 = ptr()
    bias_e: np.int64 = i64()
    glu_kind: np.int32 = i32()
    alpha: np.float32 = f32()
    limit: np.float32 = f32()
    err_: IndexCheck


@attrs.frozen
class MmvqIdArgs(KernelArgs):
    KERNELS = ("mmvq_id",)
    as0: np.uint64 = ptr()
    as1: np.uint64 = ptr()
    a_row: np.int64 = i64()
    a_e: np.int64 = i64()
    E: np.int32 = i32()
    ids: np.uint64 = ptr()
    ids_t: np.int64 = i64()
    ids_u: np.int64 = i64()
    bq: np.uint64 = ptr()
    bds: np.uint64 = ptr()
    nbp: np.int32 = i32()
    Ub: np.int32 = i32()
    out: np.uint64 = ptr()
    M: np.int32 = i32()
    K: np.int32 = i32()
    bias0: np.uint64 = ptr()
    bias1: np.uint64 = ptr()
    bias_e: np.int64 = i64()
    glu_kind: np.int32 = i32()
    alpha: np.float32 = f32()
    limit: np.float32 = f32()
    err_: IndexCheck


@attrs.frozen
class RouteArgs(KernelArgs):
    KERNELS = ("moe_route",)
    ids: np.uint64 = ptr()
    ids_t: np.int64 = i64()
    ids_u: np.int64 = i64()
    T: np.int32 = i32()
    U: np.int32 = i32()
    E: np.int32 = i32()
    route: np.uint64 = ptr()
    out: np.uint64 = ptr()
    M: np.int32 = i32()
    tile_n: np.int32 = i32()
    err_: IndexCheck


@attrs.frozen
class GroupedArgs(KernelArgs):
    KERNELS = ("mmv_id_grouped",)
    as_: np.uint64 = ptr()
    a_row: np.int64 = i64()
    a_e: np.int64 = i64()
    E: np.int32 = i32()
    route: np.uint64 = ptr()
    b: np.uint64 = ptr()
    b_t: np.int64 = i64()
    b_u: np.int64 = i64()
    Ub: np.int32 = i32()
    b_es: np.int64 = i64()
    out: np.uint64 = ptr()
    M: np.int32 = i32()
    K: np.int32 = i32()
    U: np.int32 = i32()
    bias: np.uint64 = ptr()
    bias_e: np.int64 = i64()


@attrs.frozen
class QGroupedArgs(KernelArgs):
    KERNELS = ("mmvq_id_grouped",)
    as_: np.uint64 = ptr()
    a_row: np.int64 = i64()
    a_e: np.int64 = i64()
    E: np.int32 = i32()
    route: np.uint64 = ptr()
    bq: np.uint64 = ptr()
    bds: np.uint64 = ptr()
    nbp: np.int32 = i32()
    Ub: np.int32 = i32()
    out: np.uint64 = ptr()
    M: np.int32 = i32()
    K: np.int32 = i32()
    U: np.int32 = i32()
    bias: np.uint64 = ptr()
    bias_e: np.int64 = i64()


def q_threads(k: int) -> int:
    """Threads of a block-format mat-vec block: a warp per 32 quant blocks of a row, 1 to QWARPS_MAX."""
    return 32 * min(QWARPS_MAX, max(1, math.ceil(k // 32 / 32)))


def q8_padded(k: int) -> int:
    """Blocks of 32 a quantized b row holds (quantize_q8_1's nbp): k / 32 rounded up to 32."""
    return math.ceil(k // 32 / 32) * 32


def quantize_spec(b: Tensor, pb: int, scratch: Scratch, nw: int = 0, eps: float = 0.0) -> KernelSpec:
    """quantize_q8_1 of b's rows (row (i3 * n2 + i2) * n1 + i1 of b's padded (n3, n2, n1, K)
    geometry) into the scratch buffer "bq": codes at `args.bq`, scales at `args.bds`, `args.nbp`
    blocks a row. `nw` not 0 (a fused norm's weight address, b its x): the rows of rms_norm(b) * w instead."""
    (n3, n2, n1, k), (s3, s2, s1, _) = geometry(b)
    rows, nbp = n1 * n2 * n3, q8_padded(k)
    bq = scratch("bq", rows * nbp * (32 + 8))
    args = QuantizeArgs(b=pb, es=elem_stride(b), s1=s1, s2=s2, s3=s3, n1=max(n1, 1), n2=max(n2, 1), K=k, nbp=nbp,
                        bq=bq, bds=bq + rows * nbp * 32, nw=nw, eps=eps)
    return KernelSpec(MMV_CU, quantize_name(b.dtype.name, nw != 0),
                      (max(rows, 1), max(1, math.ceil(k // 32 / 8))), QUANT_BLOCK, args)


def _aligned(p: int, strides_sizes: Sequence[tuple[int, int]], to: int = 16) -> bool:
    """p and every stride of an axis longer than 1 are multiples of `to`."""
    return p % to == 0 and all(s % to == 0 for s, n in strides_sizes if n > 1)


def _b_vec(b: Tensor, pb: int) -> bool:
    """b's rows are packed and every row starts 16-byte aligned (K % 4 == 0 is the caller's)."""
    (n3, n2, n1, k), (s3, s2, s1, s0) = geometry(b)
    return (k == 1 or s0 == b.dtype.block_bytes) and _aligned(pb, ((s1, n1), (s2, n2), (s3, n3)))


def _a_vec(a: Tensor, pa: int) -> bool:
    """Float rows of a read with 16-byte loads: K % 8 == 0, rows and batches 16-byte aligned."""
    (n3, n2, m, k), (s3, s2, s1, _) = geometry(a)
    return k % 8 == 0 and _aligned(pa, ((s1, m), (s2, n2), (s3, n3)))


def _epilogue(ptr: Ptr, glu: Tensor | None, bias0: Tensor | None, bias1: Tensor | None) -> tuple[str, dict[str, Any]]:
    """The epilogue's name and its arguments (biases, GLU kind and params), as every mat-vec takes them."""
    if glu is not None:
        epi, kind, alpha, limit = EPI_GLU, GLU_CODES[glu.params["kind"]], glu.params["alpha"], glu.params["limit"]
    else:
        epi, kind, alpha, limit = (EPI_BIAS if bias0 is not None else EPI_NONE), 0, 0.0, 0.0
    return epi, dict(bias0=addr(ptr, bias0), bias1=addr(ptr, bias1), glu_kind=kind, alpha=alpha, limit=limit)


def _preload(*weights: Tensor | None) -> int:
    """mmv's and mmvq_stream's `preload` argument: 1 where the weights (and mul_mat_id's ids, which
    pick them) are constant (params), so the kernel loads its first weights before waiting for the
    kernel ahead (programmatic dependent launch)."""
    return int(all(t is None or t.is_constant for t in weights))


def mmv_specs(node: Tensor, out: Tensor, ptr: Ptr, scratch: Scratch, *, a1: Tensor | None = None,
              bias0: Tensor | None = None, bias1: Tensor | None = None, bias_col: int = 0, glu: Tensor | None = None,
              norm: fusion.Norm | None = None, device: Device | None = None, stream: StreamConfig | None = None
              ) -> list[KernelSpec]:
    """mmv (float weights), mmvq_stream or mmvq (block formats) for mul_mat `node` writing `out`
    (node itself, or the last node of a fused group) on `device` (None: an H200's description); the
    biases' rows bias_col floats apart (0: one row, fusion.bias_col); `norm`: b is rms_norm(norm.x) *
    norm.w, which mmvq_stream computes itself from x (ValueError should it not take the product), and writes to
    norm.out too when the group keeps it.

    mmvq_stream where support.choose picks it (and a1, for a fused GLU, is aligned as a is), with
    `stream` (default STREAM) as its configuration; mmvq, quantize_q8_1 first, else."""
    a = node.srcs[0]
    b = node.srcs[1] if norm is None else norm.x
    (a3, a2, m, k), (sa3, sa2, sa1, _) = geometry(a)
    (b3, b2, n, _), (sb3, sb2, sb1, _) = geometry(b)
    pa, pb, tb = ptr(a), ptr(b), b.dtype.name
    epi, tail = _epilogue(ptr, glu, bias0, bias1)
    tail["bias_col"] = bias_col
    rows = dict(a0=pa, a1=addr(ptr, a1), a_row=sa1, a_s2=sa2, a_s3=sa3, r2=b2 // a2, r3=b3 // a3)
    cols = dict(b=pb, b_col=sb1, b_es=elem_stride(b), b_s2=sb2, b_s3=sb3)
    sizes = dict(out=ptr(out), M=m, K=k, N=n)
    prologue = (dict(norm_w=0, norm_eps=0.0, norm_out=0) if norm is None else
                dict(norm_w=ptr(norm.w), norm_eps=norm.eps, norm_out=addr(ptr, norm.out)))
    if (a.dtype.is_quant and support.choose(node, device).path == "mmvq_stream"
            and stream_addresses(ptr, a, a1) and prologue["norm_w"] % 16 == 0):
        args = StreamArgs(head=MatvecHead(**rows, **cols, **sizes, **tail), ids=0, ids_t=0, ids_u=0, E=0, bias_e=0,
                          **prologue, preload=_preload(a, a1), grid_copies=1, err_=UNCHECKED)
        spec = stream_spec(node, args, epi, device, stream)
        if spec is not None:
            return [spec]
    if norm is not None:
        raise ValueError(f"the rms_norm before {node.describe()} fuses into mmvq_stream only, which does not take "
                         "it here (weights or norm weight not 16-byte aligned, or its shared memory does not fit)")
    if a.dtype.is_quant:
        quant = quantize_spec(b, pb, scratch)
        q = quant.args
        per_block = QROWS // (2 if epi == EPI_GLU else 1)
        grid = (math.ceil(m / per_block) if n else 0, b2, b3)
        nt = nt_for(max(n, 1), quant_nts(a.dtype.name))
        return [quant, KernelSpec(MMV_CU, mmvq_name(a.dtype.name, nt, epi), grid, q_threads(k),
                                  MmvqArgs(**rows, bq=q.bq, bds=q.bds, nbp=q.nbp, **sizes, **tail))]
    vec = (k % 4 == 0 and _b_vec(b, pb) and _a_vec(a, pa) and (a1 is None or ptr(a1) % 16 == 0))
    nt = nt_for(max(n, 1)) if vec and tb == "f32" else 8
    grid = (math.ceil(m / ROWS) if n else 0, b2, b3)
    return [KernelSpec(MMV_CU, mmv_name(a.dtype.name, tb, nt, vec, epi), grid, BLOCK,
                       MmvArgs(head=MatvecHead(**rows, **cols, **sizes, **tail), preload=_preload(a, a1)))]


def _id_b(node: Tensor, ptr: Ptr) -> tuple[int, int, int, int, bool]:
    """mul_mat_id's b as the kernels read it: (address, token stride, slot stride, element
    stride, 16-byte loads for float experts)."""
    as_, b, _ = node.srcs
    vec = b.shape[-1] % 4 == 0 and _b_vec(b, ptr(b)) and _a_vec(as_, ptr(as_))
    return ptr(b), b.strides[0], b.strides[1], elem_stride(b), vec


def mmv_id_specs(node: Tensor, out: Tensor, ptr: Ptr, scratch: Scratch, guard: Guard, *, a1: Tensor | None = None,
                 bias0: Tensor | None = None, bias1: Tensor | None = None, glu: Tensor | None = None,
                 device: Device | None = None, stream: StreamConfig | None = None) -> list[KernelSpec]:
    """mmvq_stream, mmv_id or mmvq_id for mul_mat_id `node` (a grid z index a token) writing `out`:
    mmvq_stream (configuration `stream`, default STREAM) for block formats where
    support.stream_ok allows (and a1 is aligned as the experts are), mmvq_id, quantize_q8_1
    first, for the others. The expert ids are checked by `guard`'s IndexCheck."""
    as_, b, ids = node.srcs
    e, m, k = as_.shape
    t, ub, _ = b.shape
    u = ids.shape[1]
    pb, b_t, b_u, b_es, vec = _id_b(node, ptr)
    vec = vec and (a1 is None or ptr(a1) % 16 == 0)
    epi, tail = _epilogue(ptr, glu, bias0, bias1)
    bias_e = bias0.strides[0] if bias0 is not None else 0
    picks = dict(ids=ptr(ids), ids_t=ids.strides[0], ids_u=ids.strides[1])
    check = guard(node, ids, e, experts_of(as_), NAN_ROW)
    if as_.dtype.is_quant and support.stream_ok(node, device) is True and stream_addresses(ptr, as_, a1):
        head = MatvecHead(a0=ptr(as_), a1=addr(ptr, a1), a_row=as_.strides[1], a_s2=as_.strides[0], a_s3=0, r2=1,
                          r3=1, b=pb, b_col=0, b_es=b_es, b_s2=b_u if ub > 1 else 0, b_s3=b_t, out=ptr(out), M=m,
                          K=k, N=1, bias_col=0, **tail)
        args = StreamArgs(head=head, **picks, E=e, bias_e=bias_e // 4, norm_w=0, norm_eps=0.0, norm_out=0,
                          preload=_preload(as_, a1, ids), grid_copies=1, err_=check)
        spec = stream_spec(node, args, epi, device, stream)
        if spec is not None:
            return [spec]
    experts = dict(as0=ptr(as_), as1=addr(ptr, a1), a_row=as_.strides[1], a_e=as_.strides[0], E=e, **picks)
    sizes = dict(out=ptr(out), M=m, K=k)
    if as_.dtype.is_quant:
        quant = quantize_spec(b, pb, scratch)
        q = quant.args
        grid = (math.ceil(m / (QROWS // (2 if epi == EPI_GLU else 1))), u, t)
        return [quant, KernelSpec(MMV_ID_CU, mmvq_id_name(as_.dtype.name, epi), grid, q_threads(k),
                                  MmvqIdArgs(**experts, bq=q.bq, bds=q.bds, nbp=q.nbp, Ub=ub, **sizes,
                                             bias_e=bias_e, **tail, err_=check))]
    return [KernelSpec(MMV_ID_CU, mmv_id_name(as_.dtype.name, "f32", vec, epi), (math.ceil(m / ROWS), u, t), BLOCK,
                       MmvIdArgs(**experts, b=pb, b_t=b_t, b_u=b_u, Ub=ub, b_es=b_es, **sizes, bias_e=bias_e,
                                 **tail, err_=check))]


def experts_of(as_: Tensor) -> str:
    """What a mul_mat_id's expert id picks, for the error a bad one raises."""
    return f"an expert of {as_.describe()}"


def route_words(n_experts: int, pairs: int, tiles: int = 0) -> int:
    """int32 words of moe_route's table, with room for `tiles` column tiles (mmq_id's) if any."""
    return 1 + 3 * n_experts + pairs + (1 + 3 * tiles if tiles else 0)


def route_spec(node: Tensor, out: Tensor, ptr: Ptr, scratch: Scratch, guard: Guard, tile_n: int = 0,
               tiles: int = 0) -> KernelSpec:
    """moe_route for mul_mat_id `node` writing `out`'s NaN rows (checking the expert ids by `guard`'s
    IndexCheck) into the scratch buffer "route"; with tile_n > 0 its table also cuts each expert's pairs
    in column tiles of tile_n, room for `tiles` of them (mmq_id)."""
    as_, b, ids = node.srcs
    e, m, _ = as_.shape
    t, u = ids.shape
    route = scratch("route", 4 * route_words(e, t * u, tiles))
    args = RouteArgs(ids=ptr(ids), ids_t=ids.strides[0], ids_u=ids.strides[1], T=t, U=u, E=e, route=route,
                     out=ptr(out), M=m, tile_n=tile_n, err_=guard(node, ids, e, experts_of(as_), NAN_ROW))
    return KernelSpec(MMV_ID_CU, ROUTE_NAME, (1,), ROUTE_BLOCK, args, smem=2 * 4 * e)


def grouped_specs(node: Tensor, out: Tensor, ptr: Ptr, scratch: Scratch, guard: Guard, *,
                  bias: Tensor | None = None) -> list[KernelSpec]:
    """moe_route (checking the expert ids by `guard`'s IndexCheck), then mmv_id_grouped / mmvq_id_grouped
    for mul_mat_id `node`."""
    as_, b, ids = node.srcs
    e, m, k = as_.shape
    t, ub, _ = b.shape
    u = ids.shape[1]
    pairs = t * u
    specs = [route_spec(node, out, ptr, scratch, guard)]
    route = int(specs[0].args.route)
    pb, b_t, b_u, b_es, vec = _id_b(node, ptr)
    quant = as_.dtype.is_quant
    nt = nt_for(min(support.MMV_MAX_N, max(1, math.ceil(pairs / min(e, pairs)))), grouped_nts(as_.dtype.name))
    nt = nt if vec or quant else 8
    epi = EPI_BIAS if bias is not None else EPI_NONE
    experts = dict(as_=ptr(as_), a_row=as_.strides[1], a_e=as_.strides[0], E=e, route=route)
    rest = dict(out=ptr(out), M=m, K=k, U=u, bias=addr(ptr, bias), bias_e=bias.strides[0] if bias is not None else 0)
    if quant:
        qspec = quantize_spec(b, pb, scratch)
        q = qspec.args
        specs += [qspec, KernelSpec(MMV_ID_CU, qgrouped_name(as_.dtype.name, nt, epi),
                                    (math.ceil(m / QROWS), min(e, pairs)), q_threads(k),
                                    QGroupedArgs(**experts, bq=q.bq, bds=q.bds, nbp=q.nbp, Ub=ub, **rest))]
    else:
        specs.append(KernelSpec(MMV_ID_CU, grouped_name(as_.dtype.name, "f32", nt, vec, epi),
                                (math.ceil(m / ROWS), min(e, pairs)), BLOCK,
                                GroupedArgs(**experts, b=pb, b_t=b_t, b_u=b_u, Ub=ub, b_es=b_es, **rest)))
    return specs


def fused_specs(nodes: Sequence[Tensor], ptr: Ptr, scratch: Scratch, guard: Guard, device: Device | None = None,
                share: bool = False) -> list[KernelSpec]:
    """Any group of fusion.PATTERNS: the mat-vec launch (mmvq_stream, or quantize_q8_1 then mmvq,
    for block formats) that writes the last node (`share`: the fusion.SHARE group's, which writes the normed
    values too); a mul_mat_id's expert ids checked by `guard`."""
    prods, biases, glu = fusion.parts(nodes)
    out, first = nodes[-1], prods[0]
    if first.op == "mul_mat_id" and glu is None and first.shape[0] > 1:
        return grouped_specs(first, out, ptr, scratch, guard, bias=biases[0])
    if first.op == "mul_mat":
        make = functools.partial(mmv_specs, bias_col=fusion.bias_col(first, biases[0]), norm=fusion.norm_of(nodes, share),
                                 device=device)
    else:
        make = functools.partial(mmv_id_specs, guard=guard, device=device)
    if glu is None:
        return make(first, out, ptr, scratch, bias0=biases[0])
    return make(first, out, ptr, scratch, a1=prods[1].srcs[0], bias0=biases[0], bias1=biases[1], glu=glu)
