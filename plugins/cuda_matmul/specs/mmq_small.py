"""kernels/mmq_small.cu's launch (the weight-streaming quantized GEMM for 9 .. support.MMQ_SMALL_MAX_N
columns): its configuration (rows a warp, warps a block, ring, K tile, the split's aim), the split of K,
the shared memory it mirrors, its instances and the spec (quantize_q8_1, then mmq_small).

The split and shared memory are pure functions of the shapes and the device's facts, so that support.py
says on a device description whether a node fits, and the tests check the grid without a GPU.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from opdispatch.backends.cuda.args import KernelArgs, i32, i64, instance, ptr
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.hookspecs import Device
from opdispatch.tensor import Tensor

from . import MMQ_SMALL_CU, W_KIND, Ptr, Scratch, addr, geometry
from . import mmv  # a module import: mmv imports support, which imports this module
from .mmq import MMQ_FORMATS, GemmHead, gemm_head, row_stride
from .stream import device_facts


@attrs.frozen
class SmallConfig:
    """mmq_small's tunables. Template: each warp owns 16 fm weight rows, a block `warps` warps, each warp a
    ring of `stages` K tiles of `kb` steps of 32 values. Launch: K is cut in slices so that the grid has about
    `blocks_per_sm` blocks an SM, each slice at least `kt_min` K tiles (and at most `split_max` slices).
    The defaults: the least time summed over q4_0 and q4_K at the 1b preset's layer shapes, 16 columns, of
    `scripts/mmq_sweep.py --kernel mmq_small` on the H200 (2026-12-02; 8 warps, where 4 had been the first guess),
    the weights in flight an SM (blocks_per_sm * warps * (stages - 1) K tiles of 16 fm rows) about 160 KB for
    q4_0."""

    fm: int = 1
    warps: int = 8
    stages: int = 4
    kb: int = 8
    blocks_per_sm: int = 4
    kt_min: int = 2
    split_max: int = 16

    @property
    def bm(self) -> int:
        return 16 * self.fm * self.warps


#: the configuration binds use (support.MMQ_SMALL_MAX_N: the most columns)
SMALL = SmallConfig()
#: what scripts/mmq_sweep.py --kernel mmq_small times (SMALL first): one tunable changed at a time around the first
#: guess (4 warps a block), and a few that put more weights in flight an SM (deeper rings, more warps or blocks,
#: 32-step K tiles)
W4 = SmallConfig(warps=4)
SMALL_CANDIDATES: tuple[SmallConfig, ...] = tuple(dict.fromkeys((
    SMALL,
    W4,
    *(attrs.evolve(W4, stages=ns) for ns in (3, 6)),
    *(SmallConfig(warps=w, blocks_per_sm=b) for w, b in ((8, 2), (8, 4), (2, 8))),
    *(attrs.evolve(W4, fm=2, stages=ns, blocks_per_sm=b) for ns, b in ((4, 4), (3, 2))),
    *(attrs.evolve(W4, kb=16, stages=ns, kt_min=kt) for ns, kt in ((3, 2), (4, 1))),
    *(attrs.evolve(W4, blocks_per_sm=b) for b in (2, 8)),
    attrs.evolve(W4, kt_min=4),
    SmallConfig(warps=8, stages=6, blocks_per_sm=2),
)))
#: the column tiles (8 columns each) mmq_small is compiled for: N <= 16 takes 2, N <= 32 takes 4
SMALL_NTS = (2, 4)


def small_nt(n: int) -> int:
    """The fewest compiled column tiles that hold n columns."""
    return next(nt for nt in SMALL_NTS if 8 * nt >= n)


def small_name(dt: str, nt: int, cfg: SmallConfig = SMALL) -> str:
    return instance("mmq_small", W_KIND[dt], nt, cfg.fm, cfg.warps, cfg.stages, cfg.kb)


#: every instance the binds launch: each of mmq's formats, each column tile count
NAMES: tuple[str, ...] = tuple(small_name(dt, nt) for dt in MMQ_FORMATS for nt in SMALL_NTS)


@attrs.frozen
class SmallArgs(KernelArgs):
    """mmq_small's arguments: the head, the bias as mmq's (specs/mmq.py's MmqArgs), the cut, split K's scratch,
    preload."""

    KERNELS = ("mmq_small",)
    _head: GemmHead = attrs.field()
    bias: np.uint64 = ptr()
    bias_col: np.int64 = i64()
    tiles_m: np.int32 = i32()
    splits: np.int32 = i32()
    kts: np.int32 = i32()
    part: np.uint64 = ptr()
    counters: np.uint64 = ptr()
    preload: np.int32 = i32()


@attrs.frozen
class SmallGrid:
    """A launch's cut: row tiles, K slices, and the most K tiles a slice holds (b's copy is sized by it)."""

    tiles_m: int
    splits: int
    kts: int


def small_grid(m: int, k: int, batches: int, device: Device | None, cfg: SmallConfig = SMALL) -> SmallGrid:
    """Row tiles of cfg.bm rows, and K's slices: enough for cfg.blocks_per_sm blocks an SM over the grid, at
    most one per kt_min K tiles and split_max."""
    tiles_m, nkt = math.ceil(m / cfg.bm), math.ceil(k // 32 / cfg.kb)
    want = math.ceil(cfg.blocks_per_sm * device_facts(device).sm_count / (tiles_m * batches))
    splits = max(1, min(want, nkt // cfg.kt_min, cfg.split_max))
    return SmallGrid(tiles_m, splits, math.ceil(nkt / splits))


def small_smem(dt: str, nt: int, kts: int, cfg: SmallConfig = SMALL) -> int:
    """Dynamic shared memory of a block: b's slice (codes and scales of 8 nt columns, each padded to an odd
    number of granules), then each warp's ring."""
    b_col = (kts * cfg.kb * 32 + 16) + (kts * cfg.kb * 8 + 16)
    return 8 * nt * b_col + cfg.warps * cfg.stages * 16 * cfg.fm * row_stride(dt, cfg.kb)


