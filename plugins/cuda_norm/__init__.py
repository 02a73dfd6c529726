"""The cuda_norm plugin: norm, rms_norm, l2_norm, group_norm on f32; rms_norm/norm -> mul (-> add) fused.

The kernels are kernels/norm.cu: one block per row (or channel group),
float sums reduced with warp shuffles, float4 variants where alignment
allows. A bind is split in two: `row_spec`/`group_spec` pick the kernel
instance, grid, block and arguments from shapes, strides and addresses
(pure, so tests check them without a GPU), and `launch_spec` makes the
pre-bound launch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.devices import warp32_gate
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.hookspecs import PRIORITY_BUILTIN, Device, FusionRule, Kernel, Launch, PluginInfo, hookimpl
from opdispatch.ops.base import pad4
from opdispatch.tensor import Tensor

from . import fusion, support

if TYPE_CHECKING:
    from opdispatch.backends.cuda.backend import CudaContext

NORM_CU = Path(__file__).resolve().parent / "kernels" / "norm.cu"

#: norm.cu's MODE per op and its FUSE values
MODES = {"norm": 0, "rms_norm": 1, "l2_norm": 2}
FUSE_NONE, FUSE_MUL, FUSE_MUL_ADD = 0, 1, 2
#: threads per block the kernels are instantiated for
BLOCKS = (32, 128, 512, 1024)


#: the latency-bound configuration for few rows: float4s a thread keeps (norm.cu's PER), its block sizes,
#: and the most rows it is picked for (up to about two blocks per SM of an H200)
SMALL_PER = 2
SMALL_BLOCKS = (64, 128, 256, 512, 1024)
SMALL_ROWS = 256


def row_kernel(mode: int, block: int, vec: bool, fuse: int, per: int | None = None) -> str:
    tail = f", {per}" if per is not None else ""
    return f"norm_rows_f32<{mode}, {block}, {'true' if vec else 'false'}, {fuse}{tail}>"


def group_kernel(block: int, vec: bool) -> str:
    return f"group_norm_f32<{block}, {'true' if vec else 'false'}>"


#: every instance the specs below can name, compiled as one module
NAME_EXPRESSIONS: tuple[str, ...] = (
    *(row_kernel(mode, block, vec, fuse)
      for mode in MODES.values() for block in BLOCKS for vec in (False, True)
      for fuse in ((FUSE_NONE,) if mode == MODES["l2_norm"] else (FUSE_NONE, FUSE_MUL, FUSE_MUL_ADD))),
    *(row_kernel(mode, block, True, fuse, SMALL_PER)
      for mode in MODES.values() for block in SMALL_BLOCKS
      for fuse in ((FUSE_NONE,) if mode == MODES["l2_norm"] else (FUSE_NONE, FUSE_MUL, FUSE_MUL_ADD))),
    *(group_kernel(block, vec) for block in BLOCKS for vec in (False, True)),
)

#: each .cu of this plugin and the instances launched from it (tests/test_kernels_compile.py compiles them)
KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {NORM_CU: NAME_EXPRESSIONS}

Ptr = Callable[[Tensor], int]


def pick_block(units: int) -> int:
    """Threads per block for a row of `units` loads (floats or float4s): up to 8 loads a thread, so a
    float4 row of up to 8192 loads (32768 floats) fits norm.cu's register cache (CACHE = 8)."""
    for block, most in ((32, 128), (128, 1024), (512, 4096)):
        if units <= most:
            return block
    return 1024


def pick_small_block(units: int, rows: int) -> int | None:
    """The block of the latency-bound configuration for `rows` float4 rows of `units` loads, or None
    where the throughput configuration (pick_block, up to 8 loads a thread) fits better: few rows
    (a decode step's single token) leave most SMs idle, so each row gets enough threads that every
    one does at most SMALL_PER loads, and the weight/residual loads are issued before the reduction."""
    if not 0 < rows <= SMALL_ROWS:
        return None
    for block in SMALL_BLOCKS:
        if units <= SMALL_PER * block:
            return block
    return None


