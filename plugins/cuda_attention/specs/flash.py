"""flash_attn_ext's launches: the split-K decode kernel (kernels/fattn_decode.cu, alone or fused with the
decode step's q/k/v rope and cache writes) and the tensor-core prefill (kernels/fattn_prefill.cu on mma.sync,
with its mask-tile flags, or kernels/fattn_prefill_wgmma.cu on Hopper's wgmma); their geometry, KV splits,
scratch memory and arguments.

Geometry is sized by the device's facts (multiprocessors, shared memory an SM), so plans are made and
tested on a device description.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.args import (NOT_WRITTEN, UNCHECKED, Guard, IndexCheck, KernelArgs, f32, i32, i64,
                                           instance, ptr)
from opdispatch.backends.cuda.devices import DeviceFacts
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.backends.cuda.scratch import Workspace
from opdispatch.ops.base import pad4
from opdispatch.tensor import Flag, Tensor

from .common import CTYPE, KERNELS_DIR, Ptr, alibi_fields, aligned, byte_strides, idx_ctype
from .rope import CACHE_TYPES, cache_rows, ff_ptr, rope_fields

DECODE_CU = KERNELS_DIR / "fattn_decode.cu"
PREFILL_CU = KERNELS_DIR / "fattn_prefill.cu"
PREFILL_WGMMA_CU = KERNELS_DIR / "fattn_prefill_wgmma.cu"
MASK_CU = KERNELS_DIR / "fattn_mask.cu"

#: head sizes flash_attn_ext has kernels for (K and V the same)
HEAD_SIZES = (64, 80, 96, 128, 256)
#: K/V types (K and V of one type), dequantized to f16 (bf16 for bf16) in the kernels
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
#: query rows up to which flash_attn_ext runs the split-K decode kernel (else the tensor-core prefill)
DECODE_MAX_TQ = 8
#: head sizes with decode kernels fused with the q/k/v rope and cache writes (Llama-family models),
#: for caches of rope's CACHE_TYPES
ATTN_HEAD_SIZES = (64, 128)
MASK_FLAGS = "fattn_mask_flags"
#: fattn_prefill_wgmma (sm_90a code: compute capability 9.0): (warpgroups of 64 query rows, keys a K/V tile, K/V
#: stages) by head size, for K/V of WGMMA_KV_TYPES; the configurations measured fastest on the H200
#: (docs/cuda_attention.md)
WGMMA_CONFIG: dict[int, tuple[int, int, int]] = {64: (1, 64, 2), 128: (2, 128, 3)}
WGMMA_KV_TYPES = ("f16", "bf16")


def kv_variants() -> list[tuple[int, str]]:
    """(head size, K/V dtype) pairs with kernels: block formats need whole 32-value blocks."""
    return [(d, kv) for d in HEAD_SIZES for kv in KV_TYPES if d % 32 == 0 or kv in ("f32", "f16", "bf16")]


def decode_kernel(d: int, kv: str, rope: str = "", idx: str = "i32") -> str:
    """The decode kernel; rope "normal"/"neox": fused with the q/k/v rope and cache writes (row ids idx)."""
    if not rope:
        return instance("fattn_decode", d, CTYPE[kv])
    return instance("fattn_decode", d, CTYPE[kv], 1 if rope == "normal" else 2, idx_ctype(idx))


def prefill_wgmma(d: int, kv: str, dev: DeviceFacts) -> bool:
    """Whether a prefill runs on fattn_prefill_wgmma rather than fattn_prefill."""
    return dev.cc == (9, 0) and d in WGMMA_CONFIG and kv in WGMMA_KV_TYPES


def prefill_kernel(d: int, kv: str, wgmma: bool = False) -> str:
    if wgmma:
        return instance("fattn_prefill_wgmma", d, CTYPE[kv], *WGMMA_CONFIG[d])
    return instance("fattn_prefill", d, CTYPE[kv])


KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {
    DECODE_CU: tuple(
        [decode_kernel(d, kv) for d, kv in kv_variants()]
        + [decode_kernel(d, kv, r, i) for d in ATTN_HEAD_SIZES for kv in CACHE_TYPES for r in ("normal", "neox")
           for i in ("i32", "i64")]),
    PREFILL_CU: tuple(prefill_kernel(d, kv) for d, kv in kv_variants()),
    PREFILL_WGMMA_CU: tuple(prefill_kernel(d, kv, True) for d in WGMMA_CONFIG for kv in WGMMA_KV_TYPES),
    MASK_CU: (MASK_FLAGS,),
}

# -- geometry ------------------------------------------------------------------------------------

#: decode: keys a K/V tile (16 a warp)
DECODE_BN = 64
#: decode: columns (query row, head) a block, the M rows of its mma
DECODE_COLS = 16
#: fattn_decode fused with the q/k/v rope and cache writes: blocks an SM its registers allow (nvcc sm_90,
#: 128 threads: 128 registers at D=64, the kernel's launch bounds asking for 4 blocks, 176 at D=128;
#: unfused, shared memory bounds it first)
FUSED_DECODE_BLOCKS_PER_SM = {64: 4, 128: 2}


def prefill_tile_m(d: int, wgmma: bool = False) -> int:
    """Query rows a prefill block takes: fattn_prefill 32 a warp (two m16 tiles) where registers allow;
    fattn_prefill_wgmma 64 a warpgroup."""
    if wgmma:
        return 64 * WGMMA_CONFIG[d][0]
    return 64 if d > 128 else 128


def prefill_tile_n(d: int, wgmma: bool = False) -> int:
    """Keys a prefill K/V tile holds."""
    if wgmma:
        return WGMMA_CONFIG[d][1]
    return 32 if d > 128 else 64


def prefill_threads(d: int, wgmma: bool = False) -> int:
    return 128 * WGMMA_CONFIG[d][0] if wgmma else 128


def prefill_smem(d: int, wgmma: bool = False) -> int:
    """Dynamic shared memory of the prefill kernel: fattn_prefill Q and two K/V stages, 16-bit values, rows padded
    by 8; fattn_prefill_wgmma Q and its K/V stages unpadded (swizzled), 1024 bytes to align them."""
    bm, bn = prefill_tile_m(d, wgmma), prefill_tile_n(d, wgmma)
    if wgmma:
        return 1024 + 2 * d * (bm + WGMMA_CONFIG[d][2] * 2 * bn)
    return 2 * (d + 8) * (bm + 2 * 2 * bn)


def decode_smem(d: int, fused: bool = False) -> int:
    """Dynamic shared memory of fattn_decode<d, ...>: its K/V stages (3, or 2 for d > 128), rows padded by 8;
    fused with the q/k/v rope and cache writes, also the new K and V rows (its rotated q lives in the last
    stage before the tile loop fills it)."""
    stages = 2 if d > 128 else 3
    return stages * 2 * DECODE_BN * (d + 8) * 2 + (2 * d * 2 if fused else 0)


def decode_blocks_per_sm(d: int, smem_per_sm: int, fused: bool = False) -> int:
    """fattn_decode blocks one SM holds: shared memory bound (1 KiB reserved a block), 2 by launch bounds at least;
    fused, also bound by its registers."""
    smem_bound = max(1, min(4, smem_per_sm // (decode_smem(d, fused) + 1024)))
    return min(smem_bound, FUSED_DECODE_BLOCKS_PER_SM[d]) if fused else smem_bound


def decode_splits(node: Tensor, dev: DeviceFacts, fused: bool = False) -> tuple[int, int]:
    """(splits of the KV, keys a split) of flash_attn_ext's decode kernel: one wave, as many splits as fill
    the SMs' resident blocks (memory bound: every SM streaming; at short KV down to a tile a block, the last
    block of each group merges), no ragged second wave."""
    q, k = node.srcs[:2]
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    base = b * hkv * -(-(hq // hkv * tq) // DECODE_COLS)
    tiles = max(1, -(-tk // DECODE_BN))
    nsplit = max(1, min(dev.sm_count * decode_blocks_per_sm(d, dev.smem_per_sm, fused) // base, tiles))
    chunk = -(-tiles // nsplit) * DECODE_BN
    return max(1, -(-tk // chunk)), chunk


# -- arguments -----------------------------------------------------------------------------------


@attrs.frozen
class DecodeArgs(KernelArgs):
    """Strides in bytes (_t rows, _h heads, _b batches); mask_vec: mask rows 16-byte aligned (cp.async);
    kv_early: the first K/V and mask copies may be issued before the PDL wait (FusedQKV.reads_early);
    rope_pos .. err_: the fused q/k/v rope and cache writes, new_rows the caches' rows (ROPE 0, unfused,
    ignores them)."""

    KERNELS = ("fattn_decode",)
    q: np.uint64 = ptr()
    k: np.uint64 = ptr()
    v: np.uint64 = ptr()
    mask: np.uint64 = ptr()
    ws_acc: np.uint64 = ptr()
    ws_ml: np.uint64 = ptr()
    counters: np.uint64 = ptr()
    sinks: np.uint64 = ptr()
    out: np.uint64 = ptr()
    q_f16: np.int32 = i32()
    tq: np.int32 = i32()
    hq: np.int32 = i32()
    tk: np.int32 = i32()
    group: np.int32 = i32()
    ncg: np.int32 = i32()
    qs_t: np.int64 = i64()
    qs_h: np.int64 = i64()
    qs_b: np.int64 = i64()
    ks_t: np.int64 = i64()
    ks_h: np.int64 = i64()
    ks_b: np.int64 = i64()
    vs_t: np.int64 = i64()
    vs_h: np.int64 = i64()
    vs_b: np.int64 = i64()
    m2: np.int32 = i32()
    m3: np.int32 = i32()
    ms_t: np.int64 = i64()
    ms_h: np.int64 = i64()
    ms_b: np.int64 = i64()
    scale: np.float32 = f32()
    softcap: np.float32 = f32()
    use_alibi: np.int32 = i32()
    m0: np.float32 = f32()
    m1: np.float32 = f32()
    n_head_log2: np.int32 = i32()
    chunk: np.int32 = i32()
    kv_vec: np.int32 = i32()
    mask_vec: np.int32 = i32()
    kv_early: np.int32 = i32()
    rope_pos: np.uint64 = ptr()
    rope_ff: np.uint64 = ptr()
    k_new: np.uint64 = ptr()
    v_new: np.uint64 = ptr()
    new_idx: np.uint64 = ptr()
    k_cache: np.uint64 = ptr()
    v_cache: np.uint64 = ptr()
    kn_b: np.int64 = i64()
    kn_h: np.int64 = i64()
    vn_b: np.int64 = i64()
    kc_t: np.int64 = i64()
    vc_t: np.int64 = i64()
    row0: np.int64 = i64()
    rows_b: np.int64 = i64()
    new_rows: np.int64 = i64()
    d: np.int32 = i32()
    n_dims: np.int32 = i32()
    theta_scale: np.float32 = f32()
    freq_scale: np.float32 = f32()
    ext_factor: np.float32 = f32()
    mscale: np.float32 = f32()
    corr_lo: np.float32 = f32()
    corr_hi: np.float32 = f32()
    err_: IndexCheck


#: DecodeArgs' fused fields, unfused
NOT_FUSED: dict[str, Any] = {**dict.fromkeys(
    ("rope_pos", "rope_ff", "k_new", "v_new", "new_idx", "k_cache", "v_cache", "kn_b", "kn_h", "vn_b", "kc_t",
     "vc_t", "row0", "rows_b", "new_rows", "d", "n_dims", "theta_scale", "freq_scale", "ext_factor", "mscale",
     "corr_lo", "corr_hi"), 0), "err_": UNCHECKED}


@attrs.frozen
class PrefillArgs(KernelArgs):
    KERNELS = ("fattn_prefill", "fattn_prefill_wgmma")
    q: np.uint64 = ptr()
    k: np.uint64 = ptr()
    v: np.uint64 = ptr()
    mask: np.uint64 = ptr()
    sinks: np.uint64 = ptr()
    out: np.uint64 = ptr()
    flags: np.uint64 = ptr()
    q_f16: np.int32 = i32()
    tq: np.int32 = i32()
    hq: np.int32 = i32()
    tk: np.int32 = i32()
    group: np.int32 = i32()
    qs_t: np.int64 = i64()
    qs_h: np.int64 = i64()
    qs_b: np.int64 = i64()
    ks_t: np.int64 = i64()
    ks_h: np.int64 = i64()
    ks_b: np.int64 = i64()
    vs_t: np.int64 = i64()
    vs_h: np.int64 = i64()
    vs_b: np.int64 = i64()
    m2: np.int32 = i32()
    m3: np.int32 = i32()
    ms_t: np.int64 = i64()
    ms_h: np.int64 = i64()
    ms_b: np.int64 = i64()
    scale: np.float32 = f32()
    softcap: np.float32 = f32()
    use_alibi: np.int32 = i32()
    m0: np.float32 = f32()
    m1: np.float32 = f32()
    n_head_log2: np.int32 = i32()
    kv_vec: np.int32 = i32()
    n_kv_tiles: np.int32 = i32()


@attrs.frozen
class MaskFlagsArgs(KernelArgs):
    """One flag a (mask slice, query tile, key tile): whether the tile reads the mask, or is skipped."""

    KERNELS = ("fattn_mask_flags",)
    mask: np.uint64 = ptr()
    flags: np.uint64 = ptr()
    tq: np.int32 = i32()
    tk: np.int32 = i32()
    bm: np.int32 = i32()
    bn: np.int32 = i32()
    m2: np.int32 = i32()
    ms_t: np.int64 = i64()
    ms_h: np.int64 = i64()
    ms_b: np.int64 = i64()


def _kv_vec(k: Tensor, v: Tensor, ptr: Ptr) -> bool:
    """16-byte loads of K and V rows (f32/f16/bf16 rows starting 16-byte aligned)."""
    if k.dtype.is_quant:
        return False
    return aligned(k, ptr, 16) and aligned(v, ptr, 16)


def _q_fields(q: Tensor, ptr: Ptr) -> dict[str, Any]:
    _, (qs_b, qs_h, qs_t, _) = byte_strides(q)
    return {"q": ptr(q), "q_f16": int(q.dtype.name == "f16"), "qs_t": qs_t, "qs_h": qs_h, "qs_b": qs_b}


def _shared_fields(node: Tensor, ptr: Ptr) -> dict[str, Any]:
    """The fields both kernels take but q's: K, V, mask, sinks, output, sizes, strides, scales, ALiBi."""
    q, k, v, mask, sinks = node.srcs
    _, hq, tq, _ = q.shape
    (_, hkv, tk, _), (ks_b, ks_h, ks_t, _) = byte_strides(k)
    _, (vs_b, vs_h, vs_t, _) = byte_strides(v)
    if mask is not None:
        (m3, m2, _, _), (ms_b, ms_h, ms_t, _) = byte_strides(mask)
    else:
        m3 = m2 = 1
        ms_b = ms_h = ms_t = 0
    p = node.params
    return {"k": ptr(k), "v": ptr(v), "mask": ptr(mask) if mask is not None else 0,
            "sinks": ptr(sinks) if sinks is not None else 0, "out": ptr(node), "tq": tq, "hq": hq, "tk": tk,
            "group": hq // hkv, "ks_t": ks_t, "ks_h": ks_h, "ks_b": ks_b, "vs_t": vs_t, "vs_h": vs_h, "vs_b": vs_b,
            "m2": m2, "m3": m3, "ms_t": ms_t, "ms_h": ms_h, "ms_b": ms_b, "scale": p["scale"],
            "softcap": p["softcap"], **alibi_fields(hq, p["max_bias"]), "kv_vec": int(_kv_vec(k, v, ptr))}


