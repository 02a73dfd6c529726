"""layout.cu's layout ops: concat, repeat, pad, pad_reflect_1d, roll, arange, fill, diag, tri, set / acc
(set_window) and timestep_embedding.

Results are contiguous: a grid-stride kernel walks the result's flat indices, unravelled over its
shape (the `o` layout, strides unused), and reads its sources through their byte strides.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.args import KernelArgs, f32, f64, i32, i64, instance, u32
from opdispatch.backends.cuda.args import ptr as pointer
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.dtypes import DTYPES
from opdispatch.ops.base import pad4
from opdispatch.tensor import Tensor

from . import KERNELS_DIR, Ptr
from .rows import BLOCK, RAW, RAW_DTYPES, VALUE, Layout, layout, padded, raw, shape_layout, stride_grid, units


LAYOUT_CU = KERNELS_DIR / "layout.cu"

#: tri's kind codes (layout.cu)
TRI_CODES = {"lower": 0, "lower_diag": 1, "upper": 2, "upper_diag": 3}
#: a window axis set_window never steps: padding up to 4 axes
NO_AXIS_STRIDE = 1 << 40

KERNEL_SOURCES = {LAYOUT_CU: (
    *(instance("concat", raw(DTYPES[t])) for t in RAW_DTYPES),
    *(instance("repeat", RAW[n]) for n in (2, 4)),
    "pad", "pad_reflect_1d", "roll", "arange", "diag", "tri", "timestep_embedding",
    *(instance("fill", VALUE[d]) for d in ("f32", "f16")),
    instance("set_window", "float", True), instance("set_window", "float", False), instance("set_window", "int", False),
)}


# -- kernel arguments: out, n and the result's `o` layout, then each op's own ---------------------


@attrs.frozen
class ConcatArgs(KernelArgs):
    KERNELS = ("concat",)
    a: np.uint64 = pointer()
    b: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.uint32 = u32()
    o: Layout
    axis: np.int32 = i32()
    alen: np.uint32 = u32()
    as0: np.int64 = i64()
    as1: np.int64 = i64()
    as2: np.int64 = i64()
    as3: np.int64 = i64()
    bs0: np.int64 = i64()
    bs1: np.int64 = i64()
    bs2: np.int64 = i64()
    bs3: np.int64 = i64()


@attrs.frozen
class RepeatArgs(KernelArgs):
    KERNELS = ("repeat",)
    a: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.uint32 = u32()
    o: Layout
    a0: np.uint32 = u32()
    a1: np.uint32 = u32()
    a2: np.uint32 = u32()
    a3: np.uint32 = u32()
    as0: np.int64 = i64()
    as1: np.int64 = i64()
    as2: np.int64 = i64()
    as3: np.int64 = i64()


@attrs.frozen
class PadArgs(KernelArgs):
    KERNELS = ("pad",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.uint32 = u32()
    o: Layout
    x0: np.uint32 = u32()
    x1: np.uint32 = u32()
    x2: np.uint32 = u32()
    x3: np.uint32 = u32()
    lo0: np.uint32 = u32()
    lo1: np.uint32 = u32()
    lo2: np.uint32 = u32()
    lo3: np.uint32 = u32()
    xs0: np.int64 = i64()
    xs1: np.int64 = i64()
    xs2: np.int64 = i64()
    xs3: np.int64 = i64()


@attrs.frozen
class PadReflectArgs(KernelArgs):
    KERNELS = ("pad_reflect_1d",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.uint32 = u32()
    o: Layout
    x0: np.int32 = i32()
    p0: np.int32 = i32()
    xs0: np.int64 = i64()
    xs1: np.int64 = i64()
    xs2: np.int64 = i64()
    xs3: np.int64 = i64()


@attrs.frozen
class RollArgs(KernelArgs):
    KERNELS = ("roll",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.uint32 = u32()
    o: Layout
    sh0: np.uint32 = u32()
    sh1: np.uint32 = u32()
    sh2: np.uint32 = u32()
    sh3: np.uint32 = u32()
    xs0: np.int64 = i64()
    xs1: np.int64 = i64()
    xs2: np.int64 = i64()
    xs3: np.int64 = i64()


@attrs.frozen
class DiagArgs(KernelArgs):
    KERNELS = ("diag",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.uint32 = u32()
    o: Layout
    xs0: np.int64 = i64()
    xs2: np.int64 = i64()
    xs3: np.int64 = i64()


@attrs.frozen
class TriArgs(KernelArgs):
    KERNELS = ("tri",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.uint32 = u32()
    o: Layout
    kind: np.int32 = i32()
    xs0: np.int64 = i64()
    xs1: np.int64 = i64()
    xs2: np.int64 = i64()
    xs3: np.int64 = i64()


@attrs.frozen
class ArangeArgs(KernelArgs):
    KERNELS = ("arange",)
    out: np.uint64 = pointer()
    n: np.uint32 = u32()
    start: np.float32 = f32()
    step: np.float32 = f32()


@attrs.frozen
class FillArgs(KernelArgs):
    KERNELS = ("fill",)
    out: np.uint64 = pointer()
    n: np.int64 = i64()
    value: np.float32 = f32()


@attrs.frozen
class SetWindowArgs(KernelArgs):
    """a's values (through its layout) with b's written or added at the window: offset `woff` and
    element strides ws / sizes wn of its axes (see `window`), b's byte strides bs."""

    KERNELS = ("set_window",)
    a_: np.uint64 = pointer()  # the C parameter `a`; the field `a` is its layout (OD_LAYOUT_PARAMS(a))
    b: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.uint32 = u32()
    a: Layout
    woff: np.int64 = i64()
    ws0: np.int64 = i64()
    ws1: np.int64 = i64()
    ws2: np.int64 = i64()
    ws3: np.int64 = i64()
    wn0: np.uint32 = u32()
    wn1: np.uint32 = u32()
    wn2: np.uint32 = u32()
    wn3: np.uint32 = u32()
    bs0: np.int64 = i64()
    bs1: np.int64 = i64()
    bs2: np.int64 = i64()
    bs3: np.int64 = i64()


