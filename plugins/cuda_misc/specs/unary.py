"""unary.cu's launches (maps, every unary op, the fused softcap) and glu.cu's (glu of every kind and form).

A map runs `unary_flat` when its source is contiguous (16-byte vectors, grid-stride) and
`unary_strided` otherwise (any element strides, axes folded first); glu runs `glu_rows`
for either form, gate and up passed as two pointers with their own strides.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from opdispatch.backends.cuda.args import KernelArgs, Shape4, f32, i32, i64
from opdispatch.backends.cuda.args import ptr as pointer
from opdispatch.backends.cuda.kernels import GLU_CODES, KernelSpec
from opdispatch.ops.base import FLOATS, pad4
from opdispatch.ops.elementwise import UNARY_OPS
from opdispatch.tensor import Tensor

from . import KERNELS_DIR, Ptr
from .elementwise import ITEMSIZE, THREADS, aligned_to, elements, fold, grid_2d, grid_flat, typed_kernel, vec_elems

UNARY_CU = KERNELS_DIR / "unary.cu"
GLU_CU = KERNELS_DIR / "glu.cu"

#: op codes of unary.cu (OP_*); glu.cu's GLU_* are the kernel kit's GLU_CODES
UNARY_CODES = {
    **{name: i for i, name in enumerate(UNARY_OPS)},
    "sqr": 21, "sqrt": 22, "log": 23, "sin": 24, "cos": 25,
    "scale": 26, "clamp": 27, "leaky_relu": 28, "softcap": 29,
}
#: ops run by the unary kernels (softcap is a fusion, not an op)
MAP_OPS: tuple[str, ...] = (*UNARY_OPS, "sqr", "sqrt", "log", "sin", "cos", "scale", "clamp", "leaky_relu")

KERNEL_SOURCES = {
    UNARY_CU: tuple(typed_kernel(k, t) for k in ("unary_flat", "unary_strided") for t in FLOATS),
    GLU_CU: tuple(typed_kernel("glu_rows", t) for t in FLOATS),
}


@attrs.frozen
class UnaryFlatArgs(KernelArgs):
    KERNELS = ("unary_flat",)
    x: np.uint64 = pointer()
    y: np.uint64 = pointer()
    n: np.int64 = i64()
    nvec: np.int64 = i64()
    op: np.int32 = i32()
    p0: np.float32 = f32()
    p1: np.float32 = f32()


@attrs.frozen
class UnaryStridedArgs(KernelArgs):
    KERNELS = ("unary_strided",)
    x: np.uint64 = pointer()
    y: np.uint64 = pointer()
    _shape: Shape4 = attrs.field()  # x's dims and element strides
    op: np.int32 = i32()
    p0: np.float32 = f32()
    p1: np.float32 = f32()


@attrs.frozen
class GluRowsArgs(KernelArgs):
    """Gate and up rows (element strides of the three outer axes, folded), nc values a row."""

    KERNELS = ("glu_rows",)
    g: np.uint64 = pointer()
    gs0: np.int64 = i64()
    gs1: np.int64 = i64()
    gs2: np.int64 = i64()
    u: np.uint64 = pointer()
    us0: np.int64 = i64()
    us1: np.int64 = i64()
    us2: np.int64 = i64()
    y: np.uint64 = pointer()
    n1: np.int32 = i32()
    n2: np.int32 = i32()
    rows: np.int64 = i64()
    nc: np.int32 = i32()
    kind: np.int32 = i32()
    alpha: np.float32 = f32()
    limit: np.float32 = f32()
    vec: np.int32 = i32()


def map_params(node: Tensor) -> tuple[float, float]:
    """(p0, p1) of a map op as unary.cu takes them."""
    p = node.params
    if node.op == "scale":
        return p["s"], p["bias"]
    if node.op == "clamp":
        return p["min"], p["max"]
    if node.op == "leaky_relu":
        return p["negative_slope"], 0.0
    return 0.0, 0.0


def unary_spec(code: int, x: Tensor, out: Tensor, p0: float, p1: float, ptr: Ptr, sm_count: int) -> KernelSpec:
    """unary_flat when x is contiguous, else unary_strided."""
    t = x.dtype.name
    if x.is_contiguous():
        n = out.size
        vec = vec_elems(out)
        nvec = n // vec if aligned_to(ptr, x, 16) and aligned_to(ptr, out, 16) else 0
        grid = grid_flat(max(-(-nvec // 2), n - nvec * vec), sm_count)  # two vectors per thread and step
        args = UnaryFlatArgs(x=ptr(x), y=ptr(out), n=n, nvec=nvec, op=code, p0=p0, p1=p1)
        return KernelSpec(UNARY_CU, typed_kernel("unary_flat", t), (grid,), (THREADS,), args)
    n, ((_, sx),) = fold(out.shape, [elements(x)])
    grid, block = grid_2d(n[3], n[0] * n[1] * n[2], sm_count)
    args = UnaryStridedArgs(ptr(x), ptr(out), Shape4(*n, *sx), op=code, p0=p0, p1=p1)
    return KernelSpec(UNARY_CU, typed_kernel("unary_strided", t), grid, block, args)


def glu_spec(node: Tensor, ptr: Ptr, sm_count: int) -> KernelSpec:
    """glu_rows for either form: gate and up are passed as two pointers with their own strides."""
    x, y = node.srcs
    p = node.params
    nc = node.shape[-1]
    size = ITEMSIZE[node.dtype.name]
    if y is None:  # halves of x
        gate_off, up_off = (nc, 0) if p["swapped"] else (0, nc)
        g_t = u_t = x
    else:
        gate_off = up_off = 0
        g_t, u_t = x, y
    g_ptr, u_ptr = ptr(g_t) + gate_off * size, ptr(u_t) + up_off * size
    # outer axes only: the last is the row of nc packed elements
    outer = pad4(node.shape)[:3]
    (_, gs), (_, us) = elements(g_t), elements(u_t)
    n3, folded = fold(outer, [(outer, gs[:3]), (outer, us[:3])])
    n = n3[1:]  # fold pads to 4: the first is 1
    (_, gs3), (_, us3) = folded
    gs3, us3 = gs3[1:], us3[1:]
    rows = math.prod(outer)
    vec = vec_elems(node)
    ok = (nc % vec == 0 and g_ptr % 16 == 0 and u_ptr % 16 == 0 and ptr(node) % 16 == 0
          and all(s % vec == 0 for s in (*gs3, *us3)))
    grid, block = grid_2d(nc // vec if ok else nc, rows, sm_count)
    args = GluRowsArgs(g_ptr, *gs3, u_ptr, *us3, y=ptr(node), n1=n[1], n2=n[2], rows=rows, nc=nc,
                       kind=GLU_CODES[p["kind"]], alpha=p["alpha"], limit=p["limit"], vec=int(ok))
    return KernelSpec(GLU_CU, typed_kernel("glu_rows", node.dtype.name), grid, block, args)