def _mask_vec(mask: Tensor | None, ptr: Ptr) -> int:
    """The decode kernel's 16-byte copies of mask rows (f16 rows starting 16-byte aligned)."""
    return int(mask is not None and aligned(mask, ptr, 16))


@attrs.frozen
class FusedQKV:
    """The decode step's q/k/v rope and cache writes that fattn_decode does itself (fusion.fused_qkv): the
    unrotated q and k rows (f32 views of the projection), v's rows, the rope node (positions, frequency
    factors, parameters), the K/V caches written (set_rows results), their row ids, and where the window
    the attention reads starts in the caches (row0 + b * rows_b)."""

    xq: Tensor
    xk: Tensor
    xv: Tensor
    rope: Tensor
    k_cache: Tensor
    v_cache: Tensor
    idx: Tensor
    row0: int
    rows_b: int

    def q_fields(self, ptr: Ptr) -> dict[str, Any]:
        """q from the projection's rows (f32), token row b, heads D apart (rope(q) has no storage)."""
        qs = self.xq.strides
        return {"q": ptr(self.xq), "q_f16": 0, "qs_t": 0, "qs_h": qs[-2], "qs_b": qs[-3]}

    def reads_early(self, mask: Tensor | None) -> bool:
        """Whether fattn_decode may copy its first K/V tiles and mask values before the PDL wait: what
        they read, but for the new row (which the kernel writes after the wait and puts into its tile
        itself), was written before the run began. The caches are set_rows' destinations read as leaves
        (states: earlier runs wrote them) and the mask a leaf (a graph input, uploaded before the run);
        a cache or mask that a node of the graph computes may come from the kernel ahead."""
        leaves = [self.k_cache.srcs[0], self.v_cache.srcs[0], *([] if mask is None else [mask])]
        return all(t.base.is_leaf for t in leaves)

    def fields(self, ptr: Ptr, guard: Guard) -> dict[str, Any]:
        """DecodeArgs' fused fields (those of NOT_FUSED), the row ids checked by `guard`'s IndexCheck."""
        rows, what = cache_rows(self.k_cache, self.v_cache)
        return {"rope_pos": ptr(self.rope.srcs[1]), "rope_ff": ff_ptr(self.rope, ptr), "k_new": ptr(self.xk),
                "v_new": ptr(self.xv), "new_idx": ptr(self.idx), "k_cache": ptr(self.k_cache),
                "v_cache": ptr(self.v_cache), "kn_b": self.xk.strides[-3], "kn_h": self.xk.strides[-2],
                "vn_b": self.xv.strides[-2], "kc_t": self.k_cache.strides[-2], "vc_t": self.v_cache.strides[-2],
                "row0": self.row0, "rows_b": self.rows_b, "new_rows": rows, **rope_fields(self.rope),
                "err_": guard(self.k_cache, self.idx, rows, what, NOT_WRITTEN)}


