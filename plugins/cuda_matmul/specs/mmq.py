"""kernels/mmq.cu's launch (the quantized GEMM for block-format weights and N > 8 columns): its argument
record, its configurations (tile, ring, K tile, split-K), the table that picks one per column count, the
candidates scripts/mmq_sweep.py times, the shared memory it mirrors, and the spec (quantize_q8_1, then mmq).

The Python mirror of the kernel's stage layout lets support.py say on a device description whether a
configuration's stages fit in shared memory, and lets the tests check it against the source.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from opdispatch.backends.cuda.args import ArgGroup, KernelArgs, i32, i64, ptr
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.hookspecs import Device
from opdispatch.tensor import Tensor

from opdispatch.dtypes import DTYPES

from . import GRID_NAMES, LEGACY_NAMES, MMQ_CU, SUBSCALED_NAMES, Ptr, Scratch, addr, geometry, mmq_name
from . import mmv  # a module import: mmv imports support, which imports this module
from .stream import STREAMED, device_facts

#: bytes of a b column's codes and of its scales in a stage, per weight block of a K tile (mmq.cu's
#: Tile::BROW and BDS are these times KB, plus one granule)
BROW_PER_BLOCK, BDS_PER_BLOCK = 32, 8
#: the formats whose fragments carry mins (mmq_common.cuh's MINS16 mode): their converted tile (a8) keeps them
MINS16_NAMES = ("q2_K",)


@attrs.frozen
class MmqConfig:
    """An mmq configuration. Template: a warp computes 16 fm rows x 8 fn columns, a block has wm x wn warps,
    a ring of `stages` stages of `kb` K steps of 32 values (a K tile) each; with `a8` the block decodes each K
    tile's weights once into int8 fragments in shared memory, which every warp reads (k_loop's A8: for tiles
    whose rows several warps share). Launch: each row's K tiles are cut in `splits` slices, one block each
    (fewer when K has fewer than two K tiles a slice)."""

    fm: int
    fn: int
    wm: int
    wn: int
    stages: int
    kb: int
    splits: int
    a8: bool = False

    @property
    def bm(self) -> int:
        return 16 * self.fm * self.wm

    @property
    def bn(self) -> int:
        return 8 * self.fn * self.wn

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    @property
    def template(self) -> tuple[int, ...]:
        """The kernel's template parameters after the weight kind (A8 named only when set: it defaults to false)."""
        return (self.fm, self.fn, self.wm, self.wn, self.stages, self.kb) + ((True,) if self.a8 else ())

    def __str__(self) -> str:
        return (f"{self.bm}x{self.bn} w{self.wm}x{self.wn} ns{self.stages} kb{self.kb} s{self.splits}"
                + (" a8" if self.a8 else ""))


#: (most columns, configuration) read top to bottom: the one line to edit after a sweep
#: (scripts/mmq_sweep.py). Few columns are memory-bound: 64-row tiles of all the columns, split-K
#: across blocks so that the grid is a few waves, deep rings; many are compute-bound: 128 x 64 tiles
#: (each weight fragment serves 8 mma, each b fragment 2), no split.
TABLE: tuple[tuple[int, MmqConfig], ...] = (
    # the least time summed over q4_0 and q8_0 at M 4096, K 14336 in scripts/mmq_sweep.py (H200, 2026-12-02)
    (16, MmqConfig(fm=1, fn=2, wm=4, wn=1, stages=3, kb=8, splits=16)),
    (32, MmqConfig(fm=1, fn=2, wm=4, wn=2, stages=4, kb=8, splits=8)),
    (64, MmqConfig(fm=1, fn=4, wm=4, wn=2, stages=3, kb=8, splits=4)),
    (128, MmqConfig(fm=2, fn=4, wm=4, wn=2, stages=3, kb=8, splits=2)),
    (2**31, MmqConfig(fm=2, fn=4, wm=4, wn=2, stages=2, kb=8, splits=1)),
)


