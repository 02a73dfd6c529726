"""kernels/mmq_id.cu's launch (mul_mat_id with many tokens on the quantized GEMM): its configurations, the
bound on its column tiles that fixes the grid, its shared memory and argument record, and the spec: moe_route
with a tile table, quantize_q8_1 of b, then mmq_id.

The grid is a function of the shapes only (tiles_m row tiles times `max_tiles` column tiles, however the ids
fall), so the three launches replay in a CUDA graph without a host synchronization; the blocks beyond the
routing's tile count exit at once.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from opdispatch.backends.cuda.args import ArgGroup, Guard, KernelArgs, i32, i64, ptr
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.hookspecs import Device
from opdispatch.tensor import Tensor

from . import MMQ_ID_CU, Ptr, Scratch, addr, mmq_id_name
from . import mmv  # a module import: mmv imports support, which imports this module
from .mmq import MMQ_FORMATS, MmqConfig, candidates, mmq_config, mmq_smem
from .stream import device_facts

#: the mean pairs an expert up to which mmq_id takes the configuration of mmq's table for 32 columns (64 x 32
#: tiles: an expert's last tile, partly empty, wastes less); above it, the table's many-column one (128 x 64). Both
#: unsplit (splits 1). Not yet timed for mmq_id on the H200 (scripts/mmq_sweep.py --kernel mmq_id).
SMALL_MEAN = 32
#: bytes of a column's entries before the ring in shared memory: its pair and its b row (ints)
COLUMN_BYTES = 8


#: what scripts/mmq_sweep.py --kernel mmq_id times (besides mmq_id_config's two): mmq's candidates for 32 columns
#: and more, unsplit
CANDIDATES: tuple[MmqConfig, ...] = tuple(dict.fromkeys(
    attrs.evolve(cfg, splits=1) for n in (32, 64, 128, 2**31) for cfg in candidates(n)))


def instance_name(dt: str, cfg: MmqConfig) -> str:
    return mmq_id_name(dt, cfg.template)


def mmq_id_config(dt: str, pairs: int, experts: int) -> MmqConfig:
    """The configuration of format dt for `pairs` (token, slot) pairs over `experts` experts, by the mean pairs an
    expert: mmq's table's (specs/mmq.py) for SMALL_MEAN columns or for the most, unsplit."""
    mean = math.ceil(pairs / max(1, experts))
    return attrs.evolve(mmq_config(dt, SMALL_MEAN if mean <= SMALL_MEAN else 2**31), splits=1)


#: every instance mmq_id_config names (two a format mmq takes)
NAMES: tuple[str, ...] = tuple(dict.fromkeys(instance_name(dt, mmq_id_config(dt, mean, 1))
                                             for dt in MMQ_FORMATS for mean in (SMALL_MEAN, 2**31)))


@attrs.frozen
class RoutedExperts(ArgGroup):
    """The parameters mul_mat_id's quantized GEMMs (mmq_id, mmq_wgmma_id) open with, alike: the experts as_ (rows
    a_row, experts a_e bytes apart, E of them), moe_route's table (`pairs` = T * U pairs, room for max_tiles column
    tiles), the slots U and b's rows a token Ub."""

    as_: np.uint64 = ptr()
    a_row: np.int64 = i64()
    a_e: np.int64 = i64()
    E: np.int32 = i32()
    route: np.uint64 = ptr()
    pairs: np.int32 = i32()
    max_tiles: np.int32 = i32()
    U: np.int32 = i32()
    Ub: np.int32 = i32()


def routed_experts(node: Tensor, ptr: Ptr, route: KernelSpec, tiles: int) -> RoutedExperts:
    """RoutedExperts of mul_mat_id `node` with moe_route's spec `route`, its table's room `tiles`."""
    as_, b, ids = node.srcs
    t, u = ids.shape
    return RoutedExperts(as_=ptr(as_), a_row=as_.strides[1], a_e=as_.strides[0], E=as_.shape[0],
                         route=route.args.route, pairs=t * u, max_tiles=tiles, U=u, Ub=b.shape[1])


@attrs.frozen
class MmqIdArgs(KernelArgs):
    KERNELS = ("mmq_id",)
    _head: RoutedExperts = attrs.field()
    bq: np.uint64 = ptr()
    bds: np.uint64 = ptr()
    nbp: np.int32 = i32()
    out: np.uint64 = ptr()
    M: np.int32 = i32()
    K: np.int32 = i32()
    bias: np.uint64 = ptr()
    bias_e: np.int64 = i64()


def max_tiles(pairs: int, experts: int, bn: int) -> int:
    """The most column tiles of bn pairs any routing of `pairs` pairs over `experts` experts makes: each
    used expert's pairs fill whole tiles but its last, so sum ceil(c_e / bn) <= ceil(pairs / bn) + used,
    and at most min(experts, pairs) experts are used."""
    return math.ceil(pairs / bn) + min(experts, pairs)


def mmq_id_smem(dt: str, cfg: MmqConfig) -> int:
    """Dynamic shared memory of an mmq_id block: the columns' pairs and b rows, then mmq's stages."""
    return COLUMN_BYTES * cfg.bn + mmq_smem(dt, cfg)


def mmq_id_fits(dt: str, pairs: int, experts: int, device: Device | None) -> bool:
    """True if the configuration for this many pairs fits the device's shared memory (None: an H200)."""
    return mmq_id_smem(dt, mmq_id_config(dt, pairs, experts)) <= device_facts(device).smem_per_block_optin


def mmq_id_specs(node: Tensor, out: Tensor, ptr: Ptr, scratch: Scratch, guard: Guard, *,
                 bias: Tensor | None = None, cfg: MmqConfig | None = None) -> list[KernelSpec]:
    """moe_route (its tile table for the configuration's column tiles; the ids checked by `guard`'s IndexCheck),
    quantize_q8_1 of b into the scratch buffer "bq", then mmq_id, for mul_mat_id `node` (its path mmq_id) writing
    `out` (node, or a fused add_id of the expert biases `bias`), with `cfg` (default mmq_id_config's)."""
    as_, b, ids = node.srcs
    e, m, k = as_.shape
    t, u = ids.shape
    pairs = t * u
    dt = as_.dtype.name
    cfg = cfg or mmq_id_config(dt, pairs, e)
    tiles = max_tiles(pairs, e, cfg.bn)
    route = mmv.route_spec(node, out, ptr, scratch, guard, tile_n=cfg.bn, tiles=tiles)
    quant = mmv.quantize_spec(b, ptr(b), scratch)
    q = quant.args
    args = MmqIdArgs(head=routed_experts(node, ptr, route, tiles), bq=q.bq, bds=q.bds, nbp=q.nbp, out=ptr(out), M=m,
                     K=k, bias=addr(ptr, bias), bias_e=bias.strides[0] if bias is not None else 0)
    grid = (math.ceil(m / cfg.bm) * tiles,)
    return [route, quant, KernelSpec(MMQ_ID_CU, instance_name(dt, cfg), grid, cfg.threads, args,
                                     smem=mmq_id_smem(dt, cfg))]
