"""kernels/mmq_wgmma.cu's launches (the quantized GEMM for many columns on Hopper's wgmma): its tiles, its shared
memory, its argument records and the specs: mul_mat's (b converted to bf16, then mmq_wgmma) and mul_mat_id's
(moe_route's tile table, b converted to bf16, then mmq_wgmma_id: MoE prefill)."""

from __future__ import annotations

import math

import attrs
import numpy as np

from opdispatch.backends.cuda.args import Guard, KernelArgs, i32, i64, instance, ptr
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.hookspecs import Device
from opdispatch.tensor import Tensor

from . import MMQ_WGMMA_CU, QUANT_NAMES, W_KIND, Ptr, Scratch, addr, geometry
from . import mmv  # a module import: mmv imports support, which imports this module
from .gemm import conversion
from .mmq import MMQ_FORMATS, row_stride
from .mmq_id import COLUMN_BYTES, RoutedExperts, max_tiles, routed_experts
from .stream import device_facts

#: the K tile (kernels/mmq_frags.cuh's mw::BK)
BK = 64
#: the raw weights' K tile in K steps of 32 (mmq_frags.cuh's mw::RAW_KB: mmq's Tile<Q, 8>) and its stages
#: (mmq_wgmma.cu's mw::RAW_STAGES)
RAW_KB, RAW_STAGES = 8, 2
#: the formats it takes: every block format (quant.cuh's load_unit decodes each)
WGMMA_FORMATS = QUANT_NAMES
#: the formats whose A fragments are built in registers straight from the raw stage (mmq_frags.cuh's
#: RS_FORMAT): they hold no A stages
RS_FORMATS = ("q4_0", "q8_0", "q4_K", "q5_K", "q6_K")
#: the most b stages of the RS formats' warp-specialized loop and the shared memory they are sized to (mmq_wgmma.cu's
#: mw::WS_B_MAX, mw::SMEM_BUDGET: compute capability 9.0's 227 KB a block less 2 KB for the static barriers and
#: mmq_wgmma_id's pairs and b rows)
WS_B_MAX, WS_SMEM_BUDGET = 8, 227 * 1024 - 2048
#: the raw stages of the warp-specialized loop where 4 b stages fit beside them (mw::WS_RAW_STAGES)
WS_RAW_STAGES = 3


@attrs.frozen
class WgmmaTile:
    """A block's tile (mmq_wgmma.cu's Tiling): `warpgroups` of 128 threads, 64 weight rows each (bm rows); `bn`
    columns, one m64n{bn} accumulator a warpgroup (64, 128 or 256)."""

    warpgroups: int = 2
    bn: int = 128

    @property
    def bm(self) -> int:
        return 64 * self.warpgroups

    def threads(self, dt: str) -> int:
        """A block's threads for format dt: the computing warpgroups, and for RS_FORMATS one more that only
        copies (mmq_wgmma.cu's warp-specialized loop)."""
        return 128 * (self.warpgroups + (dt in RS_FORMATS))


#: the narrow and the wide tile (tile_for picks one); the compile test builds both for every format. Two
#: warpgroups: three (192 rows) were slower at 512 columns on the H200 but for 4160 x 4096 at 300 columns.
NARROW, WIDE = WgmmaTile(2, 128), WgmmaTile(2, 256)
TILES: tuple[WgmmaTile, ...] = (NARROW, WIDE)
#: the fewest K values a block of the wide tile runs (its launch's K over its split) for tile_for to take it
WIDE_MIN_K = 2048


def tile_for(m: int, n: int, k: int, batches: int = 1, device: Device | None = None) -> WgmmaTile:
    """The tile of a launch of m x k weights and n columns (in `batches` batches) on `device`: WIDE above 128
    columns where each of its blocks runs at least WIDE_MIN_K values of K (after wgmma_splits cuts K for a grid of
    few tiles), else NARROW. A block's start (the first copies) and end (the split's sum) weigh on a short K loop,
    and the narrow tile's grid has twice the blocks: on the H200 (2026-12-05, q4_0 and q4_K, 300 to 2048 columns)
    NARROW took 0.82-0.92x WIDE's time at 3072 x 2048 and 2048 x 2048 weights and 300-1024 columns (wide blocks
    of 512-1024 values of K), WIDE 0.70-0.87x NARROW's at 8192 x 2048, 16384 x 2048, 2048 x 8192, 4096 x 14336
    and 14336 x 4096 (2048 values or more), and 4096 x 4096 at 300 and 512 columns (2048) within 2% either way.
    At 128 columns or fewer WIDE's tile is half padding (1.77x NARROW's time at 128)."""
    if n <= NARROW.bn:
        return NARROW
    tiles = math.ceil(m / WIDE.bm) * math.ceil(n / WIDE.bn) * batches
    return WIDE if k / wgmma_splits(tiles, k, device) >= WIDE_MIN_K else NARROW


def node_tile(node: Tensor, device: Device | None = None) -> WgmmaTile:
    """tile_for's tile of mul_mat `node` on `device`."""
    a, b = node.srcs
    (_, _, m, k), _ = geometry(a)
    (b3, b2, n, _), _ = geometry(b)
    return tile_for(m, n, k, b3 * b2, device)