@attrs.frozen
class TimestepArgs(KernelArgs):
    KERNELS = ("timestep_embedding",)
    t: np.uint64 = pointer()
    out: np.uint64 = pointer()
    rows: np.int32 = i32()
    dim: np.int32 = i32()
    ts0: np.int64 = i64()
    log_max_period: np.float64 = f64()


# -- launch specs ------------------------------------------------------------------------------------


def flat_spec(node: Tensor, kernel: str, record: type[KernelArgs], srcs: Sequence[Tensor], *extra: Any, ptr: Ptr,
              sms: int, blocks: bool = False) -> KernelSpec:
    """A grid-stride kernel over the result's units: the sources' addresses, out, n, the result's
    shape as the `o` layout, then the op's `extra` arguments."""
    n = units(node)
    shape = list(pad4(node.shape))
    if blocks:
        shape[-1] //= node.dtype.block_size
    args = record(*(ptr(s) for s in srcs), ptr(node), n, shape_layout(shape), *extra)
    return KernelSpec(LAYOUT_CU, kernel, stride_grid(n, sms), BLOCK, args)


def strides(t: Tensor) -> tuple[int, ...]:
    """Byte strides innermost first, padded to 4."""
    return tuple(reversed(padded(t)[1]))


def dims(t: Tensor, blocks: bool = False) -> tuple[int, ...]:
    """Sizes innermost first, padded to 4."""
    return tuple(reversed(padded(t, blocks)[0]))


def _inner_axis(t: Tensor, axis: int) -> int:
    """A numpy axis of t as an index innermost first."""
    return t.ndim - 1 - axis


def concat_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    a, bb = node.srcs
    axis = node.params["axis"]
    alen = a.shape[axis] // (a.dtype.block_size if axis == a.ndim - 1 else 1)
    return [flat_spec(node, instance("concat", raw(node.dtype)), ConcatArgs, (a, bb), _inner_axis(a, axis), alen,
                      *strides(a), *strides(bb), ptr=ptr, sms=sms, blocks=node.dtype.is_quant)]


