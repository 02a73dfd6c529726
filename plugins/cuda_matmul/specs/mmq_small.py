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
from .stream import SMEM_PER_BLOCK_RESERVED, device_facts


@attrs.frozen
class SmallConfig:
    """mmq_small's tunables. Template: each warp owns 16 fm weight rows, a block `warps` warps in row groups of
    `kw` (each warp of a group every kw-th K tile of the block's slice), each warp a ring of `stages` K tiles
    of `kb` steps of 32 values. Launch: K is cut in slices so that the grid has about `blocks_per_sm` blocks an
    SM (`within`: at most that many, so that a grid of the blocks an SM holds is one wave), each slice at least
    `kt_min` K tiles a warp (kt_min * kw a slice), at most `kts_max` K tiles (b's copy in shared memory) where
    `split_max` slices allow.
    The defaults: the least time summed over q4_0 and q4_K at the 1b preset's layer shapes, 16 columns, of
    `scripts/mmq_sweep.py --kernel mmq_small` on the H200 (2026-12-02; 8 warps, where 4 had been the first guess);
    2 stages since 2026-12-03 (4 before): at the 1b preset's slices a warp streams two K tiles, so a deeper ring
    only costs shared memory, and for q8_0, q5_1 and q6_K 4 stages (over 100 KB a block) left one block an SM
    (16 columns, cold: q8_0 8192 x 2048 16.8 -> 12.9 us, 2048 x 8192 18.2 -> 14.1; q4_0, q4_K, q5_K, iq4_xs 1-5%
    faster; docs/benchmarks.md, session 24). SMALL cuts K `within` 2 blocks an SM, what the launch bound leaves
    resident, since 2026-12-05 (at least 4 before: the 1b preset's gate/up pair, one 16384 x 2048 grid, was 512
    blocks, two waves; now 256): the 1b batch-16 decode took 0.94x the time in q4_0 and 0.91x in Q4_K_M, the
    single 16-column layer products within 1.1% (docs/benchmarks.md, session 39)."""

    fm: int = 1
    warps: int = 8
    stages: int = 2
    kb: int = 8
    kw: int = 1
    blocks_per_sm: int = 4
    kt_min: int = 2
    kts_max: int = 64
    split_max: int = 16
    within: bool = False

    @property
    def bm(self) -> int:
        return 16 * self.fm * self.warps // self.kw


#: the configuration binds use for large weights (specs/mmq_small.small_config)
SMALL = SmallConfig(blocks_per_sm=2, within=True)
#: ... and for small ones, where its grid is one wave: k-groups of 4 warps over 16-step K tiles, 32 rows a block.
#: At the 1b preset's q/k/v and o shapes, 16 columns, cold (scripts/mmq_sweep.py, H200, 2026-12-02; us, SMALL's
#: in brackets): q4_0 3072x2048 9.6 (12.3), 2048x2048 8.6 (11.5); q4_K 11.1 (13.5), 9.9 (12.9); q8_0 10.4 / 10.0
#: (mmq 12.8 / 12.1). Its grid of 8192x2048 or 2048x8192 is two waves: 18.3 / 25.5 us for q4_0 against SMALL's
#: 16.1 / 17.7.
SMALL_WAVE = SmallConfig(kw=4, kb=16, stages=2, kt_min=1, kts_max=4)
#: what scripts/mmq_sweep.py --kernel mmq_small times (SMALL first): row groups of 2 to 8 warps that split a
#: block's K tiles (kw), short rings (a warp streams one or two K tiles at the 1b preset's shapes), 32-row warps
#: (fm 2: b read once for twice the rows), 16 warps a block, and SMALL_WAVE's 16-step K tiles; slices of at most
#: 8 K tiles (2048 values: b's copy 40 KB at 16 columns); SMALL's ring 3 and 4 stages deep; and grids of one wave
#: at large shapes (ONE_WAVE)
KW8 = SmallConfig(kw=8, stages=2, kt_min=1, kts_max=8)
#: SMALL (one wave of two resident blocks an SM) with a ring of 3, two K tiles in flight a warp, and slices of at
#: least 4, 7 or 8 K tiles: fewer, longer slices where the wave is not full (16384 x 2048, the 1b preset's gate/up
#: pair: 2 slices, 256 blocks with kt_min 4, 1 and 128 with 7 or 8)
ONE_WAVE: tuple[SmallConfig, ...] = tuple(attrs.evolve(SMALL, kt_min=kt, stages=3) for kt in (4, 7, 8))
SMALL_CANDIDATES: tuple[SmallConfig, ...] = tuple(dict.fromkeys((
    SMALL,
    SmallConfig(),  # SMALL before session 38: at least 4 blocks an SM, two waves of resident blocks
    SMALL_WAVE,
    KW8,
    attrs.evolve(KW8, stages=3),
    attrs.evolve(KW8, blocks_per_sm=8),
    *(attrs.evolve(KW8, kw=kw, stages=3) for kw in (2, 4)),
    SmallConfig(warps=4, kw=4, stages=2, kt_min=1, blocks_per_sm=8),
    attrs.evolve(KW8, fm=2),
    attrs.evolve(KW8, fm=2, kw=4),
    attrs.evolve(KW8, warps=16, blocks_per_sm=2),
    attrs.evolve(SMALL, stages=3),
    attrs.evolve(SMALL, stages=4),
    *ONE_WAVE,
)))
#: the column tiles (8 columns each) mmq_small is compiled for: N <= 16 takes 2, N <= 32 takes 4
SMALL_NTS = (2, 4)


