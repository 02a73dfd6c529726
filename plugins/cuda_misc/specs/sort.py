"""sort.cu's launches: argsort and top_k (a bitonic network on (key, index) pairs) and the fused top-k
MoE router.

Rows that fit a warp's registers sort in `sort_rows_warp`; rows up to a chunk (what one block's
shared memory holds: `chunk_limit`) in `sort_chunks`; longer rows sort in chunks merged level by
level through global memory (argsort) or are selected by `topk_select` (top_k). docs/cuda_misc.md
describes the network.
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.args import KernelArgs, f32, i32, i64, instance, u32
from opdispatch.backends.cuda.args import ptr as pointer
from opdispatch.backends.cuda.devices import facts
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.hookspecs import Device
from opdispatch.tensor import Tensor

from . import KERNELS_DIR, Ptr
from .reduce import rows_of
from .rows import pow2

SORT_CU = KERNELS_DIR / "sort.cu"

SORT_BLOCKS = (32, 128, 512, 1024)
#: sort_rows_warp's (values per lane K, warps per row): one warp up to 512 values, then 16 per lane
WARP_SORTS = ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (16, 2), (16, 4), (16, 8))
WARP_SORT_MAX = 32 * 16 * 8
#: topk_moe's experts per lane (NPL): 32 lanes of a warp hold a row of up to 32 * NPL experts
MOE_NPL = (1, 2, 4, 8, 16, 32)
MAX_EXPERTS = 32 * MOE_NPL[-1]
#: longest rows sorted: the merge path's chunks (4096 at least) stay within grid.y's 65535
MAX_SORT = 2**24
#: chunks never longer than this (more only costs shared memory)
MAX_CHUNK = 16384
#: threads per block of merge_step
MERGE_THREADS = 256

KERNEL_SOURCES = {SORT_CU: (
    *(instance("sort_rows_warp", *kw) for kw in WARP_SORTS),
    *(instance("sort_chunks", blk) for blk in SORT_BLOCKS),
    "merge_step", instance("merge_chunks", 1024), instance("topk_select", 1024),
    *(instance("topk_moe", n) for n in MOE_NPL),
)}


# -- kernel arguments: each ends with the rows' n1, n2 and byte strides s0..s3 (`rows_of`) -------------


@attrs.frozen
class SortChunksArgs(KernelArgs):
    """Rows of n keys sorted in chunks of `chunk`; the first `kout` indices of each written
    `out_stride` apart."""

    KERNELS = ("sort_chunks",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.int32 = i32()
    chunk: np.int32 = i32()
    kout: np.int32 = i32()
    out_stride: np.int64 = i64()
    desc: np.int32 = i32()
    n1: np.uint32 = u32()
    n2: np.uint32 = u32()
    s0: np.int64 = i64()
    s1: np.int64 = i64()
    s2: np.int64 = i64()
    s3: np.int64 = i64()


@attrs.frozen
class SortRowsWarpArgs(KernelArgs):
    KERNELS = ("sort_rows_warp",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    rows: np.uint32 = u32()
    n: np.int32 = i32()
    kout: np.int32 = i32()
    out_stride: np.int64 = i64()
    desc: np.int32 = i32()
    n1: np.uint32 = u32()
    n2: np.uint32 = u32()
    s0: np.int64 = i64()
    s1: np.int64 = i64()
    s2: np.int64 = i64()
    s3: np.int64 = i64()


@attrs.frozen
class MergeStepArgs(KernelArgs):
    """One global compare-exchange step of the network: pairs (i, i ^ mask), half the distance."""

    KERNELS = ("merge_step",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.int32 = i32()
    npad: np.int32 = i32()
    mask: np.int32 = i32()
    half: np.int32 = i32()
    desc: np.int32 = i32()
    n1: np.uint32 = u32()
    n2: np.uint32 = u32()
    s0: np.int64 = i64()
    s1: np.int64 = i64()
    s2: np.int64 = i64()
    s3: np.int64 = i64()


@attrs.frozen
class MergeChunksArgs(KernelArgs):
    KERNELS = ("merge_chunks",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.int32 = i32()
    chunk: np.int32 = i32()
    desc: np.int32 = i32()
    n1: np.uint32 = u32()
    n2: np.uint32 = u32()
    s0: np.int64 = i64()
    s1: np.int64 = i64()
    s2: np.int64 = i64()
    s3: np.int64 = i64()


@attrs.frozen
class TopkSelectArgs(KernelArgs):
    KERNELS = ("topk_select",)
    x: np.uint64 = pointer()
    out: np.uint64 = pointer()
    n: np.int32 = i32()
    k: np.int32 = i32()
    kpad: np.int32 = i32()
    n1: np.uint32 = u32()
    n2: np.uint32 = u32()
    s0: np.int64 = i64()
    s1: np.int64 = i64()
    s2: np.int64 = i64()
    s3: np.int64 = i64()


@attrs.frozen
class TopkMoeArgs(KernelArgs):
    KERNELS = ("topk_moe",)
    logits: np.uint64 = pointer()
    weights: np.uint64 = pointer()
    ids: np.uint64 = pointer()
    rows: np.uint32 = u32()
    E: np.int32 = i32()
    k: np.int32 = i32()
    row_stride: np.int64 = i64()
    scale: np.float32 = f32()
    norm: np.int32 = i32()


# -- geometry ------------------------------------------------------------------------------------


def chunk_limit(device: Device) -> int:
    """The longest run of keys one block sorts in shared memory (8 bytes a key): a power of two."""
    most = min(MAX_CHUNK, facts(device).smem_per_block_optin // 8)
    return 1 << (most.bit_length() - 1)


def sort_block(chunk: int) -> int:
    """Threads per block sorting `chunk` keys: one per comparator, 32 to 1024."""
    for blk in SORT_BLOCKS:
        if 2 * blk >= chunk:
            return blk
    return SORT_BLOCKS[-1]


def sort_rows(node: Tensor) -> int:
    """Rows a sort of `node`'s source sorts."""
    return math.prod(node.srcs[0].shape[:-1])