def repeat_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    a = node.srcs[0]
    pa = (1,) * (node.ndim - a.ndim) + a.shape
    return [flat_spec(node, instance("repeat", RAW[a.dtype.block_bytes]), RepeatArgs, (a,), *reversed(pad4(pa)),
                      *strides(a), ptr=ptr, sms=sms)]


def pad_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    lo = (0,) * (4 - x.ndim) + tuple(p[0] for p in node.params["pads"])
    return [flat_spec(node, "pad", PadArgs, (x,), *dims(x), *reversed(lo), *strides(x), ptr=ptr, sms=sms)]


def pad_reflect_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    return [flat_spec(node, "pad_reflect_1d", PadReflectArgs, (x,), x.shape[-1], node.params["p0"], *strides(x),
                      ptr=ptr, sms=sms)]


def roll_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    shifts = (0,) * (4 - x.ndim) + tuple(s % max(n, 1) for s, n in zip(node.params["shifts"], x.shape))
    return [flat_spec(node, "roll", RollArgs, (x,), *reversed(shifts), *strides(x), ptr=ptr, sms=sms)]


def diag_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    # x (.., 1, N) or (N,): its axis -2 is never stepped, out's axes -3, -4 read x's -3, -4
    xs = (0,) * (4 - x.ndim) + x.strides if x.ndim >= 2 else (0, 0, 0, x.strides[0])
    return [flat_spec(node, "diag", DiagArgs, (x,), xs[3], xs[1], xs[0], ptr=ptr, sms=sms)]


def tri_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    x = node.srcs[0]
    return [flat_spec(node, "tri", TriArgs, (x,), TRI_CODES[node.params["kind"]], *strides(x), ptr=ptr, sms=sms)]


def arange_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    p = node.params
    n = node.shape[0]
    return [KernelSpec(LAYOUT_CU, "arange", stride_grid(n, sms), BLOCK,
                       ArangeArgs(out=ptr(node), n=n, start=p["start"], step=p["step"]))]


def fill_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    return [KernelSpec(LAYOUT_CU, instance("fill", VALUE[node.dtype.name]), stride_grid(node.size, sms), BLOCK,
                       FillArgs(out=ptr(node), n=node.size, value=node.params["value"]))]


def window(node: Tensor) -> tuple[list[int], list[int], list[int]] | None:
    """set/acc's window as layout.cu's set_window takes it: (sizes, element strides,
    b's byte strides), axes of size > 1 sorted by window stride, largest first, padded
    to 4 with (1, NO_AXIS_STRIDE, 0). None if two window positions share an element."""
    a, bt = node.srcs
    isz = a.dtype.block_bytes
    axes = sorted(((st // isz, nb, bs) for nb, st, bs in zip(bt.shape, node.params["strides"], bt.strides) if nb > 1),
                  reverse=True)
    span = 0  # elements covered by the axes after this one, minus one
    for st, nb, _ in reversed(axes):
        if st <= span:
            return None
        span += (nb - 1) * st
    axes = [(NO_AXIS_STRIDE, 1, 0)] * (4 - len(axes)) + axes
    return [nb for _, nb, _ in axes], [st for st, _, _ in axes], [bs for _, _, bs in axes]


def set_acc_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    a, bt = node.srcs
    sizes, wstrides, bstrides = window(node)  # type: ignore[misc]
    # set copies f32 or i32 values as they are; acc adds f32
    name = instance("set_window", "int" if a.dtype.name == "i32" else "float", node.op == "acc")
    n = node.size
    args = SetWindowArgs(ptr(a), ptr(bt), ptr(node), n, layout(a), node.params["offset"] // a.dtype.block_bytes,
                         *wstrides, *sizes, *bstrides)
    return [KernelSpec(LAYOUT_CU, name, stride_grid(n, sms), BLOCK, args)]


def timestep_specs(node: Tensor, ptr: Ptr, sms: int) -> list[KernelSpec]:
    t = node.srcs[0]
    rows, dim = node.shape
    args = TimestepArgs(t=ptr(t), out=ptr(node), rows=rows, dim=dim, ts0=t.strides[0],
                        log_max_period=math.log(node.params["max_period"]))
    return [KernelSpec(LAYOUT_CU, "timestep_embedding", stride_grid(node.size, sms), BLOCK, args)]
