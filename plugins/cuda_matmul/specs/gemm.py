"""The GEMM paths' specs: kernels/convert.cu's conversions (its argument records) and the cuBLAS calls,
kept as `GemmSpec` records (column-major arguments, batching) so that tests can run them in numpy.

cuBLAS is column-major and takes operands of one type, so each row-major operand is mapped to a
column-major matrix (or converted first), as the spec functions' docstrings show.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from opdispatch.backends.cuda.args import KernelArgs, Shape4, f32, i32, i64, ptr
from opdispatch.backends.cuda.cublas import CUBLAS_OP_N, CUBLAS_OP_T
from opdispatch.backends.cuda.kernels import GLU_CODES, KernelSpec
from opdispatch.tensor import Tensor

from . import (CONVERT_BLOCK, CONVERT_CU, CONVERT_GRID_MAX, Ptr, Scratch, convert_glu_name, convert_name,
               convert_norm_name, dequant_name, geometry)


@attrs.frozen
class ConvertArgs(KernelArgs):
    KERNELS = ("convert",)
    src: np.uint64 = ptr()
    _shape: Shape4 = attrs.field()  # src's dims and element strides
    dst: np.uint64 = ptr()


@attrs.frozen
class DequantArgs(KernelArgs):
    KERNELS = ("dequant",)
    src: np.uint64 = ptr()
    n0: np.int32 = i32()
    n1: np.int32 = i32()
    n2: np.int32 = i32()
    n3: np.int32 = i32()
    s1: np.int64 = i64()
    s2: np.int64 = i64()
    s3: np.int64 = i64()
    dst: np.uint64 = ptr()


@attrs.frozen
class ConvertNormArgs(KernelArgs):
    """convert_norm's arguments: x's rows (row stride s1 bytes, n0 values each, `rows` of them), the norm weight
    w and eps, the destination."""

    KERNELS = ("convert_norm",)
    x: np.uint64 = ptr()
    s1: np.int64 = i64()
    n0: np.int32 = i32()
    rows: np.int32 = i32()
    w: np.uint64 = ptr()
    eps: np.float32 = f32()
    dst: np.uint64 = ptr()


@attrs.frozen
class ConvertGluArgs(KernelArgs):
    """convert_glu's arguments: the gate and up values (n, contiguous f32 alike), the GLU kind's code and
    swiglu_oai's alpha and limit, the destination."""

    KERNELS = ("convert_glu",)
    g: np.uint64 = ptr()
    u: np.uint64 = ptr()
    n: np.int64 = i64()
    kind: np.int32 = i32()
    alpha: np.float32 = f32()
    limit: np.float32 = f32()
    dst: np.uint64 = ptr()


@attrs.frozen
class GemmSpec:
    """One cuBLAS call, column-major (see cublas.py): C (m x n) = op(A) (m x k) op(B) (k x n).

    kind "gemm" (batch 1), "strided" (operand i at ptr + i * stride elements)
    or "batched" (one address per batch in `ptrs`: (a, b, c) triples). A nonzero `addend` (kind "gemm" only) is
    the address of a matrix of C's layout added to the product (cublasLt's C, beta 1, where the result D is `c`):
    a fused mul_mat_add."""

    kind: str
    transa: int
    transb: int
    m: int
    n: int
    k: int
    a: int
    a_type: str
    lda: int
    b: int
    b_type: str
    ldb: int
    c: int
    ldc: int
    strides: tuple[int, int, int] = (0, 0, 0)
    batch: int = 1
    ptrs: tuple[tuple[int, int, int], ...] = ()
    addend: int = 0


Spec = KernelSpec | GemmSpec
ELEM = {"f32": 4, "f16": 2, "bf16": 2}


def conversion(src: Tensor, dst_type: str, src_ptr: int, dst: int) -> KernelSpec:
    """convert/dequant of `src` (rows on its last axis, at `src_ptr`) into a contiguous `dst_type`
    buffer at `dst`."""
    (n3, n2, n1, n0), (s3, s2, s1, s0) = geometry(src)
    grid = (max(1, min(n1 * n2 * n3, CONVERT_GRID_MAX)),)
    if src.dtype.is_quant:
        return KernelSpec(CONVERT_CU, dequant_name(src.dtype.name, dst_type), grid, CONVERT_BLOCK,
                          DequantArgs(src=src_ptr, n0=n0, n1=n1, n2=n2, n3=n3, s1=s1, s2=s2, s3=s3, dst=dst))
    return KernelSpec(CONVERT_CU, convert_name(src.dtype.name, dst_type), grid, CONVERT_BLOCK,
                      ConvertArgs(src=src_ptr, shape=Shape4(n0, n1, n2, n3, s0, s1, s2, s3), dst=dst))


