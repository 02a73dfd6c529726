"""rope -> view -> set_rows as one kernel: rotated K rows written straight into the KV cache.

ggml's rule (ggml_cuda_should_fuse_rope_set_rows), restated in numpy order:
the rope input has no batch axis beyond 1 (ggml: ne[3] == 1), the view is
contiguous and flattens each token's (H, D) into one row of H*D values (ggml:
view ne[0] == rope ne[0]*ne[1]), the cache is f32 or f16, modes normal or
neox. ggml takes i64 row ids only; our kernel takes i32 as well. The group is
consecutive in execution order because Graph.build visits rope's sources,
rope, the view, then set_rows (can_fuse checks that rope and the view are read
only inside the group). `check` declines anything else with a reason, and the
three nodes then run unfused.
"""

from __future__ import annotations

from typing import Sequence

from opdispatch.backends.base import Device
from opdispatch.graph import Graph
from opdispatch.ops.base import pad4
from opdispatch.tensor import Tensor

from . import support

#: cache dtypes the fused kernel writes (ggml: f32, f16)
CACHE_TYPES = ("f32", "f16")


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
    if not set_rows.rows_contiguous() or not support.whole_elements(set_rows):
        return "cache rows must be contiguous, strides whole elements"
    return True


def parts(nodes: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rope, x, cache (the set_rows result), row ids) of a matched group."""
    rope, _, set_rows = nodes
    return rope, rope.srcs[0], set_rows, set_rows.srcs[2]