def small_fits(node: Tensor, device: Device | None, cfg: SmallConfig = SMALL) -> bool:
    """True if mul_mat `node`'s launch fits the device's shared memory (None: an H200)."""
    a = node.srcs[0]
    (b3, b2, n, _), _ = geometry(node)
    grid = small_grid(a.shape[-2], a.shape[-1], b3 * b2, device, cfg)
    return small_smem(a.dtype.name, small_nt(n), grid.kts, cfg) <= device_facts(device).smem_per_block_optin


def small_specs(node: Tensor, ptr: Ptr, scratch: Scratch, device: Device | None = None,
                cfg: SmallConfig = SMALL, *, out: Tensor | None = None, bias: Tensor | None = None,
                bias_col: int = 0, quant: KernelSpec | None = None) -> list[KernelSpec]:
    """quantize_q8_1 of b into the scratch buffer "bq", then mmq_small, for mul_mat `node` (its path mmq_small);
    split K also takes the scratch buffers of the partial sums and of the row tiles' counters (zeroed once:
    the kernel sets them back). A fused mul_mat_add writes `out` (default node), adding `bias` as mmq_specs;
    `quant` as mmq_specs'."""
    a, b = node.srcs
    (_, _, m, k), _ = geometry(a)
    (b3, b2, n, _), _ = geometry(b)
    own = quant is None
    quant = mmv.quantize_spec(b, ptr(b), scratch) if own else quant
    q = quant.args
    dt, nt = a.dtype.name, small_nt(n)
    grid = small_grid(m, k, b3 * b2, device, cfg)
    part = counters = 0
    if grid.splits > 1:
        part = scratch("mmq partial sums", grid.splits * b3 * b2 * n * m * 4)
        counters = scratch("mmq split counters", b3 * b2 * grid.tiles_m * 4, zeroed=True)
    args = SmallArgs(head=gemm_head(node, node if out is None else out, ptr, q), bias=addr(ptr, bias),
                     bias_col=bias_col, tiles_m=grid.tiles_m, splits=grid.splits, kts=grid.kts, part=part,
                     counters=counters, preload=mmv._preload(a))
    return [quant] * own + [KernelSpec(MMQ_SMALL_CU, small_name(dt, nt, cfg), (grid.tiles_m * grid.splits, b2, b3),
                                       32 * cfg.warps, args, smem=small_smem(dt, nt, grid.kts, cfg))]
