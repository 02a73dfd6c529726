"""The cuda_attention plugin: soft_max, rope, flash_attn_ext; rope -> view -> set_rows fused, and the
decode step's rope(q), rope(k) -> K cache, v -> V cache in one launch, or inside the decode attention
kernel that reads them (fusion.py).

Kernels (kernels/*.cu, CUDA C++ compiled by NVRTC one template instance at a time):

- softmax.cu: one block per row, the row held in registers (float4 where
  aligned) up to 32768 values, else two passes; f16/f32 mask broadcast by
  modulo, ALiBi, sinks.
- rope.cu: a thread rotates one chunk of E pairs (two 16-byte packs) of one token
  for up to 8 heads with one set of angles (computed together by the 2 or 4 lanes
  of a warp holding that chunk in other heads), NH heads' loads in flight (pairs, one
  a thread, where rows are not 16-byte aligned or D, n_dims not multiples of 2E);
  normal/neox, partial rotation, frequency factors, YaRN, f32/f16, strided input;
  the fused rope -> set_rows and rope_qkv_set_rows (q, k, v in one launch).
- fattn_decode.cu: flash_attn_ext for Tq <= 8 (split-K over the KV on mma.sync,
  16 (query row, head) columns of one KV head a block, K/V tiles streamed
  through cp.async stages; the last split of each group to finish merges the
  f32 partials in the same launch); fused, it also rotates q and writes the
  step's new K/V rows (rope_common.cuh: the angles rope.cu uses).
- fattn_prefill.cu: flash_attn_ext for more rows (mma.sync tensor cores, 128
  query rows a block for D <= 128, double-buffered K/V tiles in shared memory,
  online softmax, fully masked tiles skipped through per-tile mask flags
  computed on the device each run).

Each bind is split in two: a pure `*_specs` function picks kernel instances,
grids and arguments from shapes, strides and addresses (tested without a GPU),
and `_launch` pre-binds the launches.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.devices import warp32_gate
from opdispatch.backends.cuda.kernels import KernelSpec, Workspace, alloc_workspaces, chain
from opdispatch.backends.base import Device, Launch
from opdispatch.fusion import FusionRule
from opdispatch.hookspecs import PRIORITY_BUILTIN, Kernel, PluginInfo, hookimpl
from opdispatch.ops.base import pad4
from opdispatch.reference.attention import rope_yarn_corr_dims
from opdispatch.tensor import Tensor

from . import fusion, support
from .support import DECODE_COLS, decode_smem, decode_splits, prefill_smem, prefill_tile_m, prefill_tile_n

if TYPE_CHECKING:
    from opdispatch.backends.cuda.backend import CudaContext

KERNELS = Path(__file__).resolve().parent / "kernels"
SOFTMAX_CU = KERNELS / "softmax.cu"
ROPE_CU = KERNELS / "rope.cu"
DECODE_CU = KERNELS / "fattn_decode.cu"
PREFILL_CU = KERNELS / "fattn_prefill.cu"

Ptr = Callable[[Tensor], int]
u64, i32, i64, f32, u32 = np.uint64, np.int32, np.int64, np.float32, np.uint32


def _b(x: bool) -> str:
    return "true" if x else "false"


# -- template instances ---------------------------------------------------------------------------

#: C++ type of each K/V (and cache) dtype in the kernels
CTYPE = {"f32": "float", "f16": "od::f16", "bf16": "od::bf16", "q8_0": "od::quant::q8_0",
         "q4_0": "od::quant::q4_0"}
SOFTMAX_BLOCKS = (32, 64, 128, 256, 512, 1024)
SOFTMAX_CACHE = 8  # loads a thread keeps in registers


def softmax_kernel(block: int, cache: int, vec: bool, mask: str) -> str:
    return f"soft_max_f32<{block}, {cache}, {_b(vec)}, {CTYPE[mask]}>"


#: rope, by the dtype of x: heads whose loads a thread of the chunk layout has in flight at once
#: (a template parameter, read when a kernel name is made). nvcc sm_90 registers, f16: 64 with 2,
#: 88 with 4; f32: 56 with 2, 72 with 4. Measured on the H200 (% of copy bandwidth at 4096 / 16384
#: tokens): f16 72% / 89% with 2, 54% / 81% with 4, 70% / 87% with 1; f32 86% / 95% with 2
ROPE_HEADS_IN_FLIGHT = {"f32": 2, "f16": 2}


#: lanes that may share a chunk's angles (rope_kernel's SH; RopeLayout.share picks one of these)
ROPE_SHARES = (1, 2, 4)


def rope_kernel(neox: bool, dt: str, share: int = 1) -> str:
    return f"rope_kernel<{_b(neox)}, {CTYPE[dt]}, {ROPE_HEADS_IN_FLIGHT[dt]}, {share}>"


def _idx_ctype(idx: str) -> str:
    return "int" if idx == "i32" else "long long"


def rope_set_rows_kernel(neox: bool, cache: str, idx: str) -> str:
    return f"rope_set_rows<{_b(neox)}, {CTYPE[cache]}, {_idx_ctype(idx)}, {ROPE_HEADS_IN_FLIGHT['f32']}>"


def rope_qkv_kernel(neox: bool, cache: str, idx: str) -> str:
    return f"rope_qkv_set_rows<{_b(neox)}, {CTYPE[cache]}, {_idx_ctype(idx)}, {ROPE_HEADS_IN_FLIGHT['f32']}>"


def decode_kernel(d: int, kv: str, rope: str = "", idx: str = "i32") -> str:
    """The decode kernel; rope "normal"/"neox": fused with the q/k/v rope and cache writes (row ids idx)."""
    if not rope:
        return f"fattn_decode<{d}, {CTYPE[kv]}>"
    return f"fattn_decode<{d}, {CTYPE[kv]}, {1 if rope == 'normal' else 2}, {_idx_ctype(idx)}>"


def prefill_kernel(d: int, kv: str) -> str:
    return f"fattn_prefill<{d}, {CTYPE[kv]}>"


MASK_FLAGS = "fattn_mask_flags"

#: each .cu of this plugin and every template instance launched from it (tests/test_kernels_compile.py)
KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {
    SOFTMAX_CU: tuple(
        [softmax_kernel(b, SOFTMAX_CACHE, v, m) for b in SOFTMAX_BLOCKS for v in (False, True) for m in ("f32", "f16")]
        + [softmax_kernel(1024, 0, v, m) for v in (False, True) for m in ("f32", "f16")]),
    ROPE_CU: tuple(
        [rope_kernel(n, dt, sh) for n in (False, True) for dt in ("f32", "f16") for sh in ROPE_SHARES]
        + [f(n, c, i) for f in (rope_set_rows_kernel, rope_qkv_kernel) for n in (False, True)
           for c in fusion.CACHE_TYPES for i in ("i32", "i64")]),
    DECODE_CU: tuple(
        [decode_kernel(d, kv) for d, kv in support.kv_variants()]
        + [decode_kernel(d, kv, r, i) for d in fusion.ATTN_HEAD_SIZES for kv in fusion.CACHE_TYPES
           for r in ("normal", "neox") for i in ("i32", "i64")]),
    PREFILL_CU: tuple([prefill_kernel(d, kv) for d, kv in support.kv_variants()] + [MASK_FLAGS]),
}


# -- launch specs ---------------------------------------------------------------------------------




def _elem_strides(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape padded to 4 dims and strides in elements (0 for the padding)."""
    pad = 4 - t.ndim
    return pad4(t.shape), (0,) * pad + tuple(s // t.dtype.block_bytes for s in t.strides)


def _byte_strides(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    pad = 4 - t.ndim
    return pad4(t.shape), (0,) * pad + tuple(t.strides)


def _aligned(t: Tensor, ptr: Ptr, unit: int, elems: int = 1) -> bool:
    """Every row of `t` starts on a `unit`-byte boundary (the row length is checked by the caller)."""
    shape, strides = _byte_strides(t)
    return ptr(t) % unit == 0 and all(s % unit == 0 for n, s in zip(shape[:3], strides[:3]) if n > 1)


def alibi_args(n_head: int, max_bias: float) -> tuple[np.generic, ...]:
    """(use_alibi, m0, m1, n_head_log2) as the kernels take them (ggml's formula)."""
    if max_bias <= 0 or n_head < 1:
        return i32(0), f32(1.0), f32(1.0), i32(1)
    n_log2 = 1 << (int(n_head).bit_length() - 1)
    return i32(1), f32(2.0 ** (-max_bias / n_log2)), f32(2.0 ** (-max_bias / 2.0 / n_log2)), i32(n_log2)


def softmax_block(units: int) -> tuple[int, int]:
    """(threads, loads kept per thread) for a row of `units` loads; (1024, 0): two passes."""
    for block in SOFTMAX_BLOCKS:
        if units <= block * SOFTMAX_CACHE:
            return block, SOFTMAX_CACHE
    return 1024, 0


def softmax_specs(node: Tensor, ptr: Ptr) -> list[KernelSpec]:
    a, mask, sinks = node.srcs
    (a3, a2, rows, cols), st = _elem_strides(a)
    vec = cols % 4 == 0 and _aligned(a, ptr, 16) and ptr(node) % 16 == 0
    if mask is not None:
        (m3, m2, _, _), ms = _elem_strides(mask)
        vec = vec and _aligned(mask, ptr, 16 if mask.dtype.name == "f32" else 8)
        mt, mptr = mask.dtype.name, ptr(mask)
    else:
        m3 = m2 = 1
        ms = (0, 0, 0, 0)
        mt, mptr = "f32", 0
    block, cache = softmax_block(cols // 4 if vec else cols)
    p = node.params
    args = (u64(ptr(a)), u64(mptr), u64(ptr(sinks) if sinks is not None else 0), u64(ptr(node)),
            i32(cols), i32(rows), i32(a2), i64(st[2]), i64(st[1]), i64(st[0]),
            i32(m2), i32(m3), i64(ms[2]), i64(ms[1]), i64(ms[0]),
            f32(p["scale"]), *alibi_args(a2, p["max_bias"]))
    n = a3 * a2 * rows if cols else 0
    return [KernelSpec(SOFTMAX_CU, softmax_kernel(block, cache, vec, mt), (n,), block, args)]


def _rope_params(node: Tensor) -> tuple[np.generic, ...]:
    """d, n_dims, theta_scale, freq_scale, ext_factor, mscale, corr_lo, corr_hi."""
    p = node.params
    d = node.srcs[0].shape[-1]
    n_dims = p["n_dims"]
    ext = p["ext_factor"]
    if ext != 0.0:
        lo, hi = rope_yarn_corr_dims(n_dims, p["n_ctx_orig"], p["freq_base"], p["beta_fast"], p["beta_slow"])
        mscale = p["attn_factor"] * (1.0 + 0.1 * math.log(1.0 / p["freq_scale"]))
    else:
        lo, hi, mscale = 0.0, 0.0, p["attn_factor"]
    theta_scale = np.float32(p["freq_base"]) ** np.float32(-2.0 / n_dims)  # ggml: powf(freq_base, -2.0f/n_dims)
    return (i32(d), i32(n_dims), f32(theta_scale), f32(p["freq_scale"]), f32(ext), f32(mscale), f32(lo), f32(hi))


#: threads a rope block (kernels index by blockDim.x): blocks of 4 warps fit registers finely (at 88
#: registers a thread an SM holds 5 such blocks, 2 of 256 threads)
ROPE_BLOCK = 128
#: most heads a rope thread rotates with one set of angles (an angle depends on token and pair only)
ROPE_HEADS_PER_THREAD = 8
#: fewer heads a thread while a launch would have fewer threads than this (an H200 holds 132 SMs x
#: 1024 of them): a small launch (decode) then spreads over the GPU instead of looping over heads
ROPE_FILL_THREADS = 132 * 1024


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


def rope_layout(rows: int, heads: int, d: int, n_dims: int, elem_bytes: int, packs: bool) -> RopeLayout:
    """The chunk layout where `packs` (rows 16-byte aligned) and a chunk's 2E values tile D and n_dims,
    else pairs; heads per thread from ROPE_HEADS_PER_THREAD down (halved) to fill ROPE_FILL_THREADS."""
    chunk = 32 // elem_bytes  # values of two 16-byte packs
    vec = packs and d % chunk == 0 and n_dims % chunk == 0
    units = d // chunk if vec else d // 2
    hpt = min(heads, ROPE_HEADS_PER_THREAD)
    while hpt > 1 and rows * units * -(-heads // hpt) < ROPE_FILL_THREADS:
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


def _ff(rope: Tensor, ptr: Ptr) -> np.uint64:
    return u64(ptr(rope.srcs[2]) if rope.srcs[2] is not None else 0)


def rope_specs(node: Tensor, ptr: Ptr) -> list[KernelSpec]:
    x, pos, _ = node.srcs
    b, t, h, d = pad4(x.shape)
    _, (xs_b, xs_t, xs_h, _) = _elem_strides(x)
    packs = _aligned(x, ptr, 16) and ptr(node) % 16 == 0
    lay = rope_layout(b * t, h, d, node.params["n_dims"], x.dtype.block_bytes, packs)
    args = (u64(ptr(x)), u64(ptr(pos)), _ff(node, ptr), u64(ptr(node)), u32(lay.threads), i32(lay.vec), i32(h),
            i32(lay.groups), i32(t), i64(xs_h), i64(xs_t), i64(xs_b), *_rope_params(node))
    name = rope_kernel(node.params["mode"] == "neox", x.dtype.name, lay.share)
    return [KernelSpec(ROPE_CU, name, lay.grid, ROPE_BLOCK, args)]


def _cache_packs(cache: Tensor, ptr: Ptr) -> bool:
    """Cache rows take packs of 4 values (an f32 chunk's half)."""
    return _aligned(cache, ptr, 4 * cache.dtype.block_bytes)


def rope_set_rows_specs(nodes: Sequence[Tensor], ptr: Ptr) -> list[KernelSpec]:
    rope, x, cache, idx = fusion.parts(nodes)
    _, t, h, d = pad4(x.shape)
    _, (_, xs_t, xs_h, _) = _elem_strides(x)
    cs = cache.strides[-2] // cache.dtype.block_bytes
    lay = rope_layout(t, h, d, rope.params["n_dims"], 4, _aligned(x, ptr, 16) and _cache_packs(cache, ptr))
    args = (u64(ptr(x)), u64(ptr(rope.srcs[1])), _ff(rope, ptr), u64(ptr(cache)), u64(ptr(idx)), u32(lay.threads),
            i32(lay.vec), i32(h), i32(lay.groups), i64(xs_h), i64(xs_t), i64(cs), *_rope_params(rope))
    name = rope_set_rows_kernel(rope.params["mode"] == "neox", cache.dtype.name, idx.dtype.name)
    return [KernelSpec(ROPE_CU, name, lay.grid, ROPE_BLOCK, args)]


def rope_qkv_specs(nodes: Sequence[Tensor], ptr: Ptr) -> list[KernelSpec]:
    """One launch, blockIdx.y = 0, 1, 2: q rotated, k rotated into its cache rows, v copied into its rows."""
    rope_q, rope_k, k_cache, v_cache = fusion.qkv_parts(nodes)
    xq, xk, v, idx = rope_q.srcs[0], rope_k.srcs[0], v_cache.srcs[1], k_cache.srcs[2]
    _, t, hq, d = pad4(xq.shape)
    hk = xk.shape[-2]
    _, (_, qs_t, qs_h, _) = _elem_strides(xq)
    _, (_, ks_t, ks_h, _) = _elem_strides(xk)
    v_cols = v.shape[-1]
    packs = (_aligned(xq, ptr, 16) and ptr(rope_q) % 16 == 0 and _aligned(xk, ptr, 16) and _cache_packs(k_cache, ptr)
             and v_cols % 4 == 0 and _aligned(v, ptr, 16) and _cache_packs(v_cache, ptr))
    n_dims = rope_q.params["n_dims"]
    lq, lk = rope_layout(t, hq, d, n_dims, 4, packs), rope_layout(t, hk, d, n_dims, 4, packs)
    vec = lq.vec  # the same for q and k (same D, n_dims, packs); v follows it
    v_threads = t * (v_cols // 4 if vec else v_cols)
    args = (u64(ptr(xq)), u64(ptr(xk)), u64(ptr(v)), u64(ptr(rope_q.srcs[1])), _ff(rope_q, ptr), u64(ptr(rope_q)),
            u64(ptr(k_cache)), u64(ptr(v_cache)), u64(ptr(idx)), i32(vec), i32(t), i32(hq), i32(lq.groups), i32(hk),
            i32(lk.groups), i32(v_cols), i64(qs_h), i64(qs_t), i64(ks_h), i64(ks_t),
            i64(v.strides[-2] // 4 if v.ndim >= 2 else 0), i64(k_cache.strides[-2] // k_cache.dtype.block_bytes),
            i64(v_cache.strides[-2] // v_cache.dtype.block_bytes), *_rope_params(rope_q))
    name = rope_qkv_kernel(rope_q.params["mode"] == "neox", k_cache.dtype.name, idx.dtype.name)
    blocks = -(-max(lq.threads, lk.threads, v_threads) // ROPE_BLOCK)
    return [KernelSpec(ROPE_CU, name, (blocks, 3), ROPE_BLOCK, args)]


# -- flash_attn_ext --------------------------------------------------------------------------------

@attrs.frozen
class FusedQKV:
    """The decode step's q/k/v rope and cache writes that fattn_decode does itself (fusion.ATTN_PATTERN):
    the unrotated q and k rows (f32 views of the projection), v's rows, the rope node (positions, frequency
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

    @classmethod
    def of(cls, nodes: Sequence[Tensor]) -> FusedQKV:
        rope_q, rope_k, k_cache, v_cache = fusion.qkv_parts(nodes)
        row0, rows_b = fusion.cache_window(nodes[-1].srcs[1], k_cache)
        return cls(rope_q.srcs[0], rope_k.srcs[0], v_cache.srcs[1], rope_q, k_cache, v_cache, k_cache.srcs[2],
                   row0, rows_b)

    def args(self, ptr: Ptr) -> tuple[np.generic, ...]:
        """fattn_decode's fused arguments, after kv_vec."""
        return (u64(ptr(self.rope.srcs[1])), _ff(self.rope, ptr), u64(ptr(self.xk)), u64(ptr(self.xv)),
                u64(ptr(self.idx)), u64(ptr(self.k_cache)), u64(ptr(self.v_cache)),
                i64(self.xk.strides[-3]), i64(self.xk.strides[-2]), i64(self.xv.strides[-2]),
                i64(self.k_cache.strides[-2]), i64(self.v_cache.strides[-2]), i64(self.row0), i64(self.rows_b),
                *_rope_params(self.rope))


#: fattn_decode's fused arguments when it runs unfused (ROPE 0 ignores them)
_NO_FUSED = (u64(0),) * 7 + (i64(0),) * 7 + (i32(0), i32(0)) + (f32(0),) * 6


@attrs.frozen
class FlashPlan:
    """How one flash_attn_ext node runs: its launches and the scratch memory they need.

    `specs(ptr, ws)` gives the launches once the workspaces (addresses, in the
    order of `workspaces`) exist.
    """

    kind: str  # "decode" | "prefill"
    workspaces: tuple[Workspace, ...]
    make: Callable[[Ptr, Sequence[int]], list[KernelSpec]] = attrs.field(repr=False)
    nsplit: int = 1
    chunk: int = 0

    def specs(self, ptr: Ptr, ws: Sequence[int]) -> list[KernelSpec]:
        return self.make(ptr, ws)


def _kv_vec(k: Tensor, v: Tensor, ptr: Ptr) -> bool:
    """16-byte loads of K and V rows (f32/f16/bf16 rows starting 16-byte aligned)."""
    if k.dtype.is_quant:
        return False
    return _aligned(k, ptr, 16) and _aligned(v, ptr, 16)


def _fa_common(node: Tensor, ptr: Ptr) -> tuple[np.generic, ...]:
    """The arguments both kernels share after the pointers: sizes, strides (bytes), mask, scales."""
    q, k, v, mask, _ = node.srcs
    (_, hq, tq, _), (qs_b, qs_h, qs_t, _) = _byte_strides(q)
    (_, hkv, tk, _), (ks_b, ks_h, ks_t, _) = _byte_strides(k)
    _, (vs_b, vs_h, vs_t, _) = _byte_strides(v)
    if mask is not None:
        (m3, m2, _, _), (ms_b, ms_h, ms_t, _) = _byte_strides(mask)
    else:
        m3 = m2 = 1
        ms_b = ms_h = ms_t = 0
    p = node.params
    return (i32(q.dtype.name == "f16"), i32(tq), i32(hq), i32(tk), i32(hq // hkv),
            i64(qs_t), i64(qs_h), i64(qs_b), i64(ks_t), i64(ks_h), i64(ks_b), i64(vs_t), i64(vs_h), i64(vs_b),
            i32(m2), i32(m3), i64(ms_t), i64(ms_h), i64(ms_b),
            f32(p["scale"]), f32(p["softcap"]), *alibi_args(hq, p["max_bias"]))


def flash_plan(node: Tensor, sm_count: int = 132, fused: FusedQKV | None = None) -> FlashPlan:
    """Decode (split-K) for Tq <= DECODE_MAX_TQ, else prefill (tensor cores); `fused`: the decode kernel
    also rotates q (read from fused.xq) and writes the new K/V rows (fusion.check_attn holds)."""
    q, k, v, mask, sinks = node.srcs
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    kv = k.dtype.name
    if tq <= support.DECODE_MAX_TQ:
        group = hq // hkv
        ncg = -(-(group * tq) // DECODE_COLS)
        base = b * hkv * ncg
        nsplit, chunk = decode_splits(node, sm_count, fused is not None)
        rows = b * tq * hq
        ws = () if nsplit == 1 else (Workspace(nsplit * rows * d * 4, "flash_attn_ext partial sums"),
                                     Workspace(nsplit * rows * 8, "flash_attn_ext partial max/sum"),
                                     Workspace(base * 4, "flash_attn_ext split counters", zeroed=True))

        def make_decode(ptr: Ptr, wsp: Sequence[int]) -> list[KernelSpec]:
            # one split (gridDim.x == 1): fattn_decode writes the output without the workspace
            acc, ml, counters = (0, 0, 0) if nsplit == 1 else tuple(wsp)
            common = _fa_common(node, ptr)
            if fused is None:
                q_ptr, extra, name = u64(ptr(q)), _NO_FUSED, decode_kernel(d, kv)
            else:  # q: the projection's rows (f32), token row b, heads D apart (rope(q) has no storage)
                q_ptr, extra = u64(ptr(fused.xq)), fused.args(ptr)
                qs = fused.xq.strides
                common = (i32(0), *common[1:5], i64(0), i64(qs[-2]), i64(qs[-3]), *common[8:])
                name = decode_kernel(d, kv, fused.rope.params["mode"], fused.idx.dtype.name)
            args = (q_ptr, u64(ptr(k)), u64(ptr(v)), u64(ptr(mask) if mask is not None else 0),
                    u64(acc), u64(ml), u64(counters), u64(ptr(sinks) if sinks is not None else 0),
                    u64(ptr(node)), *common[:4], i32(group), i32(ncg), *common[5:], i32(chunk),
                    i32(_kv_vec(k, v, ptr)), *extra)
            return [KernelSpec(DECODE_CU, name, (nsplit, hkv * ncg, b), 128, args, decode_smem(d, fused is not None))]

        return FlashPlan("decode", ws, make_decode, nsplit, chunk)

    bm, bn = prefill_tile_m(d), prefill_tile_n(d)
    n_qt = -(-tq // bm)
    n_kt = -(-tk // bn)
    ws: tuple[Workspace, ...] = ()
    if mask is not None:
        m3, m2 = pad4(mask.shape)[:2]
        ws = (Workspace(m3 * m2 * n_qt * n_kt, "flash_attn_ext mask tile flags"),)

    def make_prefill(ptr: Ptr, wsp: Sequence[int]) -> list[KernelSpec]:
        common = _fa_common(node, ptr)
        flags = wsp[0] if mask is not None else 0
        args = (u64(ptr(q)), u64(ptr(k)), u64(ptr(v)), u64(ptr(mask) if mask is not None else 0),
                u64(ptr(sinks) if sinks is not None else 0), u64(ptr(node)), u64(flags), *common,
                i32(_kv_vec(k, v, ptr)), i32(n_kt))
        main = KernelSpec(PREFILL_CU, prefill_kernel(d, kv), (n_qt, hq, b), 128, args, prefill_smem(d))
        if mask is None:
            return [main]
        (m3, m2, _, _), (ms_b, ms_h, ms_t, _) = _byte_strides(mask)
        fargs = (u64(ptr(mask)), u64(flags), i32(tq), i32(tk), i32(bm), i32(bn), i32(m2),
                 i64(ms_t), i64(ms_h), i64(ms_b))
        return [KernelSpec(PREFILL_CU, MASK_FLAGS, (n_kt, n_qt, m3 * m2), 128, fargs), main]

    return FlashPlan("prefill", ws, make_prefill)


# -- binding --------------------------------------------------------------------------------------




def _launch(ctx: CudaContext, specs: Sequence[KernelSpec], keep: tuple[Any, ...] = ()) -> Launch:
    return chain((s.launch(ctx.stream) for s in specs), keep)


def bind_soft_max(ctx: CudaContext, node: Tensor) -> Launch:
    return _launch(ctx, softmax_specs(node, ctx.ptr))


def bind_rope(ctx: CudaContext, node: Tensor) -> Launch:
    return _launch(ctx, rope_specs(node, ctx.ptr))


def bind_rope_set_rows(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    return _launch(ctx, rope_set_rows_specs(nodes, ctx.ptr))


def bind_rope_qkv_set_rows(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    return _launch(ctx, rope_qkv_specs(nodes, ctx.ptr))


def bind_flash_attn_ext(ctx: CudaContext, node: Tensor) -> Launch:
    return _bind_flash(ctx, node, flash_plan(node, int(ctx.device.props.get("sm_count", 132))))


def bind_qkv_flash_attn_ext(ctx: CudaContext, nodes: Sequence[Tensor]) -> Launch:
    node = nodes[-1]
    return _bind_flash(ctx, node, flash_plan(node, int(ctx.device.props.get("sm_count", 132)), FusedQKV.of(nodes)))


def _bind_flash(ctx: CudaContext, node: Tensor, plan: FlashPlan) -> Launch:
    bufs = alloc_workspaces(ctx.backend, plan.workspaces, node.describe())
    return _launch(ctx, plan.specs(ctx.ptr, [buf.ptr for buf in bufs]), bufs)


# -- hooks ----------------------------------------------------------------------------------------


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda_attention", "0.1.0", PRIORITY_BUILTIN,
                      "soft_max, rope, flash_attn_ext (split-K decode, tensor-core prefill); rope+set_rows and q/k/v "
                      "rope+cache-write fusions")


@hookimpl
def supports_op(device: Device, node: Tensor) -> bool | str | None:
    """Plugin-wide gate: the kernels assume 32-lane warps."""
    return warp32_gate(device)


@hookimpl
def kernels(device: Device) -> Iterator[Kernel]:
    if device.kind != "cuda":
        return
    yield Kernel("soft_max", bind_soft_max, support.soft_max, name="soft_max_f32")
    yield Kernel("rope", bind_rope, support.rope, name="rope")
    yield Kernel("flash_attn_ext", bind_flash_attn_ext, support.flash_attn_ext, name="flash_attn_ext")


@hookimpl
def fusion_rules(device: Device) -> Iterator[FusionRule]:
    """The decode step's q rotation and K/V writes with the attention after them (fusion.ATTN_PATTERN), asked
    first; without the attention (fusion.QKV_PATTERN); rope -> view (or reshape) -> set_rows: the K-cache
    write of a decoder layer."""
    if device.kind != "cuda":
        return
    yield FusionRule("rope_qkv_flash_attn_ext", fusion.ATTN_PATTERN, bind=bind_qkv_flash_attn_ext,
                     check=fusion.check_attn, outputs=fusion.ATTN_OUTPUTS)
    yield FusionRule("rope_qkv_set_rows", fusion.QKV_PATTERN, bind=bind_rope_qkv_set_rows, check=fusion.check_qkv,
                     outputs=fusion.QKV_OUTPUTS)
    for view in ("view", "reshape"):
        yield FusionRule(f"rope_{view}_set_rows", ("rope", view, "set_rows"), bind=bind_rope_set_rows,
                         check=fusion.check)
