"""rope's launches (kernels/rope.cu): rope alone, fused with the K-cache write (rope -> view -> set_rows) and
the decode step's q/k/v (rope_qkv_set_rows); how threads cover heads and pairs, and the arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np

from opdispatch.backends.cuda.args import NOT_WRITTEN, Guard, IndexCheck, KernelArgs, f32, i32, i64, instance, ptr, u32
from opdispatch.backends.cuda.devices import DeviceFacts
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.ops.attention import rope_yarn
from opdispatch.ops.base import pad4
from opdispatch.tensor import Tensor

from .common import CTYPE, KERNELS_DIR, Ptr, aligned, elem_strides, idx_ctype

ROPE_CU = KERNELS_DIR / "rope.cu"

#: rope, by the dtype of x: heads whose loads a thread of the chunk layout has in flight at once
#: (a template parameter; the measurements behind it: docs/cuda_attention.md)
ROPE_HEADS_IN_FLIGHT = {"f32": 2, "f16": 2}
#: lanes that may share a chunk's angles (rope_kernel's SH; RopeLayout.share picks one of these)
ROPE_SHARES = (1, 2, 4)
#: cache dtypes the fused rope -> set_rows kernels write (ggml: f32, f16)
CACHE_TYPES = ("f32", "f16")


def rope_kernel(neox: bool, dt: str, share: int = 1) -> str:
    return instance("rope_kernel", neox, CTYPE[dt], ROPE_HEADS_IN_FLIGHT[dt], share)


def rope_set_rows_kernel(neox: bool, cache: str, idx: str) -> str:
    return instance("rope_set_rows", neox, CTYPE[cache], idx_ctype(idx), ROPE_HEADS_IN_FLIGHT["f32"])


def rope_qkv_kernel(neox: bool, cache: str, idx: str) -> str:
    return instance("rope_qkv_set_rows", neox, CTYPE[cache], idx_ctype(idx), ROPE_HEADS_IN_FLIGHT["f32"])


KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {
    ROPE_CU: tuple(
        [rope_kernel(n, dt, sh) for n in (False, True) for dt in ("f32", "f16") for sh in ROPE_SHARES]
        + [f(n, c, i) for f in (rope_set_rows_kernel, rope_qkv_kernel) for n in (False, True)
           for c in CACHE_TYPES for i in ("i32", "i64")]),
}

#: threads a rope block (kernels index by blockDim.x): blocks of 4 warps fit registers finely (at 88
#: registers a thread an SM holds 5 such blocks, 2 of 256 threads)
ROPE_BLOCK = 128
#: most heads a rope thread rotates with one set of angles (an angle depends on token and pair only)
ROPE_HEADS_PER_THREAD = 8
#: fewer heads a thread while a launch would have fewer threads than this many a multiprocessor: a
#: small launch (decode) then spreads over the GPU instead of looping over heads
ROPE_FILL_THREADS_PER_SM = 1024


@attrs.frozen
class RopeLayout:
    """How rope's threads cover `rows` token rows of heads x D: a thread takes one unit of a head row
    (a chunk of E pairs, two 16-byte packs, when `vec`; else one pair) for heads g, g + groups, ...;
    `share` lanes (chunks only) holding one chunk of one token in consecutive head groups compute
    the chunk's angles together (rope.cu's chunk_angles)."""

    vec: bool
    units: int  # units of a head row
    groups: int
    rows: int
    share: int = 1

    @property
    def threads(self) -> int:
        return self.rows * self.groups * self.units

    @property
    def grid(self) -> tuple[int]:
        return (-(-self.threads // ROPE_BLOCK),)


def rope_layout(rows: int, heads: int, d: int, n_dims: int, elem_bytes: int, packs: bool, sm_count: int) -> RopeLayout:
    """The chunk layout where `packs` (rows 16-byte aligned) and a chunk's 2E values tile D and n_dims,
    else pairs; heads per thread from ROPE_HEADS_PER_THREAD down (halved) while the launch has fewer
    than `sm_count` x ROPE_FILL_THREADS_PER_SM threads."""
    chunk = 32 // elem_bytes  # values of two 16-byte packs
    vec = packs and d % chunk == 0 and n_dims % chunk == 0
    units = d // chunk if vec else d // 2
    fill = sm_count * ROPE_FILL_THREADS_PER_SM
    hpt = min(heads, ROPE_HEADS_PER_THREAD)
    while hpt > 1 and rows * units * -(-heads // hpt) < fill:
        hpt = -(-hpt // 2)
    groups = -(-heads // hpt)
    return RopeLayout(vec, units, groups, rows, rope_share(vec, units, groups, rows))


def rope_share(vec: bool, units: int, groups: int, rows: int) -> int:
    """The most lanes (of ROPE_SHARES) that can share a chunk's angles: each sharing set is `share`
    consecutive head groups of one token, `units` lanes apart, inside one warp (share * units
    divides 32, groups a multiple of share), and every lane of every warp is a thread of the launch
    (threads a multiple of 32), since the angles go round by full-warp shuffles."""
    if not vec or (rows * groups * units) % 32:
        return 1
    return max(s for s in ROPE_SHARES if 32 % (s * units) == 0 and groups % s == 0) if 32 % units == 0 else 1


def rope_fields(rope: Tensor) -> dict[str, Any]:
    """ROPE_PARAMS (rope_common.cuh) of a rope node: d, n_dims, theta_scale, freq_scale, ext_factor,
    mscale, corr_lo, corr_hi."""
    p = rope.params
    n_dims = p["n_dims"]
    lo, hi, mscale = rope_yarn(p)
    theta_scale = np.float32(p["freq_base"]) ** np.float32(-2.0 / n_dims)  # ggml: powf(freq_base, -2.0f/n_dims)
    return {"d": rope.srcs[0].shape[-1], "n_dims": n_dims, "theta_scale": theta_scale,
            "freq_scale": p["freq_scale"], "ext_factor": p["ext_factor"], "mscale": mscale, "corr_lo": lo,
            "corr_hi": hi}


def ff_ptr(rope: Tensor, ptr: Ptr) -> int:
    """The frequency factors' address, 0 without them."""
    return ptr(rope.srcs[2]) if rope.srcs[2] is not None else 0


