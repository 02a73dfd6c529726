"""Matrix products: mul_mat, mul_mat_id (mixture of experts), out_prod.

All results are f32. Batch dims broadcast by **repeat-interleave** (ggml's
rule): with ratio r = B2 // A2, b's batch i uses a's batch i // r, not i % A2.
"""

from __future__ import annotations

from ..tensor import Shape, Tensor
from .base import BLOCK_FORMATS, FLOATS, check, pad4, check_dtype, check_rank, check_tensor, node, op

__all__ = ["mul_mat", "mul_mat_id", "out_prod"]


def _check_not_transposed(op_name: str, a: Tensor) -> None:
    """ggml_is_transposed (nb[0] > nb[1]) is refused for the weight, as ggml asserts."""
    if a.ndim >= 2 and a.shape[-1] > 1 and a.shape[-2] > 1:
        check(a.strides[-1] <= a.strides[-2], op_name,
              f"a is transposed (strides {a.strides}); make it contiguous with cont first", a)


def _check_batch(op_name: str, a: Tensor, b: Tensor) -> Shape:
    """b's two outer dims must be multiples of a's; returns b's padded shape."""
    pa, pb = pad4(a.shape), pad4(b.shape)
    check(pb[0] % pa[0] == 0 and pb[1] % pa[1] == 0, op_name,
          f"a's batch dims {pa[:2]} do not divide b's {pb[:2]} (a broadcasts into b)", a, b)
    return pb


@op("matmul")
def mul_mat(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product `b @ a^T` of the last two axes, a's batch repeat-interleaved into b's.

    a `(A3, A2, M, K)`: f32/f16/bf16 or a block-quantized weight; b `(B3, B2,
    N, K)`: f32/f16/bf16; 2..4 dims each (missing outer dims are 1; b may have
    more dims than a). B2 % A2 == 0 and B3 % A3 == 0. Result f32 `(B3, B2, N,
    M)` with rank max(a.ndim, b.ndim):
    ``out[i3, i2] = b[i3, i2] @ a[i3 // (B3 // A3), i2 // (B2 // A2)].T``.

    ggml: ne = [M, N, B2, B3] = `ggml_mul_mat(a, b)`; a must not be transposed
    (ggml asserts it), b may have any strides. ggml's CPU converts b to the
    weight's dot type first (f16, or q8_0/q8_1 for quantized a); the reference
    does not: it dequantizes a and multiplies in float64, so ggml's CPU, and
    kernels that quantize b, differ from it by the rounding of b.
    """
    name = "mul_mat"
    check_tensor(name, a, "a")
    check_tensor(name, b, "b")
    check_rank(name, a, 2)
    check_rank(name, b, 2)
    check_dtype(name, a, FLOATS + BLOCK_FORMATS, "a")
    check_dtype(name, b, FLOATS, "b")
    check(a.shape[-1] == b.shape[-1], name, f"K differs: a has {a.shape[-1]}, b has {b.shape[-1]}", a, b)
    _check_not_transposed(name, a)
    pb = _check_batch(name, a, b)
    shape = pb[:2] + (pb[2], a.shape[-2])
    return node(name, (a, b), shape[4 - max(a.ndim, b.ndim):], "f32")


@op("matmul")
def mul_mat_id(as_: Tensor, b: Tensor, ids: Tensor) -> Tensor:
    """Per-token expert matmul: ``out[t, u] = as_[ids[t, u]] @ b[t, u % b.shape[1]]``.

    as_ `(E, M, K)` expert weights (f32/f16/bf16/quantized, not transposed);
    b `(T, Ub, K)` f32 with U % Ub == 0 (Ub is U or 1 in practice); ids i32
    `(T, U)`, each in [0, E). Result f32 `(T, U, M)`. ggml: ne = [M, U, T, 1]
    (numpy `(1, T, U, M)`; we drop the unit axis). ids are data, so a value
    out of range is caught only at run time (the reference raises IndexError).
    """
    name = "mul_mat_id"
    check_tensor(name, as_, "as_")
    check_tensor(name, b, "b")
    check_tensor(name, ids, "ids")
    check(as_.ndim == 3, name, f"as_ must be 3-D (E, M, K), got {as_.ndim} dims", as_)
    check(b.ndim == 3, name, f"b must be 3-D (T, U, K), got {b.ndim} dims", b)
    check(ids.ndim == 2, name, f"ids must be 2-D (T, U), got {ids.ndim} dims", ids)
    check_dtype(name, as_, FLOATS + BLOCK_FORMATS, "as_")
    check_dtype(name, b, ("f32",), "b")
    check_dtype(name, ids, ("i32",), "ids")
    check(as_.shape[-1] == b.shape[-1], name,
          f"K differs: as_ has {as_.shape[-1]}, b has {b.shape[-1]}", as_, b)
    check(ids.shape[0] == b.shape[0], name,
          f"token counts differ: ids has {ids.shape[0]}, b has {b.shape[0]}", ids, b)
    check(b.shape[1] > 0 and ids.shape[1] % b.shape[1] == 0, name,
          f"b's {b.shape[1]} rows per token do not divide the {ids.shape[1]} experts per token", b, ids)
    _check_not_transposed(name, as_)
    return node(name, (as_, b, ids), (ids.shape[0], ids.shape[1], as_.shape[1]), "f32")


@op("matmul")
def out_prod(a: Tensor, b: Tensor) -> Tensor:
    """Outer-product accumulation ``out = b^T @ a`` over the shared axis K (ggml_out_prod).

    a `(A3, A2, K, M)`: f32/f16/bf16/quantized, not transposed; b `(B3, B2,
    K, N)` f32; 2..4 dims each, B2 % A2 == 0, B3 % A3 == 0 (a repeat-
    interleaved as in mul_mat). Result f32 `(B3, B2, N, M)`:
    ``out[i3, i2, n, m] = sum_k b[i3, i2, k, n] * a[i3 // r3, i2 // r2, k, m]``,
    i.e. the sum over k of outer(b[k, :], a[k, :]).

    ggml: a ne = [M, K, A2, A3], b ne = [N, K, B2, B3], result ne = [M, N, B2,
    B3]: ``dst[i0, i1] += src0[i0, k] * src1[i1, k]``. (ggml's CPU has no f16
    kernel for a; the reference takes any float.)
    """
    name = "out_prod"
    check_tensor(name, a, "a")
    check_tensor(name, b, "b")
    check_rank(name, a, 2)
    check_rank(name, b, 2)
    check_dtype(name, a, FLOATS + BLOCK_FORMATS, "a")
    check_dtype(name, b, ("f32",), "b")
    check(a.shape[-2] == b.shape[-2], name, f"K differs: a has {a.shape[-2]}, b has {b.shape[-2]}", a, b)
    _check_not_transposed(name, a)
    pb = _check_batch(name, a, b)
    shape = pb[:2] + (b.shape[-1], a.shape[-1])
    return node(name, (a, b), shape[4 - max(a.ndim, b.ndim):], "f32")