# -- plans ---------------------------------------------------------------------------------------


@attrs.frozen
class FlashPlan:
    """How one flash_attn_ext node runs: its launches and the scratch memory they need.

    `specs(ptr, ws, guard)` gives the launches once the workspaces (addresses, in the
    order of `workspaces`) exist; `guard` checks the fused cache writes' row ids.
    """

    kind: str  # "decode" | "prefill"
    workspaces: tuple[Workspace, ...]
    make: Callable[[Ptr, Sequence[int], Guard], list[KernelSpec]] = attrs.field(repr=False)
    nsplit: int = 1
    chunk: int = 0

    def specs(self, ptr: Ptr, ws: Sequence[int], guard: Guard) -> list[KernelSpec]:
        return self.make(ptr, ws, guard)


def mask_flags_role(shared: dict[Any, Any], mask: Tensor, tq: int, tk: int, bm: int, bn: int) -> tuple[str, bool]:
    """The scratch role of the flags of `mask` (tq query rows, tk keys, bm x bn tiles) and whether this node's plan
    computes them (fattn_mask_flags) or reads those a node before it in the plan computed in the same run. The
    prefill nodes of a plan that read one mask (the same tensor, so the same bytes: a plan's tensors are written
    once a run, but for a state, which set_rows may write between them) with the same tiles share a role of their
    own in `shared` (the plan's, CudaContext.shared): one fattn_mask_flags launch a mask, not one a layer."""
    if (mask.view_src or mask).flags & Flag.STATE:
        return "flash_attn_ext mask tile flags", True
    key = (MASK_FLAGS, mask, tq, tk, bm, bn)
    if key in shared:
        return shared[key], False
    roles = sum(1 for k in shared if isinstance(k, tuple) and k[:1] == (MASK_FLAGS,))
    shared[key] = role = f"flash_attn_ext mask tile flags {roles}"
    return role, True