@attrs.frozen
class RopeArgs(KernelArgs):
    KERNELS = ("rope_kernel",)
    x: np.uint64 = ptr()
    pos: np.uint64 = ptr()
    ff: np.uint64 = ptr()
    out: np.uint64 = ptr()
    total: np.uint32 = u32()
    vec: np.int32 = i32()
    heads: np.int32 = i32()
    groups: np.int32 = i32()
    tokens: np.int32 = i32()
    xs_h: np.int64 = i64()
    xs_t: np.int64 = i64()
    xs_b: np.int64 = i64()
    d: np.int32 = i32()
    n_dims: np.int32 = i32()
    theta_scale: np.float32 = f32()
    freq_scale: np.float32 = f32()
    ext_factor: np.float32 = f32()
    mscale: np.float32 = f32()
    corr_lo: np.float32 = f32()
    corr_hi: np.float32 = f32()


@attrs.frozen
class RopeSetRowsArgs(KernelArgs):
    KERNELS = ("rope_set_rows",)
    x: np.uint64 = ptr()
    pos: np.uint64 = ptr()
    ff: np.uint64 = ptr()
    cache: np.uint64 = ptr()
    idx: np.uint64 = ptr()
    total: np.uint32 = u32()
    vec: np.int32 = i32()
    heads: np.int32 = i32()
    groups: np.int32 = i32()
    xs_h: np.int64 = i64()
    xs_t: np.int64 = i64()
    cs: np.int64 = i64()
    rows: np.int64 = i64()
    d: np.int32 = i32()
    n_dims: np.int32 = i32()
    theta_scale: np.float32 = f32()
    freq_scale: np.float32 = f32()
    ext_factor: np.float32 = f32()
    mscale: np.float32 = f32()
    corr_lo: np.float32 = f32()
    corr_hi: np.float32 = f32()
    err_: IndexCheck


