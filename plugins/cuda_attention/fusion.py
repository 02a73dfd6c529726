"""Fusions of rope with the KV-cache writes of a decoder layer, and of those with the decode attention.

rope -> view -> set_rows (ggml's ggml_cuda_should_fuse_rope_set_rows, restated in numpy order);
the decode step's q/k/v rope and cache writes as one launch (QKV_PATTERN); the same with the attention
that reads them (ATTN_PATTERN), which the decode kernel then does itself. Each check declines anything
else with a reason, and the nodes run unfused or by a smaller rule. The patterns, the group orders they
rely on and ggml's conditions: docs/cuda_attention.md.
"""

from __future__ import annotations

from typing import Sequence

from opdispatch.backends.cuda.devices import facts
from opdispatch.graph import Graph
from opdispatch.hookspecs import Device
from opdispatch.ops.base import pad4
from opdispatch.support import whole_elements
from opdispatch.tensor import Tensor

from . import support
from .specs.flash import ATTN_HEAD_SIZES, FusedQKV, decode_splits
from .specs.rope import CACHE_TYPES


def check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """True if the fused kernel computes (rope, view, set_rows) exactly; else why not."""
    rope, view, set_rows = nodes
    ok = support.rope(device, rope)
    if ok is not True:
        return f"rope: {ok}"
    x = rope.srcs[0]
    if x.dtype.name != "f32":
        return "rope must be f32 (set_rows takes f32 rows)"
    b, t, h, d = pad4(x.shape)
    if b != 1:
        return f"rope has a batch axis of {b} (ggml fuses ne[3] == 1 only)"
    if view.srcs[0] is not rope:
        return "the view does not read the rope result"
    if not view.is_contiguous() or view.view_offset != rope.view_offset or view.size != rope.size:
        return "the view must be the whole rope result, contiguous"
    if view.shape[-1] != h * d:
        return f"the view's rows hold {view.shape[-1]} values, not one token's heads x head size = {h * d}"
    dst, src, idx = set_rows.srcs
    if src is not view:
        return "set_rows does not write the view's rows"
    if pad4(view.shape)[:2] != (1, 1) or pad4(dst.shape)[:2] != (1, 1):
        return "set_rows with batch axes"
    if set_rows.dtype.name not in CACHE_TYPES:
        return f"cache dtype {set_rows.dtype.name} (fused for {', '.join(CACHE_TYPES)})"
    if idx.dtype.name not in ("i32", "i64") or idx.size != t or not idx.is_contiguous():
        return "row ids must be a contiguous i32/i64 vector, one per token"
    if not set_rows.rows_contiguous() or not whole_elements(set_rows):
        return "cache rows must be contiguous, strides whole elements"
    return True


def parts(nodes: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rope, x, cache (the set_rows result), row ids) of a matched group."""
    rope, _, set_rows = nodes
    return rope, rope.srcs[0], set_rows, set_rows.srcs[2]


#: the decode step's q/k/v nodes as Llama emits them (docs/cuda_attention.md): rope(q) and the views
#: attention reads it through, rope(k), its flattening, the K-cache write, the K window, the V-cache
#: write; the positions of the extra outputs the fused kernel writes: rotated q and the K cache
QKV_PATTERN = ("rope", "reshape", "permute", "rope", "reshape", "set_rows", "view", "set_rows")
QKV_OUTPUTS = (0, 5)
#: what may come between those nodes and runs before the group: the views of k and v into a stacked
#: projection, or the separate k and v projections and k's reshape (docs/cuda_attention.md)
QKV_HOIST = ("mul_mat", "reshape", "view")


def check_qkv(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """True if the fused kernel computes the decode step's q/k/v nodes (QKV_PATTERN) exactly; else why not."""
    rope_q, rope_k, k_rows, v_rows = qkv_parts(nodes)
    ok = check(device, (rope_k, nodes[4], k_rows), graph)
    if ok is not True:
        return f"k: {ok}"
    ok = support.rope(device, rope_q)
    if ok is not True:
        return f"q: rope: {ok}"
    xq, xk = rope_q.srcs[0], rope_k.srcs[0]
    if xq.dtype.name != "f32":
        return "q must be f32"
    bq, tq, _, dq = pad4(xq.shape)
    _, tk, _, dk = pad4(xk.shape)
    if bq != 1:
        return f"q has a batch axis of {bq}"
    if (tq, dq) != (tk, dk):
        return f"q ({tq} tokens, head size {dq}) and k ({tk}, {dk}) differ"
    if any(a is not b for a, b in zip(rope_q.srcs[1:], rope_k.srcs[1:])) or rope_q.params != rope_k.params:
        return "q and k rotate with different positions, frequency factors or parameters"
    dst, v, idx = v_rows.srcs
    if idx is not k_rows.srcs[2]:
        return "K and V rows are written at different row ids"
    if v_rows.dtype != k_rows.dtype:
        return f"the K cache is {k_rows.dtype.name}, the V cache {v_rows.dtype.name}"
    if pad4(v.shape)[:2] != (1, 1) or pad4(dst.shape)[:2] != (1, 1):
        return "set_rows of v with batch axes"
    if not v.rows_contiguous() or not whole_elements(v):
        return "v rows must be contiguous, strides whole elements"
    if not v_rows.rows_contiguous() or not whole_elements(v_rows):
        return "V cache rows must be contiguous, strides whole elements"
    return True