def _row_tail(x: Tensor) -> dict[str, int]:
    """The n1, n2, s0..s3 arguments every sort kernel ends with."""
    _, n1, n2, st = rows_of(x)
    return dict(n1=max(n1, 1), n2=max(n2, 1), s0=st[0], s1=st[1], s2=st[2], s3=st[3])


# -- launch specs ------------------------------------------------------------------------------------


def warp_sort_spec(x: Tensor, out: Tensor, ptr: Ptr, kout: int, desc: bool) -> KernelSpec | None:
    """sort_rows_warp for x's rows when they fit its registers; else None."""
    n = x.shape[-1]
    if n > WARP_SORT_MAX:
        return None
    rows = math.prod(x.shape[:-1]) if n else 0
    npad = max(pow2(n), 32)
    k, warps = (npad // 32, 1) if npad <= 512 else (16, npad // 512)
    grid, block = (-(-rows // 4), 128) if warps == 1 else (rows, 32 * warps)  # 4 rows per block of one-warp rows
    args = SortRowsWarpArgs(x=ptr(x), out=ptr(out), rows=rows, n=n, kout=kout, out_stride=kout, desc=int(desc),
                            **_row_tail(x))
    return KernelSpec(SORT_CU, instance("sort_rows_warp", k, warps), grid, block, args)


def argsort_specs(node: Tensor, ptr: Ptr, chunk_max: int) -> list[KernelSpec]:
    x = node.srcs[0]
    n = x.shape[-1]
    desc = node.params["order"] == "desc"
    warp = warp_sort_spec(x, node, ptr, n, desc)
    if warp is not None and n <= chunk_max:
        return [warp]
    rows = sort_rows(node) if n else 0
    sort = SortChunksArgs(x=ptr(x), out=ptr(node), n=n, chunk=0, kout=n, out_stride=n, desc=int(desc),
                          **_row_tail(x))
    if n <= chunk_max:
        chunk = pow2(n)
        return [KernelSpec(SORT_CU, instance("sort_chunks", sort_block(chunk)), (rows, 1), sort_block(chunk),
                           attrs.evolve(sort, chunk=chunk), chunk * 8)]
    chunk = chunk_max
    nchunks = -(-n // chunk)
    npad = pow2(n)
    big = SORT_BLOCKS[-1]
    specs = [KernelSpec(SORT_CU, instance("sort_chunks", big), (rows, nchunks), big,
                        attrs.evolve(sort, chunk=chunk, kout=chunk), chunk * 8)]
    step = MergeStepArgs(x=ptr(x), out=ptr(node), n=n, npad=npad, mask=0, half=0, desc=int(desc), **_row_tail(x))
    step_grid = (-(-(npad // 2) // MERGE_THREADS), rows)
    merge = KernelSpec(SORT_CU, instance("merge_chunks", big), (rows, nchunks), big,
                       MergeChunksArgs(x=ptr(x), out=ptr(node), n=n, chunk=chunk, desc=int(desc), **_row_tail(x)),
                       chunk * 8)

    def merge_step(mask: int, half: int) -> KernelSpec:
        return KernelSpec(SORT_CU, "merge_step", step_grid, MERGE_THREADS, attrs.evolve(step, mask=mask, half=half))

    k = 2 * chunk
    while k <= npad:
        specs.append(merge_step(k - 1, k // 2))  # the flip step of level k
        j = k // 4
        while j >= chunk:
            specs.append(merge_step(j, j))
            j //= 2
        specs.append(merge)
        k *= 2
    return specs


def top_k_specs(node: Tensor, ptr: Ptr, chunk_max: int) -> list[KernelSpec]:
    x = node.srcs[0]
    n, k = x.shape[-1], node.params["k"]
    warp = warp_sort_spec(x, node, ptr, k, True)
    if warp is not None and n <= chunk_max:
        return [warp]
    rows = sort_rows(node)
    if n <= chunk_max:
        chunk = pow2(n)
        args = SortChunksArgs(x=ptr(x), out=ptr(node), n=n, chunk=chunk, kout=k, out_stride=k, desc=1, **_row_tail(x))
        return [KernelSpec(SORT_CU, instance("sort_chunks", sort_block(chunk)), (rows, 1), sort_block(chunk), args,
                           chunk * 8)]
    kpad = pow2(k)
    args = TopkSelectArgs(x=ptr(x), out=ptr(node), n=n, k=k, kpad=kpad, **_row_tail(x))
    return [KernelSpec(SORT_CU, instance("topk_select", 1024), rows, 1024, args, kpad * 8)]


def moe_specs(nodes: Sequence[Tensor], ptr: Ptr) -> list[KernelSpec]:
    """The fused router (fusion.MOE_PATTERNS): soft_max -> top_k -> get_rows [-> sum_rows -> div] in one
    kernel, which also writes the expert ids (top_k's result, the rule's extra output: mul_mat_id reads
    them outside the group)."""
    probs, _, topk, _ = nodes[:4]
    logits = probs.srcs[0]
    out = nodes[-1]
    experts, k = probs.shape[-1], topk.params["k"]
    rows = math.prod(probs.shape[:-1])
    npl = next(n for n in MOE_NPL if 32 * n >= experts)
    args = TopkMoeArgs(logits=ptr(logits), weights=ptr(out), ids=ptr(topk), rows=rows, E=experts, k=k,
                       row_stride=experts, scale=probs.params["scale"], norm=int(len(nodes) > 4))
    return [KernelSpec(SORT_CU, instance("topk_moe", npl), -(-rows // 4), 128, args)]