def _variants(fm: int, fn: int, wm: int, wn: int, stages: tuple[int, ...], kbs: tuple[int, ...],
              splits: tuple[int, ...], a8: bool = False) -> tuple[MmqConfig, ...]:
    return tuple(MmqConfig(fm, fn, wm, wn, s, kb, sp, a8) for s in stages for kb in kbs for sp in splits)


#: the converted-tile (a8) configurations for many columns, not yet in the tables (untimed): 128 x 128 blocks of
#: 8 warps of 64 x 32 (each A fragment feeds 4 mma, each b fragment 4) or 32 x 64 (8 and 2), and today's 128 x 64
#: tiles with a8 (3 stages); two stages for the 128 x 128 ones, whose ring and converted tile fill 160 to 200 KB
#: (q8_0) of shared memory: one block an SM
A8_WIDE = MmqConfig(fm=4, fn=4, wm=2, wn=4, stages=2, kb=8, splits=1, a8=True)
A8_TALL = MmqConfig(fm=2, fn=8, wm=4, wn=2, stages=2, kb=8, splits=1, a8=True)
A8_64 = MmqConfig(fm=2, fn=4, wm=4, wn=2, stages=3, kb=8, splits=1, a8=True)


#: the sub-scaled formats' table (K tiles of 8 K steps: one 256-value super-block, or 8 iq4_nl / mxfp4
#: blocks): TABLE's configurations for N <= 64, its 128-column one above (N > 128 only when tests lift
#: support.MMQ_MAX_N), so that each format compiles four instances. scripts/mmq_sweep.py --formats q4_K,q6_K
#: --ns 16,64 on the H200 (4096 x 14336, docs/benchmarks.md): at 16 columns 8 splits (q4_K 47.9 us, q6_K
#: 58.2) against 16 (50.7, 60.3), the least summed; at 64 columns this entry was the best for both (106.2 and
#: 126.2 us). N = 32 and 128 not yet timed.
TABLE_K: tuple[tuple[int, MmqConfig], ...] = (
    (16, MmqConfig(fm=1, fn=2, wm=4, wn=1, stages=3, kb=8, splits=8)),
    (32, MmqConfig(fm=1, fn=2, wm=4, wn=2, stages=4, kb=8, splits=8)),
    (64, MmqConfig(fm=1, fn=4, wm=4, wn=2, stages=3, kb=8, splits=4)),
    (2**31, MmqConfig(fm=2, fn=4, wm=4, wn=2, stages=3, kb=8, splits=2)),
)

#: what scripts/mmq_sweep.py times for each entry of TABLE (the entry itself too), on q4_0 and q8_0
CANDIDATES: dict[int, tuple[MmqConfig, ...]] = {
    16: (*_variants(1, 2, 4, 1, (3, 4, 6), (8,), (4, 8, 16)), *_variants(2, 2, 4, 1, (4,), (8,), (8, 16)),
         *_variants(1, 2, 4, 1, (3,), (16,), (8,)),
         # for small weights (the 1b preset's K = 2048: 8 K tiles a row): 32-row blocks, or 8 warps of 8 columns
         *_variants(1, 2, 2, 1, (3, 4), (8,), (2, 4)), *_variants(1, 1, 4, 2, (3,), (8,), (2, 4))),
    32: (*_variants(1, 4, 4, 1, (4, 6), (8,), (4, 8, 16)), *_variants(1, 2, 4, 2, (4,), (8,), (8,))),
    64: (*_variants(1, 4, 4, 2, (3, 4), (8,), (2, 4, 8)), *_variants(2, 4, 4, 2, (3,), (8,), (2, 4))),
    128: (*_variants(2, 4, 4, 2, (2, 3), (8,), (1, 2)), *_variants(4, 4, 2, 4, (2,), (8,), (1, 2)),
          *(attrs.evolve(A8_WIDE, splits=s) for s in (2, 4)), attrs.evolve(A8_64, splits=2)),
    2**31: (*_variants(2, 4, 4, 2, (2, 3), (8,), (1,)), *_variants(4, 4, 2, 4, (2, 3), (8,), (1,)),
            *_variants(2, 8, 4, 1, (2,), (8,), (1,)), A8_WIDE, A8_TALL, A8_64),
}
#: the formats the sweep times by default (the compile test builds every candidate for them)
SWEEP_FORMATS = ("q4_0", "q8_0")
#: the legacy formats and quant_k.cuh's (those opdispatch.dtypes knows)
MMQ_FORMATS = (*LEGACY_NAMES, *(q for q in SUBSCALED_NAMES if q not in GRID_NAMES))