@attrs.frozen
class RopeQkvArgs(KernelArgs):
    """blockIdx.y = 0, 1, 2: q rotated, k rotated into its cache rows, v copied into its rows (`rows`: the rows
    both caches have, the row ids' range)."""

    KERNELS = ("rope_qkv_set_rows",)
    q: np.uint64 = ptr()
    k: np.uint64 = ptr()
    v: np.uint64 = ptr()
    pos: np.uint64 = ptr()
    ff: np.uint64 = ptr()
    q_out: np.uint64 = ptr()
    k_cache: np.uint64 = ptr()
    v_cache: np.uint64 = ptr()
    idx: np.uint64 = ptr()
    vec: np.int32 = i32()
    tokens: np.int32 = i32()
    hq: np.int32 = i32()
    gq: np.int32 = i32()
    hk: np.int32 = i32()
    gk: np.int32 = i32()
    v_cols: np.int32 = i32()
    qs_h: np.int64 = i64()
    qs_t: np.int64 = i64()
    ks_h: np.int64 = i64()
    ks_t: np.int64 = i64()
    vs_t: np.int64 = i64()
    kcs: np.int64 = i64()
    vcs: np.int64 = i64()
    rows: np.int64 = i64()
    d: np.int32 = i32()
    n_dims: np.int32 = i32()
    theta_scale: np.float32 = f32()
    freq_scale: np.float32 = f32()
    ext_factor: np.float32 = f32()
    mscale: np.float32 = f32()
    corr_lo: np.float32 = f32()
    corr_hi: np.float32 = f32()
    err_: IndexCheck


def rope_specs(node: Tensor, ptr: Ptr, dev: DeviceFacts) -> list[KernelSpec]:
    x, pos, _ = node.srcs
    b, t, h, d = pad4(x.shape)
    _, (xs_b, xs_t, xs_h, _) = elem_strides(x)
    packs = aligned(x, ptr, 16) and ptr(node) % 16 == 0
    lay = rope_layout(b * t, h, d, node.params["n_dims"], x.dtype.block_bytes, packs, dev.sm_count)
    args = RopeArgs(x=ptr(x), pos=ptr(pos), ff=ff_ptr(node, ptr), out=ptr(node), total=lay.threads,
                    vec=int(lay.vec), heads=h, groups=lay.groups, tokens=t, xs_h=xs_h, xs_t=xs_t, xs_b=xs_b,
                    **rope_fields(node))
    name = rope_kernel(node.params["mode"] == "neox", x.dtype.name, lay.share)
    return [KernelSpec(ROPE_CU, name, lay.grid, ROPE_BLOCK, args)]


def _cache_packs(cache: Tensor, ptr: Ptr) -> bool:
    """Cache rows take packs of 4 values (an f32 chunk's half)."""
    return aligned(cache, ptr, 4 * cache.dtype.block_bytes)


def cache_rows(k_cache: Tensor, v_cache: Tensor | None = None) -> tuple[int, str]:
    """(rows, what a row id picks) of the caches a fused kernel writes (set_rows results, their rows the
    row ids' range: both caches' where a row id picks a K and a V row)."""
    if v_cache is None:
        return k_cache.shape[-2], f"a row of {k_cache.srcs[0].describe()}"
    return (min(k_cache.shape[-2], v_cache.shape[-2]),
            f"a row of the K cache {k_cache.srcs[0].describe()} and of the V cache {v_cache.srcs[0].describe()}")