def norm_conversion(x: Tensor, w: Tensor, eps: float, dst_type: str, ptr: Ptr, dst: int) -> KernelSpec:
    """convert_norm: rms_norm(x) * w (x f32 rows of one batch, w one contiguous f32 row) as contiguous `dst_type`
    rows at `dst`: the b of the products after a fused rms_norm -> mul."""
    (_, _, rows, n0), (_, _, s1, _) = geometry(x)
    return KernelSpec(CONVERT_CU, convert_norm_name(dst_type), (max(1, min(rows, CONVERT_GRID_MAX)),), CONVERT_BLOCK,
                      ConvertNormArgs(x=ptr(x), s1=s1, n0=n0, rows=rows, w=ptr(w), eps=eps, dst=dst))


def glu_conversion(glu: Tensor, dst_type: str, ptr: Ptr, dst: int) -> KernelSpec:
    """convert_glu: glu(gate, up) (two contiguous f32 sources alike) as contiguous `dst_type` values at `dst`: the
    b of the product after a fused glu."""
    g, u = glu.srcs
    n = glu.size
    vec = n % 4 == 0 and ptr(g) % 16 == 0 and ptr(u) % 16 == 0
    grid = max(1, min(math.ceil(n / ((4 if vec else 1) * CONVERT_BLOCK)), CONVERT_GRID_MAX))
    p = glu.params
    return KernelSpec(CONVERT_CU, convert_glu_name(dst_type, vec), (grid,), CONVERT_BLOCK,
                      ConvertGluArgs(g=ptr(g), u=ptr(u), n=n, kind=GLU_CODES[p["kind"]], alpha=p["alpha"],
                                     limit=p["limit"], dst=dst))


@attrs.frozen
class Operand:
    """A matrix operand of a batched GEMM: base address, per-batch byte strides (outer, inner),
    leading dimension (elements), transpose flag and element type."""

    ptr: int
    s3: int
    s2: int
    ld: int
    trans: int
    dtype: str