def instance_name(dt: str, tile: WgmmaTile) -> str:
    return instance("mmq_wgmma", W_KIND[dt], tile.warpgroups, tile.bn)


def _b_fit(dt: str, tile: WgmmaTile, raw_stages: int) -> int:
    """b's stages that fit in WS_SMEM_BUDGET beside raw_stages raw stages (mmq_wgmma.cu's Stages::fit)."""
    return (WS_SMEM_BUDGET - 1024 - raw_stages * tile.bm * row_stride(dt, RAW_KB)) // (tile.bn * BK * 2)


def raw_stages(dt: str, tile: WgmmaTile) -> int:
    """The raw stages of a block for format dt and `tile` (Stages::NR): RAW_STAGES, or for RS_FORMATS
    WS_RAW_STAGES where 4 b stages still fit beside them."""
    return WS_RAW_STAGES if dt in RS_FORMATS and _b_fit(dt, tile, WS_RAW_STAGES) >= 4 else RAW_STAGES


def b_stages(dt: str, tile: WgmmaTile) -> int:
    """b's stages in a block for format dt and `tile` (Stages::NB): 4 (mw::B_STAGES) for the formats dequantized
    into A stages; for RS_FORMATS (the warp-specialized loop) as many as fit beside the raw stages, up to
    WS_B_MAX."""
    return min(WS_B_MAX, _b_fit(dt, tile, raw_stages(dt, tile))) if dt in RS_FORMATS else 4


def wgmma_smem(dt: str, tile: WgmmaTile) -> int:
    """Dynamic shared memory of a block for format dt and `tile`: 2 stages of the dequantized weights (bm x BK
    bf16; none for RS_FORMATS), b_stages of b (bn x BK bf16), the slack that aligns them to 1024 bytes (the 128-byte
    swizzle's period), then raw_stages raw stages (bm rows of mmq's K tile of RAW_KB steps)."""
    a_stages = 0 if dt in RS_FORMATS else 2
    return (a_stages * tile.bm * BK * 2 + b_stages(dt, tile) * tile.bn * BK * 2 + 1024
            + raw_stages(dt, tile) * tile.bm * row_stride(dt, RAW_KB))


#: mmq_wgmma_id's tile: column tiles of 128 (token, slot) pairs an expert (moe_route's tile_n); ID_TILES are those
#: scripts/mmq_sweep.py times (64 pairs a column tile: fewer empty columns where an expert has few more than 64, half
#: the products to pay for each weight tile's dequantization)
ID_TILE = NARROW
ID_TILES: tuple[WgmmaTile, ...] = (ID_TILE, WgmmaTile(2, 64))


def id_instance_name(dt: str, tile: WgmmaTile | None = None) -> str:
    tile = tile or ID_TILE
    return instance("mmq_wgmma_id", W_KIND[dt], tile.warpgroups, tile.bn)


def wgmma_id_smem(dt: str, tile: WgmmaTile | None = None) -> int:
    """Dynamic shared memory of an mmq_wgmma_id block in `tile` (None: ID_TILE): its columns' pairs and b rows, then
    wgmma_smem's."""
    tile = tile or ID_TILE
    return COLUMN_BYTES * tile.bn + wgmma_smem(dt, tile)


NAMES: tuple[str, ...] = (*(instance_name(dt, t) for dt in WGMMA_FORMATS for t in TILES),
                          *(id_instance_name(dt) for dt in MMQ_FORMATS))  # mmq_wgmma_id: every format of mmq_id


@attrs.frozen
class MmqWgmmaArgs(KernelArgs):
    """mmq_wgmma's arguments: the weights a, their row and batch strides and b's broadcast ratios r2, r3; b as
    bf16 rows (the conversion's output); out and the sizes; the grid's tiles and split K's scratch; the bias (0:
    none) and its row stride bias_col in floats (0: one row), as mmq's."""

    KERNELS = ("mmq_wgmma",)
    a: np.uint64 = ptr()
    a_row: np.int64 = i64()
    a_s2: np.int64 = i64()
    a_s3: np.int64 = i64()
    r2: np.int32 = i32()
    r3: np.int32 = i32()
    b: np.uint64 = ptr()
    out: np.uint64 = ptr()
    M: np.int32 = i32()
    K: np.int32 = i32()
    N: np.int32 = i32()
    tiles_m: np.int32 = i32()
    tiles_n: np.int32 = i32()
    splits: np.int32 = i32()
    part: np.uint64 = ptr()
    counters: np.uint64 = ptr()
    bias: np.uint64 = ptr()
    bias_col: np.int64 = i64()


def b_bytes(rows: int, k: int) -> int:
    """Bytes of b's bf16 rows for `rows` columns of K values (all batches), as the kernel reads them: the widest
    column tile's rows more (read past the last column, never used)."""
    return (rows + max(t.bn for t in TILES)) * k * 2