def rope_set_rows_specs(rope: Tensor, x: Tensor, cache: Tensor, idx: Tensor, ptr: Ptr, guard: Guard,
                        dev: DeviceFacts) -> list[KernelSpec]:
    """rope(x) written into the cache (the set_rows result) at rows `idx` (fusion.parts of the group), the
    row ids checked by `guard`'s IndexCheck."""
    _, t, h, d = pad4(x.shape)
    _, (_, xs_t, xs_h, _) = elem_strides(x)
    lay = rope_layout(t, h, d, rope.params["n_dims"], 4, aligned(x, ptr, 16) and _cache_packs(cache, ptr),
                      dev.sm_count)
    rows, what = cache_rows(cache)
    args = RopeSetRowsArgs(x=ptr(x), pos=ptr(rope.srcs[1]), ff=ff_ptr(rope, ptr), cache=ptr(cache), idx=ptr(idx),
                           total=lay.threads, vec=int(lay.vec), heads=h, groups=lay.groups, xs_h=xs_h, xs_t=xs_t,
                           cs=cache.strides[-2] // cache.dtype.block_bytes, rows=rows, **rope_fields(rope),
                           err_=guard(cache, idx, rows, what, NOT_WRITTEN))
    name = rope_set_rows_kernel(rope.params["mode"] == "neox", cache.dtype.name, idx.dtype.name)
    return [KernelSpec(ROPE_CU, name, lay.grid, ROPE_BLOCK, args)]


def rope_qkv_specs(rope_q: Tensor, rope_k: Tensor, k_cache: Tensor, v_cache: Tensor, ptr: Ptr, guard: Guard,
                   dev: DeviceFacts) -> list[KernelSpec]:
    """One launch for the decode step's q/k/v (fusion.qkv_parts of the group); the layouts of q and k,
    and v's units, follow one `vec`; the row ids checked by `guard`'s IndexCheck."""
    xq, xk, v, idx = rope_q.srcs[0], rope_k.srcs[0], v_cache.srcs[1], k_cache.srcs[2]
    _, t, hq, d = pad4(xq.shape)
    hk = xk.shape[-2]
    _, (_, qs_t, qs_h, _) = elem_strides(xq)
    _, (_, ks_t, ks_h, _) = elem_strides(xk)
    v_cols = v.shape[-1]
    packs = (aligned(xq, ptr, 16) and ptr(rope_q) % 16 == 0 and aligned(xk, ptr, 16) and _cache_packs(k_cache, ptr)
             and v_cols % 4 == 0 and aligned(v, ptr, 16) and _cache_packs(v_cache, ptr))
    n_dims = rope_q.params["n_dims"]
    lq = rope_layout(t, hq, d, n_dims, 4, packs, dev.sm_count)
    lk = rope_layout(t, hk, d, n_dims, 4, packs, dev.sm_count)
    vec = lq.vec  # the same for q and k (same D, n_dims, packs); v follows it
    v_threads = t * (v_cols // 4 if vec else v_cols)
    rows, what = cache_rows(k_cache, v_cache)
    args = RopeQkvArgs(q=ptr(xq), k=ptr(xk), v=ptr(v), pos=ptr(rope_q.srcs[1]), ff=ff_ptr(rope_q, ptr),
                       q_out=ptr(rope_q), k_cache=ptr(k_cache), v_cache=ptr(v_cache), idx=ptr(idx), vec=int(vec),
                       tokens=t, hq=hq, gq=lq.groups, hk=hk, gk=lk.groups, v_cols=v_cols, qs_h=qs_h, qs_t=qs_t,
                       ks_h=ks_h, ks_t=ks_t, vs_t=v.strides[-2] // 4 if v.ndim >= 2 else 0,
                       kcs=k_cache.strides[-2] // k_cache.dtype.block_bytes,
                       vcs=v_cache.strides[-2] // v_cache.dtype.block_bytes, rows=rows, **rope_fields(rope_q),
                       err_=guard(k_cache, idx, rows, what, NOT_WRITTEN))
    name = rope_qkv_kernel(rope_q.params["mode"] == "neox", k_cache.dtype.name, idx.dtype.name)
    blocks = -(-max(lq.threads, lk.threads, v_threads) // ROPE_BLOCK)
    return [KernelSpec(ROPE_CU, name, (blocks, 3), ROPE_BLOCK, args)]
