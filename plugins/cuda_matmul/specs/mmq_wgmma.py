"""kernels/mmq_wgmma.cu's launch (the quantized GEMM for many columns on Hopper's wgmma): its tile, its shared
memory, its argument record and the spec (b converted to bf16, then mmq_wgmma)."""

from __future__ import annotations

import math

import attrs
import numpy as np

from opdispatch.backends.cuda.args import KernelArgs, i32, i64, ptr
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.hookspecs import Device
from opdispatch.tensor import Tensor

from . import MMQ_WGMMA_CU, QUANT_NAMES, Ptr, Scratch, geometry, mmq_wgmma_name
from .gemm import conversion
from .mmq import row_stride
from .stream import device_facts

#: the block's tile (mmq_wgmma.cu's mw::BM, BN, BK) and threads (two warpgroups)
BM, BN, BK, THREADS = 128, 128, 64, 256
#: the raw weights' K tile in K steps of 32 (mw::RAW_KB: mmq's Tile<Q, 8>) and its stages (mw::RAW_STAGES)
RAW_KB, RAW_STAGES = 8, 2
#: the formats it takes: every block format (quant.cuh's load_unit decodes each)
WGMMA_FORMATS = QUANT_NAMES


def wgmma_smem(dt: str) -> int:
    """Dynamic shared memory of a block for format dt: 2 stages of the dequantized weights (BM x BK bf16), 4 of b
    (BN x BK bf16), the slack that aligns them to 1024 bytes (the 128-byte swizzle's period), then the raw stages
    (BM rows of mmq's K tile of RAW_KB steps)."""
    return 2 * BM * BK * 2 + 4 * BN * BK * 2 + 1024 + RAW_STAGES * BM * row_stride(dt, RAW_KB)
NAMES: tuple[str, ...] = tuple(mmq_wgmma_name(dt) for dt in WGMMA_FORMATS)


@attrs.frozen
class MmqWgmmaArgs(KernelArgs):
    """mmq_wgmma's arguments: the weights a, their row and batch strides and b's broadcast ratios r2, r3; b as
    bf16 rows (the conversion's output); out and the sizes; the grid's tiles and split K's scratch."""

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


def wgmma_splits(tiles: int, k: int, device: Device | None) -> int:
    """The K slices of a launch of `tiles` output tiles (all batches): as many as one wave of one block an SM
    holds (a grid of few tiles, such as 2048 x 2048 weights at 512 columns, would leave most SMs idle), at most
    one a raw K tile."""
    return max(1, min(device_facts(device).sm_count // max(tiles, 1), math.ceil(k / (RAW_KB * 32))))


def wgmma_specs(node: Tensor, ptr: Ptr, scratch: Scratch, device: Device | None = None) -> list[KernelSpec]:
    """b converted to contiguous bf16 rows in the scratch buffer "b", then mmq_wgmma, for mul_mat `node` (its path
    mmq_wgmma) on `device` (None: an H200); split K also takes the scratch buffers of the partial sums and of the
    tiles' counters (zeroed once: the kernel sets them back)."""
    a, b = node.srcs
    (a3, a2, m, k), (sa3, sa2, sa1, _) = geometry(a)
    (b3, b2, n, _), _ = geometry(b)
    tiles_m, tiles_n = math.ceil(m / BM), math.ceil(n / BN)
    splits = wgmma_splits(tiles_m * tiles_n * b2 * b3, k, device)
    part = counters = 0
    if splits > 1:
        part = scratch("mmq_wgmma partial sums", splits * b3 * b2 * n * m * 4)
        counters = scratch("mmq_wgmma split counters", b3 * b2 * tiles_m * tiles_n * 4, zeroed=True)
    bf = scratch("b", b3 * b2 * n * k * 2)
    args = MmqWgmmaArgs(a=ptr(a), a_row=sa1, a_s2=sa2, a_s3=sa3, r2=b2 // a2, r3=b3 // a3, b=bf, out=ptr(node), M=m,
                        K=k, N=n, tiles_m=tiles_m, tiles_n=tiles_n, splits=splits, part=part, counters=counters)
    return [conversion(b, "bf16", ptr(b), bf),
            KernelSpec(MMQ_WGMMA_CU, mmq_wgmma_name(a.dtype.name), (tiles_m * splits * tiles_n, b2, b3), THREADS,
                       args, smem=wgmma_smem(a.dtype.name))]