def wgmma_splits(tiles: int, k: int, device: Device | None) -> int:
    """The K slices of a launch of `tiles` output tiles (all batches): as many as one wave of one block an SM
    holds (a grid of few tiles, such as 2048 x 2048 weights at 512 columns, would leave most SMs idle), at most
    one a raw K tile."""
    return max(1, min(device_facts(device).sm_count // max(tiles, 1), math.ceil(k / (RAW_KB * 32))))


def wgmma_specs(node: Tensor, ptr: Ptr, scratch: Scratch, device: Device | None = None,
                tile: WgmmaTile | None = None, *, out: Tensor | None = None, b16: int | None = None,
                bias: Tensor | None = None, bias_col: int = 0) -> list[KernelSpec]:
    """b converted to contiguous bf16 rows in the scratch buffer "b" (b_bytes: with a tile's rows more, which the
    kernel reads past the last column and never uses), then mmq_wgmma in `tile` (None: node_tile's), for mul_mat
    `node` (its path mmq_wgmma) on `device` (None: an H200); split K also takes the scratch buffers of the partial
    sums and of the tiles' counters (zeroed once: the kernel sets them back). A fused group's: the result written
    to `out` (None: node), b's bf16 rows already at b16 (a fused rms_norm or glu wrote them, b_bytes of them: no
    conversion), `bias` added (rows bias_col floats apart, 0 for one row: fusion.bias_col)."""
    a, b = node.srcs
    (a3, a2, m, k), (sa3, sa2, sa1, _) = geometry(a)
    (b3, b2, n, _), _ = geometry(b)
    tile = tile or node_tile(node, device)
    tiles_m, tiles_n = math.ceil(m / tile.bm), math.ceil(n / tile.bn)
    splits = wgmma_splits(tiles_m * tiles_n * b2 * b3, k, device)
    part = counters = 0
    if splits > 1:
        part = scratch("mmq_wgmma partial sums", splits * b3 * b2 * n * m * 4)
        counters = scratch("mmq_wgmma split counters", b3 * b2 * tiles_m * tiles_n * 4, zeroed=True)
    convert = b16 is None
    bf = scratch("b", b_bytes(b3 * b2 * n, k)) if convert else b16
    args = MmqWgmmaArgs(a=ptr(a), a_row=sa1, a_s2=sa2, a_s3=sa3, r2=b2 // a2, r3=b3 // a3, b=bf,
                        out=ptr(node if out is None else out), M=m, K=k, N=n, tiles_m=tiles_m, tiles_n=tiles_n,
                        splits=splits, part=part, counters=counters, bias=addr(ptr, bias), bias_col=bias_col)
    return [*([conversion(b, "bf16", ptr(b), bf)] if convert else []),
            KernelSpec(MMQ_WGMMA_CU, instance_name(a.dtype.name, tile), (tiles_m * splits * tiles_n, b2, b3),
                       tile.threads(a.dtype.name), args, smem=wgmma_smem(a.dtype.name, tile))]


@attrs.frozen
class MmqWgmmaIdArgs(KernelArgs):
    """mmq_wgmma_id's arguments: mmq_id's but for b, bf16 rows (the conversion's output) in place of the q8_1 blocks."""

    KERNELS = ("mmq_wgmma_id",)
    _head: RoutedExperts = attrs.field()
    b: np.uint64 = ptr()
    out: np.uint64 = ptr()
    M: np.int32 = i32()
    K: np.int32 = i32()
    bias: np.uint64 = ptr()
    bias_e: np.int64 = i64()


def wgmma_id_specs(node: Tensor, out: Tensor, ptr: Ptr, scratch: Scratch, guard: Guard, *,
                   bias: Tensor | None = None, tile: WgmmaTile | None = None) -> list[KernelSpec]:
    """moe_route (its tile table for `tile`'s column tiles, None: ID_TILE; the ids checked by `guard`'s
    IndexCheck), b's T * Ub rows converted to bf16 in the scratch buffer "b", then mmq_wgmma_id, for mul_mat_id
    `node` (its path mmq_wgmma_id) writing `out` (node, or a fused add_id of the expert biases `bias`)."""
    as_, b, ids = node.srcs
    e, m, k = as_.shape
    t, u = ids.shape
    pairs = t * u
    tile = tile or ID_TILE
    tiles = max_tiles(pairs, e, tile.bn)
    route = mmv.route_spec(node, out, ptr, scratch, guard, tile_n=tile.bn, tiles=tiles)
    bf = scratch("b", b.shape[0] * b.shape[1] * k * 2)
    args = MmqWgmmaIdArgs(head=routed_experts(node, ptr, route, tiles), b=bf, out=ptr(out), M=m, K=k,
                          bias=addr(ptr, bias), bias_e=bias.strides[0] if bias is not None else 0)
    return [route, conversion(b, "bf16", ptr(b), bf),
            KernelSpec(MMQ_WGMMA_CU, id_instance_name(as_.dtype.name, tile), (math.ceil(m / tile.bm) * tiles,),
                       tile.threads(as_.dtype.name), args, smem=wgmma_id_smem(as_.dtype.name, tile))]
