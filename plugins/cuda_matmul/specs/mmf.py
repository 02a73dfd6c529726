"""kernels/mmf.cu's launch (the tensor-core mat-mul for few columns): its argument record, the constants it
mirrors, the split of K that spreads a node over the SMs, and the spec function.

A block computes `ROWS` output rows over one split of K (`MmfSplit.ks` values), b's split rounded to a's
type in shared memory; with several splits each block stores a partial tile in the scratch buffer
"mmf partials" and the last block of a row block (counters in the zeroed scratch "mmf counters") sums
them in order and applies the epilogue.
"""

from __future__ import annotations

import math
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

WARPS = 4  # mmf.cu's WARPS: warps a block
THREADS = 32 * WARPS
ROWS = 16 * WARPS  # mmf.cu's ROWS: output rows a block
UNIT = 32  # k values a unit (mmf.cu's UNIT); a split is whole units
UNIT_BYTES = 64  # bytes of a unit of a b column in shared memory
TSTRIDE = ROWS + 4  # mmf.cu's TSTRIDE: floats a column of the result tile

#: blocks an SM the split of K aims at (with WARPS warps: 16 warps an SM)
BLOCKS_PER_SM = 4
#: most splits of K (the last block of a row block sums this many partial tiles)
SPLIT_MAX = 16
#: fewest units (of 32 k) a split takes, so that a block's setup (b's copy) is worth its weights
SPLIT_UNITS_MIN = 4
#: most k values a split takes: b's split in shared memory, 64 KB at 16 columns
KS_MAX = 2048


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
    """How a node's K is split: `splits` splits of `ks` values (the last one shorter or equal)."""

    splits: int
    ks: int


def split_k(m: int, k: int, batches: int, sm_count: int) -> MmfSplit:
    """The split of K for M rows and `batches` batches on `sm_count` SMs: about BLOCKS_PER_SM blocks an SM,
    between the fewest splits whose b fits (KS_MAX) and the most that keep SPLIT_UNITS_MIN units a split
    (at most SPLIT_MAX); splits of whole units, none empty."""
    units = -(-k // UNIT)
    blocks = -(-m // ROWS) * batches
    fewest = -(-units // (KS_MAX // UNIT))
    most = max(fewest, min(SPLIT_MAX, units // SPLIT_UNITS_MIN))
    want = max(1, round(sm_count * BLOCKS_PER_SM / blocks))
    per = -(-units // min(max(want, fewest), most))
    return MmfSplit(-(-units // per), per * UNIT)


def n_tiles(n: int) -> int:
    """8-column tiles the kernel is compiled with for N columns (1 or 2)."""
    return 1 if n <= 8 else 2


def smem_bytes(n: int, ks: int, glu: bool) -> int:
    """mmf's dynamic shared memory: b's split (units * NB columns * 64 bytes) and the result tile."""
    nb = 8 * n_tiles(n)
    return -(-ks // UNIT) * nb * UNIT_BYTES + (2 if glu else 1) * nb * TSTRIDE * 4


def addresses_ok(ptr: Ptr, a: Tensor, a1: Tensor | None) -> bool:
    """The weights (and a1) start 16-byte aligned: the kernel reads them with 16-byte loads (the strides are
    support.mmf_ok's)."""
    return ptr(a) % 16 == 0 and (a1 is None or ptr(a1) % 16 == 0)


def mmf_specs(node: Tensor, out: Tensor, ptr: Ptr, scratch: Scratch, *, a1: Tensor | None = None,
              bias0: Tensor | None = None, bias1: Tensor | None = None, glu: Tensor | None = None,
              device: Device | None = None) -> list[KernelSpec]:
    """The mmf launch for mul_mat `node` (support.choose's "mmf") writing `out` (node, or the last node
    of a fused group: a bias, or glu of `node` and the product of a1 with the same b) on `device`
    (None: an H200's description). The caller checks `addresses_ok`."""
    a, b = node.srcs
    (a3, a2, m, k), (sa3, sa2, sa1, _) = geometry(a)
    (b3, b2, n, _), (sb3, sb2, sb1, _) = geometry(b)
    epi, tail = _epilogue(ptr, glu, bias0, bias1)
    batches = b2 * b3
    sp = split_k(m, k, batches, device_facts(device).sm_count)
    rbs = math.ceil(m / ROWS)
    part = counters = 0
    if sp.splits > 1:
        tile = (2 if epi == EPI_GLU else 1) * 8 * n_tiles(n) * ROWS * 4
        part = scratch("mmf partials", batches * rbs * sp.splits * tile)
        counters = scratch("mmf counters", batches * rbs * 4, zeroed=True)
    head = MatvecHead(a0=ptr(a), a1=addr(ptr, a1), a_row=sa1, a_s2=sa2, a_s3=sa3, r2=b2 // a2, r3=b3 // a3,
                      b=ptr(b), b_col=sb1, b_es=elem_stride(b), b_s2=sb2, b_s3=sb3, out=ptr(out), M=m, K=k, N=n, **tail)
    args = MmfArgs(head=head, ks=sp.ks, splits=sp.splits, part=part, counters=counters, preload=_preload(a, a1))
    return [KernelSpec(MMF_CU, mmf_name(a.dtype.name, n_tiles(n), epi), (rbs * sp.splits, b2, b3), THREADS, args,
                       smem=smem_bytes(n, sp.ks, epi == EPI_GLU))]


def mmf_fused_specs(nodes: Sequence[Tensor], ptr: Ptr, scratch: Scratch, device: Device | None = None
                    ) -> list[KernelSpec]:
    """A mul_mat group of fusion.PATTERNS (bias, gate/up GLU) whose products take mmf: one mmf launch
    writing the group's last node. Raises ValueError when the weights are not 16-byte aligned (the
    unfused nodes fall back to cuBLAS then; an arena aligns every tensor to 256 bytes)."""
    prods, biases, glu = fusion.parts(nodes)
    a1 = prods[1].srcs[0] if glu is not None else None
    if not addresses_ok(ptr, prods[0].srcs[0], a1):
        raise ValueError(f"mmf: the weights of {prods[0].describe()} are not 16-byte aligned")
    return mmf_specs(prods[0], nodes[-1], ptr, scratch, a1=a1, bias0=biases[0],
                     bias1=biases[1] if glu is not None else None, glu=glu, device=device)
