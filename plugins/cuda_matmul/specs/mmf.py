"""kernels/mmf.cu's launch (the tensor-core mat-mul for few columns, a weight stream): its argument record,
the constants it mirrors, the split of the work over the SMs, and the spec function.

A warp streams 16-row warp tiles over one split of K (`MmfSplit.ks` values) through its ring of shared
memory; a block of `WARPS` warps holds b's split rounded to a's type in shared memory, staged once for all
its tiles (`MmfSplit.groups` blocks a split and batch: fewer than the row blocks make them persistent).
With several splits each warp stores a partial tile in the scratch buffer "mmf partials" and the last warp
of a tile (counters in the zeroed scratch "mmf counters") sums them in order and applies the epilogue.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.args import KernelArgs, i32, ptr
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.hookspecs import Device
from opdispatch.tensor import Tensor

from .. import fusion
from . import EPI_GLU, MMF_CU, MatvecHead, Ptr, Scratch, addr, elem_stride, geometry, mmf_name
from .mmv import _epilogue, _preload
from .stream import device_facts

WARPS = 8  # mmf.cu's WARPS: warps a block
THREADS = 32 * WARPS
TILE_ROWS = 16  # rows a warp tile (an mma's M)
UNIT = 32  # k values a unit (mmf.cu's UNIT)
UNIT_BYTES = 64  # bytes of a unit of a b column in shared memory
#: mmf.cu's rings: STAGES slots of STAGE_BYTES a warp
STAGES, STAGE_BYTES = 3, 4096
RING_BYTES = WARPS * STAGES * STAGE_BYTES
#: units a split is a multiple of: mmf.cu's group (U: 4 units, 2 for the gate/up pair), so that no split
#: but the last copies a partial group
SPLIT_STEP = 4

#: blocks an SM the grid aims at (a block's rings take 96 KB of shared memory: two blocks an SM, 16 warps
#: with two groups of 4 KB of weights in flight each)
BLOCKS_PER_SM = 2
#: most splits of K (the last warp of a tile sums this many partial tiles)
SPLIT_MAX = 16
#: fewest units (of 32 k) a split takes: two groups, so that a warp's second copy is in flight with its first
SPLIT_UNITS_MIN = 8
#: most k values a split takes: b's split in shared memory beside the rings, 16 KB at 16 columns (two
#: blocks an SM)
KS_MAX = 512


@attrs.frozen
class MmfArgs(KernelArgs):
    """mmf's arguments: the mat-vecs' head (b f32), then the split (ks, splits), the scratch (partials, counters), preload."""

    KERNELS = ("mmf",)
    _head: MatvecHead = attrs.field()
    ks: np.int32 = i32()
    splits: np.int32 = i32()
    part: np.uint64 = ptr()
    counters: np.uint64 = ptr()
    preload: np.int32 = i32()


@attrs.frozen
class MmfSplit:
    """How a node is spread: `splits` splits of `ks` values of K (the last one shorter or equal), `groups`
    blocks a split and batch (row groups), each taking every `groups`-th block of WARPS warp tiles."""

    splits: int
    ks: int
    groups: int


def split_k(m: int, k: int, batches: int, sm_count: int) -> MmfSplit:
    """The split for M rows, K and `batches` batches on `sm_count` SMs. The grid aims at BLOCKS_PER_SM
    blocks of WARPS warps an SM: K is split into as many splits as keep the warp tiles times the splits
    within that many warps, between the fewest splits whose b fits (KS_MAX) and the most that keep
    SPLIT_UNITS_MIN units a split (at most SPLIT_MAX); splits of whole SPLIT_STEP units, none empty. Then
    the row groups: about that many blocks, as few as give every warp the same most tiles (more tiles
    than warps make the blocks persistent over the rows)."""
    tiles = -(-m // TILE_ROWS)
    units = -(-k // UNIT)
    blocks = sm_count * BLOCKS_PER_SM
    fewest = -(-units // (KS_MAX // UNIT))
    most = max(fewest, min(SPLIT_MAX, units // SPLIT_UNITS_MIN))
    want = blocks * WARPS // (tiles * batches)
    per = -(-units // min(max(want, fewest), most))
    per = -(-per // SPLIT_STEP) * SPLIT_STEP
    splits = -(-units // per)
    aim = max(1, -(-blocks // (splits * batches)))
    per_warp = -(-tiles // (aim * WARPS))
    return MmfSplit(splits, per * UNIT, -(-tiles // (per_warp * WARPS)))


def node_split(node: Tensor, device: Device | None = None) -> MmfSplit:
    """split_k for mul_mat `node` on `device` (None: an H200's description)."""
    a, b = node.srcs
    (_, _, m, k), _ = geometry(a)
    (b3, b2, _, _), _ = geometry(b)
    return split_k(m, k, b2 * b3, device_facts(device).sm_count)


def smem_fits(node: Tensor, device: Device | None = None) -> bool | str:
    """True if mmf's shared memory for mul_mat `node` (the rings and b's split) fits a block of `device`
    (None: an H200's description), else why not."""
    need = smem_bytes(node.srcs[1].shape[-2], node_split(node, device).ks)
    limit = device_facts(device).smem_per_block_optin
    return True if need <= limit else f"mmf needs {need} bytes of shared memory a block, the device allows {limit}"


def n_tiles(n: int) -> int:
    """8-column tiles the kernel is compiled with for N columns (1 or 2)."""
    return 1 if n <= 8 else 2


def smem_bytes(n: int, ks: int) -> int:
    """mmf's dynamic shared memory: the warps' rings, then b's split, ks / 32 units of 8 * n_tiles(n) columns
    of 64 bytes."""
    return RING_BYTES + -(-ks // UNIT) * 8 * n_tiles(n) * UNIT_BYTES


def partial_bytes(m: int, n: int, batches: int, splits: int, glu: bool) -> int:
    """The scratch "mmf partials" of a split node: a partial tile (32 lanes' float4 a weight and 8-column
    tile) a warp tile, split and batch."""
    return batches * -(-m // TILE_ROWS) * splits * (2 if glu else 1) * n_tiles(n) * 32 * 16


def addresses_ok(ptr: Ptr, a: Tensor, a1: Tensor | None) -> bool:
    """The weights (and a1) start 16-byte aligned: the kernel reads them with 16-byte loads (the strides are
    support.mmf_ok's)."""
    return ptr(a) % 16 == 0 and (a1 is None or ptr(a1) % 16 == 0)


def mmf_specs(node: Tensor, out: Tensor, ptr: Ptr, scratch: Scratch, *, a1: Tensor | None = None,
              bias0: Tensor | None = None, bias1: Tensor | None = None, bias_col: int = 0, glu: Tensor | None = None,
              device: Device | None = None) -> list[KernelSpec]:
    """The mmf launch for mul_mat `node` (support.choose's "mmf") writing `out` (node, or the last node
    of a fused group: a bias or residual add, or glu of `node` and the product of a1 with the same b) on
    `device` (None: an H200's description); the biases' rows bias_col floats apart (0: one row,
    fusion.bias_col). The caller checks `addresses_ok`."""
    a, b = node.srcs
    (a3, a2, m, k), (sa3, sa2, sa1, _) = geometry(a)
    (b3, b2, n, _), (sb3, sb2, sb1, _) = geometry(b)
    epi, tail = _epilogue(ptr, glu, bias0, bias1)
    batches = b2 * b3
    sp = node_split(node, device)
    part = counters = 0
    if sp.splits > 1:
        part = scratch("mmf partials", partial_bytes(m, n, batches, sp.splits, epi == EPI_GLU))
        counters = scratch("mmf counters", batches * -(-m // TILE_ROWS) * 4, zeroed=True)
    head = MatvecHead(a0=ptr(a), a1=addr(ptr, a1), a_row=sa1, a_s2=sa2, a_s3=sa3, r2=b2 // a2, r3=b3 // a3,
                      b=ptr(b), b_col=sb1, b_es=elem_stride(b), b_s2=sb2, b_s3=sb3, out=ptr(out), M=m, K=k, N=n,
                      bias_col=bias_col, **tail)
    args = MmfArgs(head=head, ks=sp.ks, splits=sp.splits, part=part, counters=counters, preload=_preload(a, a1))
    return [KernelSpec(MMF_CU, mmf_name(a.dtype.name, n_tiles(n), epi), (sp.groups * sp.splits, b2, b3), THREADS,
                       args, smem=smem_bytes(n, sp.ks))]


def mmf_fused_specs(nodes: Sequence[Tensor], ptr: Ptr, scratch: Scratch, device: Device | None = None
                    ) -> list[KernelSpec]:
    """A mul_mat group of fusion.PATTERNS (bias or residual, gate/up GLU) whose products take mmf: one mmf launch
    writing the group's last node. Raises ValueError when the weights are not 16-byte aligned (the
    unfused nodes fall back to cuBLAS then; an arena aligns every tensor to 256 bytes)."""
    prods, biases, glu = fusion.parts(nodes)
    a1 = prods[1].srcs[0] if glu is not None else None
    if not addresses_ok(ptr, prods[0].srcs[0], a1):
        raise ValueError(f"mmf: the weights of {prods[0].describe()} are not 16-byte aligned")
    return mmf_specs(prods[0], nodes[-1], ptr, scratch, a1=a1, bias0=biases[0],
                     bias1=biases[1] if glu is not None else None, bias_col=fusion.bias_col(prods[0], biases[0]),
                     glu=glu, device=device)
