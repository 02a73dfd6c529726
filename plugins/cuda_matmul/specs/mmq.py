"""kernels/mmq.cu's launch (the quantized GEMM for block-format weights and N > 8 columns): its argument
record, the tiles it is compiled for, the shared memory it mirrors, and the spec (quantize_q8_1, then mmq).

The Python mirror of the kernel's stage layout lets support.py say on a device description whether a
tile's stages fit in shared memory, and lets the tests check it against the source.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from opdispatch.backends.cuda.args import KernelArgs, i32, i64, ptr
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.hookspecs import Device
from opdispatch.tensor import Tensor

from . import MMQ_CU, MMQ_TILES, Ptr, Scratch, geometry, mmq_name
from . import mmv  # a module import: mmv imports support, which imports this module
from .stream import STREAM_FORMATS, device_facts

#: mmq.cu's stages, weight blocks a K tile, bytes of a b column's codes and of its scales in a stage
NS, KB, BROW, BDS = 3, 8, 2 * 8 * 16 + 16, 8 * 8 + 16


@attrs.frozen
class MmqTile:
    """mmq's template tile: a warp computes 16 fm rows x 8 fn columns; a block has wm x wn x wk warps
    (wk of them split each K tile's blocks and add up at the end)."""

    fm: int
    fn: int
    wm: int
    wn: int
    wk: int

    @property
    def bm(self) -> int:
        return 16 * self.fm * self.wm

    @property
    def bn(self) -> int:
        return 8 * self.fn * self.wn

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn * self.wk


#: (most columns, tile) read top to bottom: N <= 16 a 32 x 16 tile with the K tile split over 4 warps
#: (memory-bound: many blocks over M, 8 warps each); N <= 64 64 x 64 (split in 2); larger N 128 x 64
#: (compute-bound: each weight fragment serves 8 mma, each b fragment 2)
TILES: tuple[tuple[int, MmqTile], ...] = tuple((most, MmqTile(*tile)) for most, tile in MMQ_TILES)
MMQ_FORMATS = tuple(STREAM_FORMATS)


@attrs.frozen
class MmqArgs(KernelArgs):
    KERNELS = ("mmq",)
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
    tiles_m: np.int32 = i32()


def mmq_tile(n: int) -> MmqTile:
    return next(tile for most, tile in TILES if n <= most)


def row_stride(dt: str) -> int:
    """Bytes of a weight row's K tile in a stage (mmq.cu's Tile::RS): KB blocks, an odd number of granules."""
    raw = KB * STREAM_FORMATS[dt][0]
    return raw if (raw // 16) % 2 == 1 else raw + 16


def mmq_smem(dt: str, tile: MmqTile) -> int:
    """Dynamic shared memory of an mmq block: NS stages, or the split-K sums if larger."""
    stage = tile.bm * row_stride(dt) + tile.bn * (BROW + BDS)
    return max(NS * stage, tile.threads * tile.fm * tile.fn * 4 * 4 if tile.wk > 1 else 0)


def mmq_fits(dt: str, n: int, device: Device | None) -> bool:
    """True if the tile for n columns fits the device's shared memory (None: an H200)."""
    return mmq_smem(dt, mmq_tile(n)) <= device_facts(device).smem_per_block_optin


def mmq_addresses(ptr: Ptr, a: Tensor) -> bool:
    """The weights 16-byte aligned on the device (support.mmq_ok checks the strides)."""
    return ptr(a) % 16 == 0


def mmq_specs(node: Tensor, ptr: Ptr, scratch: Scratch) -> list[KernelSpec]:
    """quantize_q8_1 of b into the scratch buffer "bq", then mmq, for mul_mat `node` (its path mmq)."""
    a, b = node.srcs
    (a3, a2, m, k), (sa3, sa2, sa1, _) = geometry(a)
    (b3, b2, n, _), _ = geometry(b)
    quant = mmv.quantize_spec(b, ptr(b), scratch)
    q = quant.args
    tile = mmq_tile(n)
    tiles_m = math.ceil(m / tile.bm)
    args = MmqArgs(a=ptr(a), a_row=sa1, a_s2=sa2, a_s3=sa3, r2=b2 // a2, r3=b3 // a3, bq=q.bq, bds=q.bds, nbp=q.nbp,
                   out=ptr(node), M=m, K=k, N=n, tiles_m=tiles_m)
    grid = (tiles_m * math.ceil(n / tile.bn), b2, b3)
    dt = a.dtype.name
    name = mmq_name(dt, attrs.astuple(tile))
    return [quant, KernelSpec(MMQ_CU, name, grid, tile.threads, args, smem=mmq_smem(dt, tile))]