def _elements(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides in elements, padded to 4 dims."""
    pad = 4 - t.ndim
    return pad4(t.shape), (0,) * pad + tuple(s // t.dtype.block_bytes for s in t.strides)


def _vec_rows(t: Tensor, ptr: Ptr) -> bool:
    """Every row of `t` starts 16-byte aligned (row lengths are checked by the caller)."""
    shape, strides = _elements(t)
    return ptr(t) % 16 == 0 and all(s % 4 == 0 for n, s in zip(shape[:3], strides[:3]) if n > 1)


def _operand_args(t: Tensor | None, ptr: Ptr) -> tuple[np.generic, ...]:
    """A weight or residual as norm_rows_f32 takes it: pointer, 4 dims, 3 outer strides."""
    if t is None:
        return (np.uint64(0), *(np.int32(1),) * 4, *(np.int64(0),) * 3)
    shape, strides = _elements(t)
    return (np.uint64(ptr(t)), *(np.int32(n) for n in shape), *(np.int64(s) for s in strides[:3]))


def row_spec(op: str, x: Tensor, out: Tensor, eps: float, ptr: Ptr,
             weight: Tensor | None = None, residual: Tensor | None = None) -> KernelSpec:
    """norm_rows_f32 for `op` of x into the contiguous `out`, times `weight` plus `residual` if given."""
    shape, strides = _elements(x)
    ncols = shape[3]
    extra = [t for t in (weight, residual) if t is not None]
    vec = (ncols % 4 == 0 and _vec_rows(x, ptr) and ptr(out) % 16 == 0
           and all(t.shape[-1] == ncols and _vec_rows(t, ptr) for t in extra))
    rows = math.prod(shape[:3]) if ncols else 0
    small = pick_small_block(ncols // 4, rows) if vec else None
    block = small or pick_block(ncols // 4 if vec else ncols)
    fuse = FUSE_MUL_ADD if residual is not None else FUSE_MUL if weight is not None else FUSE_NONE
    args = (np.uint64(ptr(x)), np.uint64(ptr(out)), np.int32(ncols), np.float32(eps),
            np.int32(shape[1]), np.int32(shape[2]), *(np.int64(s) for s in strides[:3]),
            *_operand_args(weight, ptr), *_operand_args(residual, ptr))
    kernel = row_kernel(MODES[op], block, vec, fuse, SMALL_PER if small else None)
    return KernelSpec(NORM_CU, kernel, rows, block, args)


def group_spec(x: Tensor, out: Tensor, groups: int, eps: float, ptr: Ptr) -> KernelSpec:
    """group_norm_f32 of x (N, C, H, W) into the contiguous `out`."""
    (n, c, h, w), strides = _elements(x)
    hw = h * w
    per_group = -(-c // groups)
    vec = hw % 4 == 0 and (n == 1 or strides[0] % 4 == 0) and ptr(x) % 16 == 0 and ptr(out) % 16 == 0
    block = pick_block(per_group * hw // 4 if vec else per_group * hw)
    args = (np.uint64(ptr(x)), np.uint64(ptr(out)), np.int32(c), np.int32(hw), np.int32(per_group),
            np.int32(groups), np.int64(strides[0]), np.float32(eps))
    return KernelSpec(NORM_CU, group_kernel(block, vec), n * groups if x.size else 0, block, args)


def launch_spec(ctx: CudaContext, spec: KernelSpec) -> Launch:
    """The pre-bound launch of `spec` on the context's stream."""
    return spec.launch(ctx.stream)


def bind_row_norm(ctx: CudaContext, node: Tensor) -> Launch:
    return launch_spec(ctx, row_spec(node.op, node.srcs[0], node, node.params["eps"], ctx.ptr))


def bind_group_norm(ctx: CudaContext, node: Tensor) -> Launch:
    return launch_spec(ctx, group_spec(node.srcs[0], node, node.params["groups"], node.params["eps"], ctx.ptr))


def bind_fused(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    norm = nodes[0]
    return launch_spec(ctx, row_spec(norm.op, norm.srcs[0], nodes[-1], norm.params["eps"], ctx.ptr,
                                 *fusion.operands(nodes)))


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda_norm", "0.1.0", PRIORITY_BUILTIN,
                      "norm, rms_norm, l2_norm, group_norm; rms_norm/norm + mul (+ add) fusion")


@hookimpl
def supports_op(device: Device, node: Tensor) -> bool | str | None:
    """Plugin-wide gate: the kernels assume 32-lane warps."""
    return warp32_gate(device)


@hookimpl
def kernels(device: Device) -> Iterator[Kernel]:
    if device.kind != "cuda":
        return
    for op in ("norm", "rms_norm", "l2_norm"):
        yield Kernel(op, bind_row_norm, support.row_norm, name=f"{op}_f32")
    yield Kernel("group_norm", bind_group_norm, support.group_norm, name="group_norm_f32")


@hookimpl
def fusion_rules(device: Device) -> Iterator[FusionRule]:
    """The longer group first: dispatch takes the first rule whose check passes."""
    if device.kind != "cuda":
        return
    for op in ("rms_norm", "norm"):
        yield FusionRule(f"{op}_mul_add", (op, "mul", "add"), bind=bind_fused, check=fusion.check)
        yield FusionRule(f"{op}_mul", (op, "mul"), bind=bind_fused, check=fusion.check)
