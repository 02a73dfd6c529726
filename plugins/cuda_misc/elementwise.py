"""The elementwise half of cuda_misc: binary ops with broadcasting, maps, unary ops, glu; multi-add and softcap.

Kernels (kernels/*.cu; f32, f16 and bf16, computed in float):

- elementwise.cu: add, sub, mul, div, add1 (b repeated into a by modulo in
  every axis), add_id, and the fused multi-add.
- unary.cu: sqr, sqrt, log, sin, cos, scale, clamp, leaky_relu, every op of
  UNARY_OPS, and the fused softcap (scale -> tanh -> scale).
- glu.cu: glu of every kind and form (fused halves either way round, split).

Each op has one Kernel record ("binary", "unary", "glu", "add_id") that takes
any layout; its bind picks the path from the layout and the addresses:
`*_flat` (contiguous, 16-byte vectors, grid-stride, no division),
`binary_rows` (rows of packed elements at one stride, b a full tensor or one
block broadcast over rows: vectors, no division), and the general
`binary_bcast` / `unary_strided` (any element strides, modulo broadcasting,
axes folded first). The predicates read like tables of (condition, reason),
after ggml's supports_op; anything declined runs on the reference.

Fusions: `multi_add_N` (a chain of N = 8..2 adds, each reading the previous
one as its a, one dtype, every operand readable as rows: one kernel adding
them all, partial sums rounded as the unfused adds store them, so fused ==
unfused bit for bit) and `softcap` (scale -> tanh -> scale, both without bias:
s2 * tanh(s1 * x) in one kernel, rounded between steps alike). Declined, with
the reason: f16 with bf16 (binary ops, add_id), strides or offsets that are not
whole elements, more than 2**31 - 1 rows, glu sources of another dtype than
the result, a non-contiguous result.

A bind is split in two, as cuda_norm's: a pure `*_spec` function picks the
kernel instance, grid, block and arguments from shapes, strides and
addresses (tested without a GPU), and `launch` makes the pre-bound launch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.kernels import GLU_CODES, KernelSpec
from opdispatch.hookspecs import Device, FusionRule, Kernel, Launch
from opdispatch.ops.base import FLOATS, pad4
from opdispatch.ops.elementwise import UNARY_OPS
from opdispatch.tensor import Tensor

if TYPE_CHECKING:
    from opdispatch.graph import Graph

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
ELEMENTWISE_CU = KERNELS_DIR / "elementwise.cu"
UNARY_CU = KERNELS_DIR / "unary.cu"
GLU_CU = KERNELS_DIR / "glu.cu"

#: C++ element type of each dtype (common.cuh's raw 16-bit types)
CTYPES = {"f32": "float", "f16": "od::f16", "bf16": "od::bf16"}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
#: (a, b) dtype pairs of the binary kernels: alike, or one of them f32
BINARY_PAIRS: tuple[tuple[str, str], ...] = tuple(
    (a, b) for a in FLOATS for b in FLOATS if a == b or "f32" in (a, b))

#: op codes of elementwise.cu (OP_*), unary.cu (OP_*) and glu.cu (GLU_*)
BINARY_CODES = {"add": 0, "sub": 1, "mul": 2, "div": 3}
UNARY_CODES = {
    **{name: i for i, name in enumerate(UNARY_OPS)},
    "sqr": 21, "sqrt": 22, "log": 23, "sin": 24, "cos": 25,
    "scale": 26, "clamp": 27, "leaky_relu": 28, "softcap": 29,
}

#: ops run by the unary kernels (softcap is a fusion, not an op)
MAP_OPS: tuple[str, ...] = (*UNARY_OPS, "sqr", "sqrt", "log", "sin", "cos", "scale", "clamp", "leaky_relu")
BINARY_OPS: tuple[str, ...] = ("add", "sub", "mul", "div", "add1")

INT_MAX = 2**31 - 1
THREADS = 256
#: resident 256-thread blocks per SM at full occupancy (2048 threads); grids cover WAVES of them
BLOCKS_PER_SM = 8
WAVES = 4  # measured on the H200: 1 wave 80-90% of copy bandwidth, 2 waves 89-96%, 4 waves 92-98%


def binary_kernel(kind: str, a: str, b: str) -> str:
    return f"{kind}<{CTYPES[a]}, {CTYPES[b]}>"


def unary_kernel(kind: str, t: str) -> str:
    return f"{kind}<{CTYPES[t]}>"


#: every instance a spec can name, per source (tests/test_kernels_compile.py compiles them)
KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {
    ELEMENTWISE_CU: (
        *(binary_kernel(k, a, b) for k in ("binary_flat", "binary_rows", "binary_bcast", "add_id")
          for a, b in BINARY_PAIRS),
        *(unary_kernel("multi_add", t) for t in FLOATS),
    ),
    UNARY_CU: tuple(unary_kernel(k, t) for k in ("unary_flat", "unary_strided") for t in FLOATS),
    GLU_CU: tuple(unary_kernel("glu_rows", t) for t in FLOATS),
}

Ptr = Callable[[Tensor], int]
Rule = tuple[Callable[[Tensor], bool], str]


# -- geometry --------------------------------------------------------------------------------


def elements(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides in elements, padded to 4 dims (size-1 axes get stride 0)."""
    pad = 4 - t.ndim
    shape = pad4(t.shape)
    strides = (0,) * pad + tuple(s // t.dtype.block_bytes for s in t.strides)
    return shape, tuple(0 if n == 1 else s for n, s in zip(shape, strides))


def whole_elements(t: Tensor) -> bool:
    """Strides and offset the kernels can take in elements."""
    size = t.dtype.block_bytes
    return all(s % size == 0 for s in t.strides) and t.view_offset % size == 0


def _dense_from(shape: Sequence[int], strides: Sequence[int], k: int) -> bool:
    """Axes k.. of the 4 are packed (size-1 axes ignored)."""
    step = 1
    for d in range(3, k - 1, -1):
        if shape[d] != 1 and strides[d] != step:
            return False
        step *= shape[d]
    return True


def _row_stride(shape: Sequence[int], strides: Sequence[int], k: int) -> int | None:
    """The one stride between consecutive rows when axes ..k-1 are rows of the packed axes k..; None if none."""
    rs = None
    span = 1  # rows spanned by one step of axis d
    for d in range(k - 1, -1, -1):
        if shape[d] != 1:
            if rs is None:
                rs = strides[d]
            elif strides[d] != rs * span:
                return None
        span *= shape[d]
    return 0 if rs is None else rs


@attrs.frozen
class Rows:
    """A result of rows x cols over sources each rows of `cols` packed elements `strides` apart (0: broadcast)."""

    rows: int
    cols: int
    strides: tuple[int, ...]


def rows_layout(out_shape: Sequence[int], srcs: Sequence[Tensor]) -> Rows | str:
    """The largest rows x cols split of `out_shape` that every source can be read in (see Rows), or why none.

    A source of the result's shape needs its inner axes packed and its outer
    axes at one row stride; a broadcast source must be one packed block of the
    inner axes (leading axes 1), repeated for every row.
    """
    s4 = pad4(tuple(out_shape))
    geo = [elements(t) for t in srcs]
    # a broadcast source fixes the split: it holds axes k.. exactly, and 1s before
    forced = set()
    for shape, _ in geo:
        if shape != s4:
            k = next((k for k in range(1, 4) if shape[k:] == s4[k:] and all(n == 1 for n in shape[:k])), None)
            if k is None:
                return f"a source of shape {shape} is not one block broadcast over rows"
            forced.add(k)
    if len(forced) > 1:
        return "sources broadcast over different axes"
    for k in sorted(forced) or range(4):
        strides = []
        for shape, st in geo:
            if not _dense_from(shape, st, k):
                break
            rs = 0 if shape != s4 else _row_stride(shape, st, k)
            if rs is None:
                break
            strides.append(rs)
        else:
            return Rows(math.prod(s4[:k]), math.prod(s4[k:]), tuple(strides))
    return "a source's rows are not packed at one stride"


def fold(shape: Sequence[int], srcs: Sequence[tuple[Sequence[int], Sequence[int]]]
         ) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Merge adjacent axes wherever every source allows, as 4 dims again.

    `shape` is the result's (contiguous); each source is (dims, element strides)
    with its dims dividing the result's (read by modulo). Axes d, d+1 merge for
    a source when it is 1 along d (the merged index modulo its d+1 size is the
    same), or full along d+1 with stride[d] == stride[d+1] * dims[d+1].
    """
    s4 = list(pad4(tuple(shape)))
    ops = [(list(pad4(tuple(m))), [0] * (4 - len(st)) + list(st)) for m, st in srcs]
    keep = [d for d in range(4) if s4[d] != 1]
    n = [s4[d] for d in keep]
    ops = [([m[d] for d in keep], [st[d] if m[d] != 1 else 0 for d in keep]) for m, st in ops]
    d = len(n) - 2
    while d >= 0:
        merged = []
        for m, st in ops:
            if m[d] == 1:
                merged.append((m[d + 1], st[d + 1]))
            elif m[d + 1] == n[d + 1] and st[d] == st[d + 1] * m[d + 1]:
                merged.append((m[d] * m[d + 1], st[d + 1]))
            else:
                break
        else:
            n[d:d + 2] = [n[d] * n[d + 1]]
            for (m, st), (mm, ms) in zip(ops, merged):
                m[d:d + 2] = [mm]
                st[d:d + 2] = [ms if mm != 1 else 0]
        d -= 1
    pad = 4 - len(n)
    return (1,) * pad + tuple(n), [((1,) * pad + tuple(m), (0,) * pad + tuple(st)) for m, st in ops]


def flat_layout(a: Tensor, b: Tensor) -> bool:
    """a and b contiguous, b of a's shape or one element: the flat path."""
    return a.is_contiguous() and b.is_contiguous() and (pad4(b.shape) == pad4(a.shape) or b.size == 1)


def grid_flat(units: int, sm_count: int) -> int:
    """Blocks of THREADS for a grid-stride loop over `units`: enough to fill WAVES of the GPU, no more."""
    return min(-(-units // THREADS), sm_count * BLOCKS_PER_SM * WAVES) if units else 0


def grid_2d(cols: int, rows: int, sm_count: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) for columns along x and rows along y, THREADS a block, grid-stride both ways."""
    if not cols or not rows:
        return (0, 0), (1, 1)
    bx = min(THREADS, 1 << (cols - 1).bit_length())
    by = THREADS // bx
    gx = min(-(-cols // bx), sm_count * BLOCKS_PER_SM * WAVES)
    gy = max(1, min(-(-rows // by), 65535, sm_count * BLOCKS_PER_SM * WAVES // gx))
    return (gx, gy), (bx, by)


def _vec(t: Tensor) -> int:
    """Elements of `t`'s dtype in one 16-byte vector."""
    return 16 // ITEMSIZE[t.dtype.name]


# -- launch specs -----------------------------------------------------------------------------




def _p(ptr: Ptr, t: Tensor) -> np.uint64:
    return np.uint64(ptr(t))


def _ll(*xs: int) -> tuple[np.int64, ...]:
    return tuple(np.int64(x) for x in xs)


def _i(*xs: int) -> tuple[np.int32, ...]:
    return tuple(np.int32(x) for x in xs)


def _aligned(ptr: Ptr, t: Tensor, nbytes: int) -> bool:
    return ptr(t) % nbytes == 0


def binary_spec(op: str, a: Tensor, b: Tensor, out: Tensor, ptr: Ptr, sm_count: int) -> KernelSpec:
    """The path for the layout: binary_flat, binary_rows (whole vectors, aligned) or binary_bcast."""
    if flat_layout(a, b):
        return binary_flat_spec(op, a, b, out, ptr, sm_count)
    return binary_rows_spec(op, a, b, out, ptr, sm_count)


def binary_flat_spec(op: str, a: Tensor, b: Tensor, out: Tensor, ptr: Ptr, sm_count: int) -> KernelSpec:
    """a, b, out contiguous; b a's shape or one element."""
    n = out.size
    vec = _vec(out)
    scalar = b.size == 1 and n != 1
    ok = (_aligned(ptr, a, 16) and _aligned(ptr, out, 16)
          and (scalar or _aligned(ptr, b, vec * ITEMSIZE[b.dtype.name])))
    nvec = n // vec if ok else 0
    args = (_p(ptr, a), _p(ptr, b), _p(ptr, out), *_ll(n, nvec), *_i(int(scalar), BINARY_CODES[op]))
    grid = grid_flat(max(nvec, n - nvec * vec), sm_count)
    return KernelSpec(ELEMENTWISE_CU, binary_kernel("binary_flat", a.dtype.name, b.dtype.name), (grid,), (THREADS,), args)


def binary_rows_spec(op: str, a: Tensor, b: Tensor, out: Tensor, ptr: Ptr, sm_count: int) -> KernelSpec:
    """Rows of packed elements (see rows_layout) in whole aligned vectors, else binary_bcast."""
    lay = rows_layout(out.shape, (a, b))
    vec = _vec(out)
    if (isinstance(lay, str) or lay.cols % vec or any(s % vec for s in lay.strides)
            or not (_aligned(ptr, a, 16) and _aligned(ptr, out, 16)
                    and _aligned(ptr, b, vec * ITEMSIZE[b.dtype.name]))):
        return binary_bcast_spec(op, a, b, out, ptr, sm_count)
    grid, block = grid_2d(lay.cols // vec, lay.rows, sm_count)
    args = (_p(ptr, a), *_ll(lay.strides[0]), _p(ptr, b), *_ll(lay.strides[1]), _p(ptr, out),
            *_ll(lay.rows, lay.cols), *_i(BINARY_CODES[op]))
    return KernelSpec(ELEMENTWISE_CU, binary_kernel("binary_rows", a.dtype.name, b.dtype.name), grid, block, args)


def binary_bcast_spec(op: str, a: Tensor, b: Tensor, out: Tensor, ptr: Ptr, sm_count: int) -> KernelSpec:
    """Any strides, b by modulo in every axis."""
    n, ((_, sa), (m, sb)) = fold(out.shape, [elements(a), elements(b)])
    grid, block = grid_2d(n[3], n[0] * n[1] * n[2], sm_count)
    args = (_p(ptr, a), *_ll(*sa), _p(ptr, b), *_i(*m), *_ll(*sb), _p(ptr, out), *_i(*n), *_i(BINARY_CODES[op]))
    return KernelSpec(ELEMENTWISE_CU, binary_kernel("binary_bcast", a.dtype.name, b.dtype.name), grid, block, args)


def add_id_spec(node: Tensor, ptr: Ptr, sm_count: int) -> KernelSpec:
    a, b, ids = node.srcs
    (_, n_t, n_u, n_c), (_, as0, as1, as2) = elements(a)
    (_, _, n_e, _), (_, _, bs0, bs1) = elements(b)
    (_, _, _, _), (_, _, is0, is1) = elements(ids)
    grid, block = grid_2d(n_c, n_t * n_u, sm_count)
    args = (_p(ptr, a), *_ll(as0, as1, as2), _p(ptr, b), *_ll(bs0, bs1), _p(ptr, ids), *_ll(is0, is1),
            _p(ptr, node), *_i(n_t, n_u, n_c, n_e))
    return KernelSpec(ELEMENTWISE_CU, binary_kernel("add_id", a.dtype.name, b.dtype.name), grid, block, args)


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
    tail = (*_i(code), np.float32(p0), np.float32(p1))
    if x.is_contiguous():
        n = out.size
        vec = _vec(out)
        nvec = n // vec if _aligned(ptr, x, 16) and _aligned(ptr, out, 16) else 0
        grid = grid_flat(max(-(-nvec // 2), n - nvec * vec), sm_count)  # two vectors per thread and step
        return KernelSpec(UNARY_CU, unary_kernel("unary_flat", t), (grid,), (THREADS,),
                    (_p(ptr, x), _p(ptr, out), *_ll(n, nvec), *tail))
    n, ((_, sx),) = fold(out.shape, [elements(x)])
    grid, block = grid_2d(n[3], n[0] * n[1] * n[2], sm_count)
    return KernelSpec(UNARY_CU, unary_kernel("unary_strided", t), grid, block,
                (_p(ptr, x), _p(ptr, out), *_i(*n), *_ll(*sx), *tail))


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
    vec = _vec(node)
    ok = (nc % vec == 0 and g_ptr % 16 == 0 and u_ptr % 16 == 0 and ptr(node) % 16 == 0
          and all(s % vec == 0 for s in (*gs3, *us3)))
    grid, block = grid_2d(nc // vec if ok else nc, rows, sm_count)
    args = (np.uint64(g_ptr), *_ll(*gs3), np.uint64(u_ptr), *_ll(*us3), _p(ptr, node), *_i(n[1], n[2]),
            *_ll(rows), *_i(nc, GLU_CODES[p["kind"]]), np.float32(p["alpha"]), np.float32(p["limit"]), *_i(int(ok)))
    return KernelSpec(GLU_CU, unary_kernel("glu_rows", node.dtype.name), grid, block, args)


def multi_add_spec(nodes: Sequence[Tensor], ptr: Ptr, sm_count: int) -> KernelSpec:
    """One kernel adding every operand of a chain of adds (checked by `multi_add_check`)."""
    srcs = multi_add_operands(nodes)
    out = nodes[-1]
    lay = rows_layout(out.shape, srcs)
    assert isinstance(lay, Rows), lay
    vec = _vec(out)
    ok = (lay.cols % vec == 0 and all(s % vec == 0 for s in lay.strides)
          and all(_aligned(ptr, t, 16) for t in (*srcs, out)))
    grid, block = grid_2d(lay.cols // vec if ok else lay.cols, lay.rows, sm_count)
    pad = 9 - len(srcs)
    args = (*(_p(ptr, t) for t in srcs), *(np.uint64(0),) * pad, *_ll(*lay.strides), *_ll(*(0,) * pad),
            *_i(len(srcs)), _p(ptr, out), *_ll(lay.rows, lay.cols), *_i(int(ok)))
    return KernelSpec(ELEMENTWISE_CU, unary_kernel("multi_add", out.dtype.name), grid, block, args)


# -- binds ----------------------------------------------------------------------------------------


def sm_count(ctx: object) -> int:
    return int(ctx.device.props.get("sm_count", 132))  # type: ignore[attr-defined]


def launch(ctx: object, spec: KernelSpec) -> Launch:
    """The pre-bound launch of `spec` on the context's stream."""
    return spec.launch(ctx.stream)  # type: ignore[attr-defined]


def _binary_srcs(node: Tensor) -> tuple[str, Tensor, Tensor]:
    """(op code name, a, b); add1 is an add of a one-element b."""
    a, b = node.srcs
    return ("add" if node.op == "add1" else node.op), a, b


def bind_binary(ctx, node: Tensor) -> Launch:  # noqa: ANN001
    op, a, b = _binary_srcs(node)
    return launch(ctx, binary_spec(op, a, b, node, ctx.ptr, sm_count(ctx)))


def bind_add_id(ctx, node: Tensor) -> Launch:  # noqa: ANN001
    return launch(ctx, add_id_spec(node, ctx.ptr, sm_count(ctx)))


def bind_map(ctx, node: Tensor) -> Launch:  # noqa: ANN001
    p0, p1 = map_params(node)
    return launch(ctx, unary_spec(UNARY_CODES[node.op], node.srcs[0], node, p0, p1, ctx.ptr, sm_count(ctx)))


def bind_glu(ctx, node: Tensor) -> Launch:  # noqa: ANN001
    return launch(ctx, glu_spec(node, ctx.ptr, sm_count(ctx)))


def bind_multi_add(ctx, nodes: Sequence[Tensor]) -> Launch:  # noqa: ANN001
    return launch(ctx, multi_add_spec(nodes, ctx.ptr, sm_count(ctx)))


def bind_softcap(ctx, nodes: Sequence[Tensor]) -> Launch:  # noqa: ANN001
    s1, _, s2 = nodes
    return launch(ctx, unary_spec(UNARY_CODES["softcap"], s1.srcs[0], s2, s1.params["s"], s2.params["s"],
                                  ctx.ptr, sm_count(ctx)))


# -- support predicates ------------------------------------------------------------------------------


def first_failure(node: Tensor, rules: Sequence[Rule]) -> bool | str:
    """True if every condition holds for `node`, else the reason of the first that does not."""
    for holds, reason in rules:
        if not holds(node):
            return reason
    return True


def _srcs(n: Tensor) -> list[Tensor]:
    return [s for s in n.srcs if s is not None]


def _float_srcs(n: Tensor) -> bool:
    return all(s.dtype.name in FLOATS for s in _srcs(n) if not (n.op == "add_id" and s is n.srcs[2]))


def _rows_fit(n: Tensor) -> bool:
    """Row and column counts of the general kernels fit their 32-bit indices."""
    return math.prod(n.shape[:-1]) <= INT_MAX and (not n.shape or n.shape[-1] <= INT_MAX)


def _pair_ok(n: Tensor) -> bool:
    return (n.srcs[0].dtype.name, n.srcs[1].dtype.name) in BINARY_PAIRS


def _dtype_reason(n: Tensor) -> str:
    return "sources must be f32, f16 or bf16 (" + ", ".join(s.dtype.name for s in _srcs(n)) + ")"


def _common(n: Tensor) -> tuple[Rule, ...]:
    return (
        (_float_srcs, _dtype_reason(n)),
        (lambda n: n.dtype.name in FLOATS, f"the result must be f32, f16 or bf16 (got {n.dtype.name})"),
        (lambda n: n.is_contiguous(), "the result must be contiguous"),
        (lambda n: all(whole_elements(s) for s in _srcs(n)), "strides must be whole elements"),
    )


def binary_ok(device: Device, n: Tensor) -> bool | str:
    """add, sub, mul, div, add1: any layout (binary_spec picks the path)."""
    return first_failure(n, (
        *_common(n),
        (_pair_ok, f"{n.srcs[0].dtype.name} a with {n.srcs[1].dtype.name} b not supported (mixed f16/bf16)"),
        (_rows_fit, "at most 2**31 - 1 rows"),
    ))


def add_id_ok(device: Device, n: Tensor) -> bool | str:
    return first_failure(n, (
        *_common(n),
        (_pair_ok, f"{n.srcs[0].dtype.name} a with {n.srcs[1].dtype.name} b not supported (mixed f16/bf16)"),
        (lambda n: n.shape[0] * n.shape[1] <= INT_MAX and n.shape[2] <= INT_MAX, "at most 2**31 - 1 rows"),
    ))


def map_ok(device: Device, n: Tensor) -> bool | str:
    """A map op on any layout (unary_spec picks the path)."""
    return first_failure(n, (
        *_common(n),
        (lambda n: n.dtype == n.srcs[0].dtype, "the result must have the source's dtype"),
        (_rows_fit, "at most 2**31 - 1 rows"),
    ))


def glu_ok(device: Device, n: Tensor) -> bool | str:
    return first_failure(n, (
        *_common(n),
        (lambda n: all(s.dtype == n.dtype for s in _srcs(n)), "sources and result must share one dtype"),
        (lambda n: all(s.rows_contiguous() for s in _srcs(n)), "rows must be contiguous"),
        (lambda n: n.params["kind"] in GLU_CODES, f"unknown glu kind {n.params.get('kind')!r}"),
        (_rows_fit, "at most 2**31 - 1 rows"),
    ))


# -- fusions -----------------------------------------------------------------------------------------


def multi_add_operands(nodes: Sequence[Tensor]) -> list[Tensor]:
    """Every tensor a chain of adds sums: the first add's a, then each add's b."""
    return [nodes[0].srcs[0], *(n.srcs[1] for n in nodes)]


def multi_add_check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """Adds each reading the previous as a; one dtype; operands readable as rows (rows_layout)."""
    for prev, n in zip(nodes, nodes[1:]):
        if n.srcs[0] is not prev:
            return f"add {n.name} does not read the add before it as its first source"
    inside = set(nodes)
    srcs = multi_add_operands(nodes)
    if any(s in inside for s in srcs):
        return "an operand is computed inside the group"
    dt = nodes[-1].dtype
    if dt.name not in FLOATS or any(t.dtype != dt for t in (*srcs, *nodes)):
        return "operands and results must share one dtype (f32, f16 or bf16)"
    if not nodes[-1].is_contiguous():
        return "the result must be contiguous"
    if not all(whole_elements(t) for t in srcs):
        return "strides must be whole elements"
    lay = rows_layout(nodes[-1].shape, srcs)
    return lay if isinstance(lay, str) else True


def softcap_check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """scale (no bias) -> tanh -> scale (no bias), each reading the one before."""
    s1, th, s2 = nodes
    if th.srcs[0] is not s1 or s2.srcs[0] is not th:
        return "the ops do not read each other in order"
    if s1.params["bias"] != 0.0 or s2.params["bias"] != 0.0:
        return "a scale has a bias"
    for n in nodes:
        ok = map_ok(device, n)
        if ok is not True:
            return f"{n.op}: {ok}"
    return True


#: the longest chain first: dispatch takes the first rule whose check passes
MAX_ADDS = 8

KERNELS: list[Kernel] = [
    *(Kernel(op, bind_binary, binary_ok, name="binary") for op in BINARY_OPS),
    Kernel("add_id", bind_add_id, add_id_ok, name="add_id"),
    *(Kernel(op, bind_map, map_ok, name="unary") for op in MAP_OPS),
    Kernel("glu", bind_glu, glu_ok, name="glu"),
]

FUSIONS: list[FusionRule] = [
    FusionRule("softcap", ("scale", "tanh", "scale"), bind=bind_softcap, check=softcap_check),
    *(FusionRule(f"multi_add_{n}", ("add",) * n, bind=bind_multi_add, check=multi_add_check)
      for n in range(MAX_ADDS, 1, -1)),
]
