"""Which matrix-product path runs a node, as tables of (condition, reason) read top to bottom.

`choose(node)` gives a `Choice`: the path's name (a Kernel's `name`, shown by
`Plan.explain()`) or the reason the plugin declines the node. The plugin-wide
`supports_op` gate returns that reason, so it is said once; each Kernel's
`supports` accepts exactly the nodes whose path is its own, so the paths are
mutually exclusive. Conditions only read shapes, strides, dtypes and view
offsets: plans are made and tested on a device description.

Paths:
  mul_mat      mmvf            float weights (f32/f16/bf16), N <= 8: mat-vec kernel
               mmvq            block-quantized weights, N <= 8: mat-vec, dequantizing on the fly
               cublas          float weights, N > 8: cuBLAS GEMM (batched when needed)
               dequant_cublas  block-quantized weights, N > 8: dequantize to f16, then cuBLAS
  mul_mat_id   mmv_id          one token (T == 1): a mat-vec block per (token, slot), expert read on the device
               mmv_id_grouped  T > 1: a routing kernel groups the pairs by expert, then a mat-vec per expert
  out_prod     cublas_out_prod cuBLAS GEMM (non-f32 weights converted to f32 first)
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs

from opdispatch.ops.base import pad4
from opdispatch.tensor import Tensor

Rule = tuple[Callable[[Tensor], bool], str]

INT_MAX = 2**31 - 1
GRID_YZ_MAX = 65535
#: most columns (batch N) the mat-vec kernels take; larger batches go to cuBLAS
MMV_MAX_N = 8
#: most experts the routing kernel of mmv_id_grouped takes (shared memory: 2 ints an expert)
ROUTE_MAX_EXPERTS = 4096

MATMUL_OPS = ("mul_mat", "mul_mat_id", "out_prod")


@attrs.frozen
class Choice:
    path: str = ""
    reason: str = ""


def first_failure(node: Tensor, rules: Sequence[Rule]) -> str:
    """'' if every condition holds for `node`, else the reason of the first that does not."""
    for holds, reason in rules:
        if not holds(node):
            return reason
    return ""


def elem_strides(t: Tensor) -> bool:
    """Strides and offset the kernels can use: whole elements for float types, even
    byte counts for block formats (their fields are read with 16-bit loads)."""
    unit = 2 if t.dtype.is_quant else t.dtype.block_bytes
    return all(s % unit == 0 for s in t.strides) and t.view_offset % unit == 0


def rows_apart(t: Tensor) -> bool:
    """Rows (the second-last axis) do not overlap: the row stride covers a whole row."""
    if t.ndim < 2 or t.shape[-2] <= 1:
        return True
    return t.strides[-2] >= t.dtype.row_bytes(t.shape[-1])


def fits(*sizes: int) -> bool:
    return all(0 <= n <= INT_MAX for n in sizes)


def _a(n: Tensor) -> Tensor:
    return n.srcs[0]


def _b(n: Tensor) -> Tensor:
    return n.srcs[1]


def out_rules() -> tuple[Rule, ...]:
    return (
        (lambda n: n.dtype.name == "f32" and n.is_contiguous(), "the result must be contiguous f32"),
    )


#: mul_mat: a (A3, A2, M, K) any type, b (B3, B2, N, K) float, out (B3, B2, N, M) f32.
MUL_MAT: tuple[Rule, ...] = (
    *out_rules(),
    (lambda n: _a(n).rows_contiguous(), "a's rows (the K axis) must be contiguous"),
    (lambda n: elem_strides(_a(n)), "a's strides and offset must be whole elements"),
    (lambda n: elem_strides(_b(n)), "b's strides and offset must be whole elements"),
    (lambda n: rows_apart(_a(n)), "a's rows overlap"),
    (lambda n: _a(n).shape[-1] > 0, "an empty product (K = 0)"),
    (lambda n: fits(n.size, _a(n).shape[-1], _a(n).shape[-2], _b(n).shape[-2]), "sizes must be below 2**31"),
    (lambda n: max(pad4(n.shape)[:2]) <= GRID_YZ_MAX, "batch dims must be at most 65535"),
)

#: mul_mat_id: as (E, M, K), b (T, Ub, K) f32, ids (T, U) i32, out (T, U, M).
MUL_MAT_ID: tuple[Rule, ...] = (
    *out_rules(),
    (lambda n: _a(n).rows_contiguous(), "the experts' rows (the K axis) must be contiguous"),
    (lambda n: elem_strides(_a(n)), "the experts' strides and offset must be whole elements"),
    (lambda n: elem_strides(_b(n)) and elem_strides(n.srcs[2]), "b's and ids' strides must be whole elements"),
    (lambda n: _a(n).shape[-1] > 0, "an empty product (K = 0)"),
    (lambda n: fits(n.size, _a(n).shape[-1]), "sizes must be below 2**31"),
    (lambda n: n.shape[0] == 1 or _a(n).shape[0] <= ROUTE_MAX_EXPERTS,
     f"more than {ROUTE_MAX_EXPERTS} experts with several tokens"),
    (lambda n: n.shape[0] > 1 or n.shape[1] <= GRID_YZ_MAX, "more than 65535 experts used per token"),
)

#: out_prod: a (A3, A2, K, M) any type, b (B3, B2, K, N) f32, out (B3, B2, N, M).
OUT_PROD: tuple[Rule, ...] = (
    *out_rules(),
    (lambda n: _a(n).rows_contiguous(), "a's rows (the M axis) must be contiguous"),
    (lambda n: elem_strides(_a(n)) and elem_strides(_b(n)), "strides and offsets must be whole elements"),
    (lambda n: rows_apart(_a(n)), "a's rows overlap"),
    (lambda n: _a(n).shape[-2] > 0, "an empty product (K = 0)"),
    (lambda n: fits(n.size, _a(n).size, _b(n).size), "sizes must be below 2**31"),
)

RULES = {"mul_mat": MUL_MAT, "mul_mat_id": MUL_MAT_ID, "out_prod": OUT_PROD}


def batch_n(node: Tensor) -> int:
    """Columns a mul_mat multiplies each weight matrix by (ggml's ne[1])."""
    return node.shape[-2]


def choose(node: Tensor) -> Choice:
    """The path that runs `node`, or why none does."""
    rules = RULES.get(node.op)
    if rules is None:
        return Choice(reason=f"not a matrix product ({node.op})")
    reason = first_failure(node, rules)
    if reason:
        return Choice(reason=reason)
    quant = node.srcs[0].dtype.is_quant
    if node.op == "mul_mat":
        small = batch_n(node) <= MMV_MAX_N
        return Choice(("mmvq" if small else "dequant_cublas") if quant else ("mmvf" if small else "cublas"))
    if node.op == "mul_mat_id":
        return Choice("mmv_id" if node.shape[0] == 1 else "mmv_id_grouped")
    return Choice("cublas_out_prod")


def gate(node: Tensor) -> bool | str | None:
    """The plugin-wide answer: None (go on to the kernels) or the reason to decline."""
    if node.op not in MATMUL_OPS:
        return None
    c = choose(node)
    return c.reason or None


def takes(path: str) -> Callable[[object, Tensor], bool | str]:
    """A Kernel's supports: True for the nodes whose path is `path`."""

    def supports(device: object, node: Tensor) -> bool | str:
        c = choose(node)
        if c.reason:
            return c.reason
        return True if c.path == path else f"{c.path} takes it"

    supports.__name__ = f"takes_{path}"
    return supports