def table(dt: str) -> tuple[tuple[int, MmqConfig], ...]:
    """The selection table of format dt: TABLE (legacy formats) or TABLE_K (sub-scaled)."""
    return TABLE if dt in LEGACY_NAMES else TABLE_K


def candidates(n: int) -> tuple[MmqConfig, ...]:
    """The configurations scripts/mmq_sweep.py times for n columns (any format)."""
    return next(cands for most, cands in CANDIDATES.items() if n <= most)


def instance_name(dt: str, cfg: MmqConfig) -> str:
    return mmq_name(dt, cfg.template)


#: every instance the tables launch (each block format) or the sweep times (its default formats)
NAMES: tuple[str, ...] = tuple(dict.fromkeys(
    [instance_name(dt, cfg) for dt in MMQ_FORMATS for _, cfg in table(dt)]
    + [instance_name(dt, cfg) for dt in SWEEP_FORMATS for cands in CANDIDATES.values() for cfg in cands]))


@attrs.frozen
class GemmHead(ArgGroup):
    """The parameters mmq and mmq_small open with, alike: the weights a, their row and batch strides and b's
    broadcast ratios r2, r3; b's q8_1 codes bq and scales bds (quantize_q8_1's, nbp blocks a row); out and the
    sizes."""

    a: np.uint64 = ptr()
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


def gemm_head(node: Tensor, out: Tensor, ptr: Ptr, q: mmv.QuantizeArgs) -> GemmHead:
    """GemmHead of mul_mat `node` whose b quantize_q8_1 (arguments q) rounded, writing `out` (node, or the add
    of a fused group)."""
    a, b = node.srcs
    (a3, a2, m, k), (sa3, sa2, sa1, _) = geometry(a)
    (b3, b2, n, _), _ = geometry(b)
    return GemmHead(a=ptr(a), a_row=sa1, a_s2=sa2, a_s3=sa3, r2=b2 // a2, r3=b3 // a3, bq=q.bq, bds=q.bds, nbp=q.nbp,
                    out=ptr(out), M=m, K=k, N=n)


@attrs.frozen
class MmqArgs(KernelArgs):
    """mmq's arguments: the head, the bias (0: none) and its row stride bias_col in floats (0: one row added to
    every output row, else a residual addend's), the grid's tiles and split K's scratch, preload."""

    KERNELS = ("mmq",)
    _head: GemmHead = attrs.field()
    bias: np.uint64 = ptr()
    bias_col: np.int64 = i64()
    tiles_m: np.int32 = i32()
    tiles_n: np.int32 = i32()
    splits: np.int32 = i32()
    part: np.uint64 = ptr()
    counters: np.uint64 = ptr()
    preload: np.int32 = i32()


def mmq_config(dt: str, n: int) -> MmqConfig:
    """The configuration of format dt's table for n columns."""
    return next(cfg for most, cfg in table(dt) if n <= most)


def row_stride(dt: str, kb: int) -> int:
    """Bytes of a weight row's K tile in a stage (mmq.cu's Tile::RS): the granules covering kb K steps'
    blocks wherever they start (whole granules for the legacy formats), an odd number of them."""
    raw = kb * 32 // DTYPES[dt].block_size * STREAMED[dt][0]
    granules = raw // 16 if raw % 16 == 0 else (raw + 2 * 15) // 16
    return 16 * (granules if granules % 2 == 1 else granules + 1)