def batched(spec_args: dict, a: Operand, b: Operand, c: Operand, batches: tuple[int, int],
            ratios: tuple[int, int]) -> GemmSpec:
    """One GemmSpec over batches (B3, B2) with a repeat-interleaved by `ratios` (r3, r2):
    batch (i3, i2) reads a's (i3 // r3, i2 // r2). Strided when every operand's addresses
    step evenly over the flattened batches, else pointer arrays."""
    n3, n2 = batches
    r3, r2 = ratios
    trip = [(a.ptr + (i3 // r3) * a.s3 + (i2 // r2) * a.s2, b.ptr + i3 * b.s3 + i2 * b.s2, c.ptr + i3 * c.s3 + i2 * c.s2)
            for i3 in range(n3) for i2 in range(n2)]
    common = dict(transa=a.trans, transb=b.trans, a_type=a.dtype, lda=a.ld, b_type=b.dtype, ldb=b.ld, ldc=c.ld,
                  **spec_args)
    if len(trip) == 1:
        return GemmSpec("gemm", a=trip[0][0], b=trip[0][1], c=trip[0][2], **common)
    steps = [trip[1][j] - trip[0][j] for j in range(3)]
    even = all(trip[i][j] - trip[i - 1][j] == steps[j] for i in range(1, len(trip)) for j in range(3))
    sizes = (ELEM[a.dtype], ELEM[b.dtype], 4)
    if even and all(s >= 0 and s % z == 0 for s, z in zip(steps, sizes)):
        return GemmSpec("strided", a=trip[0][0], b=trip[0][1], c=trip[0][2],
                        strides=tuple(s // z for s, z in zip(steps, sizes)), batch=len(trip), **common)
    return GemmSpec("batched", a=trip[0][0], b=trip[0][1], c=trip[0][2], batch=len(trip), ptrs=tuple(trip), **common)


def compute_type(a: Tensor) -> str:
    """The type both GEMM operands take: f16 for block formats, else a's own."""
    return "f16" if a.dtype.is_quant else a.dtype.name


def gemm_specs(node: Tensor, ptr: Ptr, scratch: Scratch, *, out: Tensor | None = None, b16: int | None = None,
               addend: Tensor | None = None) -> list[Spec]:
    """cublas / dequant_cublas for mul_mat `node`; in a fused group (one batch), the result written to `out`
    (None: node), b already in the compute type at b16 (contiguous rows: a fused rms_norm or glu wrote them) and
    `addend` (contiguous, the product's shape) added by the GEMM itself.

    Row-major out (N, M) = b (N, K) @ a (M, K)^T, in cuBLAS' column-major terms:
    a's row-major (M, K) buffer (row stride lda >= K) read column-major is a
    K x M matrix A'; b's row-major (N, K) buffer (row stride ldb) read column-
    major is a K x N matrix B'; out's (N, M) buffer is a column-major M x N
    matrix C (ldc = M). C = A'^T B': gemm(transa=T, transb=N, m=M, n=N, k=K,
    A=a, lda, B=b, ldb, C=out, ldc=M). A b with its N axis packed instead (a
    transposed view) is a column-major N x K matrix (ld = its K stride) and
    goes in with transb=T; any other b layout is copied first.
    """
    a, b = node.srcs
    (a3, a2, m, k), (sa3, sa2, sa1, _) = geometry(a)
    (b3, b2, n, _), (sb3, sb2, sb1, sb0) = geometry(b)
    ct = compute_type(a)
    es = ELEM[ct]
    specs: list[Spec] = []
    if a.dtype.is_quant:
        dst = scratch("a", a3 * a2 * m * k * es)
        specs.append(conversion(a, ct, ptr(a), dst))
        a_op = Operand(dst, a2 * m * k * es, m * k * es, k, CUBLAS_OP_T, ct)
    else:
        a_op = Operand(ptr(a), sa3, sa2, sa1 // es if m > 1 else k, CUBLAS_OP_T, ct)
    b_elem = b.dtype.block_bytes
    if b16 is not None:
        b_op = Operand(b16, b2 * n * k * es, n * k * es, k, CUBLAS_OP_N, ct)
    elif b.dtype.name == ct and (k == 1 or sb0 == b_elem) and (n == 1 or sb1 >= k * b_elem):
        b_op = Operand(ptr(b), sb3, sb2, sb1 // b_elem if n > 1 else k, CUBLAS_OP_N, ct)
    elif b.dtype.name == ct and n > 1 and sb1 == b_elem and (k == 1 or sb0 >= n * b_elem):
        b_op = Operand(ptr(b), sb3, sb2, sb0 // b_elem if k > 1 else n, CUBLAS_OP_T, ct)
    else:
        dst = scratch("b", b3 * b2 * n * k * es)
        specs.append(conversion(b, ct, ptr(b), dst))
        b_op = Operand(dst, b2 * n * k * es, n * k * es, k, CUBLAS_OP_N, ct)
    c_op = Operand(ptr(node if out is None else out), b2 * n * m * 4, n * m * 4, m, 0, "f32")
    r3, r2 = b3 // a3, b2 // a2
    nn, batches, ratios = n, (b3, b2), (r3, r2)
    if r2 > 1 and b_op.trans == CUBLAS_OP_N and b_op.s2 == n * b_op.ld * es:
        # b's batches r2 at a time are one (r2 * N, K) matrix against the same a: fold them
        nn, batches, ratios = n * r2, (b3, a2), (r3, 1)
        b_op = attrs.evolve(b_op, s2=b_op.s2 * r2)
        c_op = attrs.evolve(c_op, s2=c_op.s2 * r2)
    gemm = batched(dict(m=m, n=nn, k=k), a_op, b_op, c_op, batches, ratios)
    if addend is not None:
        assert gemm.kind == "gemm", "an addend is fused into one batch's GEMM only"
        gemm = attrs.evolve(gemm, addend=ptr(addend))
    return [*specs, gemm]


def out_prod_specs(node: Tensor, ptr: Ptr, scratch: Scratch) -> list[Spec]:
    """cublas_out_prod: out[n, m] = sum_k b[k, n] * a[k, m] per batch.

    Column-major: a's row-major (K, M) buffer (row stride lda >= M) is an M x K
    matrix A; out's (N, M) buffer an M x N matrix C (ldc = M); C = A op(B) with
    op(B)[k, n] = b[k, n]: b's row-major (K, N) rows read column-major are an
    N x K matrix, so transb=T with ldb = its K stride; a b with its K axis
    packed (a transposed view) is already K x N: transb=N, ldb = its N stride.
    gemm(transa=N, transb, m=M, n=N, k=K, A=a, lda, B=b, ldb, C=out, ldc=M).
    Weights other than f32 are converted to f32 first; other b layouts copied.
    """
    a, b = node.srcs
    (a3, a2, k, m), (sa3, sa2, sa1, _) = geometry(a)
    (b3, b2, _, n), (sb3, sb2, sb1, sb0) = geometry(b)
    specs: list[Spec] = []
    if a.dtype.name == "f32":
        a_op = Operand(ptr(a), sa3, sa2, sa1 // 4 if k > 1 else m, CUBLAS_OP_N, "f32")
    else:
        dst = scratch("a", a3 * a2 * k * m * 4)
        specs.append(conversion(a, "f32", ptr(a), dst))
        a_op = Operand(dst, a2 * k * m * 4, k * m * 4, m, CUBLAS_OP_N, "f32")
    if (n == 1 or sb0 == 4) and (k == 1 or sb1 >= 4 * n):
        b_op = Operand(ptr(b), sb3, sb2, sb1 // 4 if k > 1 else n, CUBLAS_OP_T, "f32")
    elif k > 1 and sb1 == 4 and (n == 1 or sb0 >= 4 * k):
        b_op = Operand(ptr(b), sb3, sb2, sb0 // 4 if n > 1 else k, CUBLAS_OP_N, "f32")
    else:
        dst = scratch("b", b3 * b2 * k * n * 4)
        specs.append(conversion(b, "f32", ptr(b), dst))
        b_op = Operand(dst, b2 * k * n * 4, k * n * 4, n, CUBLAS_OP_T, "f32")
    c_op = Operand(ptr(node), b2 * n * m * 4, n * m * 4, m, 0, "f32")
    specs.append(batched(dict(m=m, n=n, k=k), a_op, b_op, c_op, (b3, b2), (b3 // a3, b2 // a2)))
    return specs