def flash_plan(node: Tensor, dev: DeviceFacts, fused: FusedQKV | None = None,
               shared: dict[Any, Any] | None = None) -> FlashPlan:
    """Decode (split-K) for Tq <= DECODE_MAX_TQ, else prefill (tensor cores: wgmma where prefill_wgmma holds);
    `fused`: the decode kernel also rotates q (read from fused.xq) and writes the new K/V rows (fusion.check_attn
    holds). `shared`: what the plan's binds share (mask_flags_role; None: this node's own)."""
    q, k, _, mask, _ = node.srcs
    b, hq, tq, d = q.shape
    tk, kv = k.shape[2], k.dtype.name
    if tq <= DECODE_MAX_TQ:
        return _decode_plan(node, dev, fused)
    wgmma = prefill_wgmma(d, kv, dev)
    bm, bn = prefill_tile_m(d, wgmma), prefill_tile_n(d, wgmma)
    n_qt = -(-tq // bm)
    n_kt = -(-tk // bn)
    ws: tuple[Workspace, ...] = ()
    computes = False
    if mask is not None:
        m3, m2 = pad4(mask.shape)[:2]
        role, computes = mask_flags_role({} if shared is None else shared, mask, tq, tk, bm, bn)
        ws = (Workspace(m3 * m2 * n_qt * n_kt, role),)

    def make_prefill(ptr: Ptr, wsp: Sequence[int], guard: Guard) -> list[KernelSpec]:
        flags = wsp[0] if mask is not None else 0
        args = PrefillArgs(**_q_fields(q, ptr), **_shared_fields(node, ptr), flags=flags, n_kv_tiles=n_kt)
        main = KernelSpec(PREFILL_WGMMA_CU if wgmma else PREFILL_CU, prefill_kernel(d, kv, wgmma), (n_qt, hq, b),
                          prefill_threads(d, wgmma), args, prefill_smem(d, wgmma))
        if not computes:
            return [main]
        (m3, m2, _, _), (ms_b, ms_h, ms_t, _) = byte_strides(mask)
        fargs = MaskFlagsArgs(mask=ptr(mask), flags=flags, tq=tq, tk=tk, bm=bm, bn=bn, m2=m2, ms_t=ms_t, ms_h=ms_h,
                              ms_b=ms_b)
        return [KernelSpec(MASK_CU, MASK_FLAGS, (n_kt, n_qt, m3 * m2), 128, fargs), main]

    return FlashPlan("prefill", ws, make_prefill)


def _decode_plan(node: Tensor, dev: DeviceFacts, fused: FusedQKV | None) -> FlashPlan:
    q, k, _, mask, _ = node.srcs
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    ncg = -(-(hq // hkv * tq) // DECODE_COLS)
    base = b * hkv * ncg
    nsplit, chunk = decode_splits(node, dev, fused is not None)
    rows = b * tq * hq
    ws = () if nsplit == 1 else (Workspace(nsplit * rows * d * 4, "flash_attn_ext partial sums"),
                                 Workspace(nsplit * rows * 8, "flash_attn_ext partial max/sum"),
                                 Workspace(base * 4, "flash_attn_ext split counters", zeroed=True))

    def make_decode(ptr: Ptr, wsp: Sequence[int], guard: Guard) -> list[KernelSpec]:
        # one split (gridDim.x == 1): fattn_decode writes the output without the workspace
        acc, ml, counters = (0, 0, 0) if nsplit == 1 else tuple(wsp)
        if fused is None:
            own, name = {**_q_fields(q, ptr), **NOT_FUSED}, decode_kernel(d, k.dtype.name)
            early = False
        else:
            own = {**fused.q_fields(ptr), **fused.fields(ptr, guard)}
            name = decode_kernel(d, k.dtype.name, fused.rope.params["mode"], fused.idx.dtype.name)
            early = fused.reads_early(mask)
        args = DecodeArgs(**own, **_shared_fields(node, ptr), ws_acc=acc, ws_ml=ml, counters=counters, ncg=ncg,
                          chunk=chunk, mask_vec=_mask_vec(mask, ptr), kv_early=int(early))
        return [KernelSpec(DECODE_CU, name, (nsplit, hkv * ncg, b), 128, args, decode_smem(d, fused is not None))]

    return FlashPlan("decode", ws, make_decode, nsplit, chunk)