def conv_bytes(dt: str, cfg: MmqConfig) -> int:
    """Bytes of the converted K tile of an a8 configuration (mmq_common.cuh's Conv::BYTES), 0 without a8: each
    (16-row tile, K step) fragment's codes (32 lanes x 16 bytes) and its 8 row pairs' scales (16 bytes, 32 with
    mins)."""
    frags = cfg.bm // 16 * cfg.kb
    return frags * (32 * 16 + 8 * (32 if dt in MINS16_NAMES else 16)) if cfg.a8 else 0


def mmq_smem(dt: str, cfg: MmqConfig) -> int:
    """Dynamic shared memory of an mmq block: its stages, then the converted K tile (a8)."""
    b_col = BROW_PER_BLOCK * cfg.kb + 16 + BDS_PER_BLOCK * cfg.kb + 16
    return cfg.stages * (cfg.bm * row_stride(dt, cfg.kb) + cfg.bn * b_col) + conv_bytes(dt, cfg)


def mmq_fits(dt: str, n: int, device: Device | None, cfg: MmqConfig | None = None) -> bool:
    """True if the configuration for n columns (dt's table's unless given) fits the device's shared memory
    (None: an H200)."""
    return mmq_smem(dt, cfg or mmq_config(dt, n)) <= device_facts(device).smem_per_block_optin


def mmq_splits(cfg: MmqConfig, k: int) -> int:
    """The K slices a launch uses: the configuration's, at most one per two K tiles."""
    return max(1, min(cfg.splits, math.ceil(k // 32 / cfg.kb) // 2))


def mmq_addresses(ptr: Ptr, a: Tensor) -> bool:
    """The weights 16-byte aligned on the device (support.mmq_ok checks the strides)."""
    return ptr(a) % 16 == 0


def mmq_specs(node: Tensor, ptr: Ptr, scratch: Scratch, cfg: MmqConfig | None = None, *, out: Tensor | None = None,
              bias: Tensor | None = None, bias_col: int = 0, quant: KernelSpec | None = None) -> list[KernelSpec]:
    """quantize_q8_1 of b into the scratch buffer "bq", then mmq, for mul_mat `node` (its path mmq), with
    `cfg` (default its format's table's for its columns); split K also takes the scratch buffers of the partial sums and
    of the tiles' counters (zeroed once: the kernel sets them back). A fused mul_mat_add writes `out` (default
    node), adding `bias` (rows bias_col floats apart, 0 for one row: fusion.bias_col). `quant`: b's quantize_q8_1
    launch made by the caller (a fused group's, which quantizes once for its products): mmq alone."""
    a, b = node.srcs
    (_, _, m, k), _ = geometry(a)
    (b3, b2, n, _), _ = geometry(b)
    own = quant is None
    quant = mmv.quantize_spec(b, ptr(b), scratch) if own else quant
    q = quant.args
    dt = a.dtype.name
    cfg = cfg or mmq_config(dt, n)
    tiles_m, tiles_n, splits = math.ceil(m / cfg.bm), math.ceil(n / cfg.bn), mmq_splits(cfg, k)
    part = counters = 0
    if splits > 1:
        part = scratch("mmq partial sums", splits * b3 * b2 * n * m * 4)
        counters = scratch("mmq split counters", b3 * b2 * tiles_m * tiles_n * 4, zeroed=True)
    args = MmqArgs(head=gemm_head(node, node if out is None else out, ptr, q), bias=addr(ptr, bias),
                   bias_col=bias_col, tiles_m=tiles_m, tiles_n=tiles_n, splits=splits, part=part, counters=counters,
                   preload=mmv._preload(a))
    grid = (tiles_m * splits * tiles_n, b2, b3)
    return [quant] * own + [KernelSpec(MMQ_CU, instance_name(dt, cfg), grid, cfg.threads, args, smem=mmq_smem(dt, cfg))]