def small_nt(n: int) -> int:
    """The fewest compiled column tiles that hold n columns."""
    return next(nt for nt in SMALL_NTS if 8 * nt >= n)


def small_name(dt: str, nt: int, cfg: SmallConfig = SMALL) -> str:
    return instance("mmq_small", W_KIND[dt], nt, cfg.fm, cfg.warps, cfg.stages, cfg.kb, cfg.kw)


#: every instance the binds launch: each of mmq's formats, each column tile count, both configurations
NAMES: tuple[str, ...] = tuple(small_name(dt, nt, cfg) for cfg in (SMALL, SMALL_WAVE) for dt in MMQ_FORMATS
                               for nt in SMALL_NTS)


@attrs.frozen
class SmallArgs(KernelArgs):
    """mmq_small's arguments: the head, the bias as mmq's (specs/mmq.py's MmqArgs), the cut, split K's scratch,
    preload, and a pair's second weights and output (0: one product)."""

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
    a1: np.uint64 = ptr()
    out1: np.uint64 = ptr()


@attrs.frozen
class SmallGrid:
    """A launch's cut: row tiles, K slices, and the most K tiles a slice holds (b's copy is sized by it)."""

    tiles_m: int
    splits: int
    kts: int


def small_grid(m: int, k: int, batches: int, device: Device | None, cfg: SmallConfig = SMALL) -> SmallGrid:
    """Row tiles of cfg.bm rows, and K's slices: enough for cfg.blocks_per_sm blocks an SM over the grid (within: as
    many as keep it at most that), or more where a slice would hold over kts_max K tiles; at most one per kt_min K
    tiles a warp (kt_min * kw a slice) and split_max."""
    tiles_m, nkt = math.ceil(m / cfg.bm), math.ceil(k // 32 / cfg.kb)
    blocks = cfg.blocks_per_sm * device_facts(device).sm_count
    want = blocks // (tiles_m * batches) if cfg.within else math.ceil(blocks / (tiles_m * batches))
    want = max(want, math.ceil(nkt / cfg.kts_max))
    splits = max(1, min(want, nkt // (cfg.kt_min * cfg.kw), cfg.split_max))
    return SmallGrid(tiles_m, splits, math.ceil(nkt / splits))


def small_smem(dt: str, nt: int, kts: int, cfg: SmallConfig = SMALL) -> int:
    """Dynamic shared memory of a block: b's slice (codes and scales of 8 nt columns, each padded to an odd
    number of granules), then each warp's ring."""
    b_col = (kts * cfg.kb * 32 + 16) + (kts * cfg.kb * 8 + 16)
    return 8 * nt * b_col + cfg.warps * cfg.stages * 16 * cfg.fm * row_stride(dt, cfg.kb)


def one_wave(node: Tensor, device: Device | None, cfg: SmallConfig) -> bool:
    """True if mul_mat `node`'s grid under cfg fits the device at once (None: an H200): every block resident, by
    shared memory (the launch bound leaves registers for two blocks of 8 warps an SM)."""
    a = node.srcs[0]
    (b3, b2, n, _), _ = geometry(node)
    grid = small_grid(a.shape[-2], a.shape[-1], b3 * b2, device, cfg)
    facts = device_facts(device)
    smem = small_smem(a.dtype.name, small_nt(n), grid.kts, cfg)
    if smem > facts.smem_per_block_optin:
        return False
    resident = facts.sm_count * (facts.smem_per_sm // (smem + SMEM_PER_BLOCK_RESERVED))
    return grid.tiles_m * grid.splits * b3 * b2 <= resident


def small_config(node: Tensor, device: Device | None) -> SmallConfig:
    """The configuration mul_mat `node` takes: SMALL_WAVE where its grid is one wave, else SMALL."""
    return SMALL_WAVE if one_wave(node, device, SMALL_WAVE) else SMALL


def small_fits(node: Tensor, device: Device | None, cfg: SmallConfig | None = None) -> bool:
    """True if mul_mat `node`'s launch under cfg (None: small_config's) fits the device's shared memory (None: an
    H200)."""
    a = node.srcs[0]
    (b3, b2, n, _), _ = geometry(node)
    cfg = small_config(node, device) if cfg is None else cfg
    grid = small_grid(a.shape[-2], a.shape[-1], b3 * b2, device, cfg)
    return small_smem(a.dtype.name, small_nt(n), grid.kts, cfg) <= device_facts(device).smem_per_block_optin


def small_specs(node: Tensor, ptr: Ptr, scratch: Scratch, device: Device | None = None,
                cfg: SmallConfig | None = None, *, out: Tensor | None = None, bias: Tensor | None = None,
                bias_col: int = 0, quant: KernelSpec | None = None, second: Tensor | None = None) -> list[KernelSpec]:
    """quantize_q8_1 of b into the scratch buffer "bq", then mmq_small (under cfg; None: small_config's), for
    mul_mat `node` (its path mmq_small);
    split K also takes the scratch buffers of the partial sums and of the row tiles' counters (zeroed once:
    the kernel sets them back). A fused mul_mat_add writes `out` (default node), adding `bias` as mmq_specs;
    `quant` as mmq_specs'. `second` (pair_ok with node) runs in the same launch, its K split as if the two
    were one product of twice the rows."""
    if second is not None and (bias is not None or pair_ok(node, second) is not True):
        raise ValueError(f"mmq_small: {node.describe()} and {second.describe()} are no pair")
    copies = 1 if second is None else 2
    a, b = node.srcs
    (_, _, m, k), _ = geometry(a)
    (b3, b2, n, _), _ = geometry(b)
    own = quant is None
    quant = mmv.quantize_spec(b, ptr(b), scratch) if own else quant
    q = quant.args
    dt, nt = a.dtype.name, small_nt(n)
    cfg = small_config(node, device) if cfg is None else cfg
    grid = small_grid(m, k, b3 * b2 * copies, device, cfg)
    part = counters = 0
    if grid.splits > 1:
        part = scratch("mmq partial sums", copies * grid.splits * b3 * b2 * n * m * 4)
        counters = scratch("mmq split counters", copies * b3 * b2 * grid.tiles_m * 4, zeroed=True)
    args = SmallArgs(head=gemm_head(node, node if out is None else out, ptr, q), bias=addr(ptr, bias),
                     bias_col=bias_col, tiles_m=grid.tiles_m, splits=grid.splits, kts=grid.kts, part=part,
                     counters=counters, preload=mmv._preload(a),
                     a1=0 if second is None else ptr(second.srcs[0]), out1=addr(ptr, second))
    return [quant] * own + [KernelSpec(MMQ_SMALL_CU, small_name(dt, nt, cfg),
                                       (copies * grid.tiles_m * grid.splits, b2, b3), 32 * cfg.warps, args,
                                       smem=small_smem(dt, nt, grid.kts, cfg))]


def pair_ok(node: Tensor, second: Tensor) -> bool | str:
    """True if mul_mat `second` can run in `node`'s mmq_small launch (the pair of the kernel's opening comment):
    the same b, weights of one dtype, shape and strides, outputs of one shape; else why not."""
    (a, b), (a1, b1) = node.srcs, second.srcs
    if b is not b1:
        return "the products read different b"
    if (a.dtype, a.shape, a.strides) != (a1.dtype, a1.shape, a1.strides) or node.shape != second.shape:
        return "the weights differ in dtype, shape or strides"
    return True