def qkv_parts(nodes: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rope(q), rope(k), K cache (its set_rows result), V cache) of a QKV_PATTERN group."""
    return nodes[0], nodes[3], nodes[5], nodes[7]


#: QKV_PATTERN and the attention that reads it: the V window view, flash_attn_ext (the decode kernel
#: rotates q itself and writes the new K/V rows, module doc of fattn_decode.cu); K and V caches written
ATTN_PATTERN = (*QKV_PATTERN, "view", "flash_attn_ext")
ATTN_OUTPUTS = (5, 7)


def cache_window(window: Tensor, cache: Tensor) -> tuple[int, int] | str:
    """(row0, rows_b): `window` (B, kv_heads, n, D) reads cache rows row0 + b * rows_b + j, or why not."""
    row = cache.strides[0]
    es = cache.dtype.block_bytes
    ws_b, ws_h, ws_t, ws_d = window.strides
    d = window.shape[-1]
    if window.base is not cache.base or ws_t != row or ws_h != d * es or ws_d != es:
        return "the K/V window is not whole cache rows, heads D apart"
    if window.view_offset % row or ws_b % row:
        return "the K/V window does not start on a cache row"
    return window.view_offset // row, ws_b // row


def check_attn(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """True if the fused decode kernel computes ATTN_PATTERN (q/k/v rope, cache writes, attention) exactly."""
    ok = check_qkv(device, nodes[:len(QKV_PATTERN)], graph)
    if ok is not True:
        return ok
    rope_q, rope_k, k_rows, v_rows = qkv_parts(nodes)
    fa = nodes[-1]
    q, k, v = fa.srcs[:3]
    if (q, k, v) != (nodes[2], nodes[6], nodes[8]):
        return "flash_attn_ext does not read the rotated q and the windows of the caches written"
    ok = support.flash_attn_ext(device, fa)
    if ok is not True:
        return f"flash_attn_ext: {ok}"
    b, _, tq, d = q.shape
    if tq != 1:
        return f"{tq} query rows a sequence (fused for decode, one)"
    if d not in ATTN_HEAD_SIZES:
        return f"head size {d} (fused for {', '.join(map(str, ATTN_HEAD_SIZES))})"
    xq, xk, xv = rope_q.srcs[0], rope_k.srcs[0], v_rows.srcs[1]
    if pad4(xq.shape)[1] != b:
        return "q rows are not one token a sequence"
    if any(x.strides[-1] != 4 for x in (xq, xk, xv)) or xq.strides[-2] != d * 4 or xk.strides[-2] != d * 4:
        return "q/k/v rows must be contiguous heads of f32 values"
    dev = facts(device)
    if decode_splits(fa, dev, True) != decode_splits(fa, dev):
        return ("the fused kernel holds fewer blocks an SM (registers, shared memory): fewer KV splits than "
                "the unfused attention at this batch")
    kw, vw = cache_window(k, k_rows), cache_window(v, v_rows)
    for what, w in (("K", kw), ("V", vw)):
        if isinstance(w, str):
            return f"{what}: {w}"
    if kw != vw:
        return "the K and V windows start at different cache rows"
    return True


def fused_qkv(nodes: Sequence[Tensor]) -> FusedQKV:
    """What the fused decode kernel reads and writes besides the attention's own operands (an
    ATTN_PATTERN group that check_attn accepted)."""
    rope_q, rope_k, k_cache, v_cache = qkv_parts(nodes)
    window = cache_window(nodes[-1].srcs[1], k_cache)
    assert not isinstance(window, str), window  # check_attn declined such groups
    row0, rows_b = window
    return FusedQKV(rope_q.srcs[0], rope_k.srcs[0], v_cache.srcs[1], rope_q, k_cache, v_cache, k_cache.srcs[2],
                    row0, rows_b)
