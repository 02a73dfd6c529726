"""cuda_misc's fusion rules and their checks: multi-add, softcap, the top-k MoE router, the greedy pick.

- `multi_add_N`: a chain of N = 8..2 adds, each reading the previous one as its a, one dtype, every
  operand readable as rows; partial sums are rounded as the unfused adds store them, so fused ==
  unfused bit for bit.
- `softcap`: scale -> tanh -> scale, both without bias: s2 * tanh(s1 * x) in one kernel.
- `topk_moe_*`: ggml's topk-moe router (soft_max -> top_k -> get_rows [-> sum_rows -> div]).
- `greedy_pick`: a greedy decode step's argmax -> cpy -> cpy -> set_rows in argmax_split.
docs/cuda_misc.md describes each.
"""

from __future__ import annotations

import math
from typing import Sequence

from opdispatch.graph import Graph
from opdispatch.hookspecs import Device, FusionRule
from opdispatch.ops.base import FLOATS
from opdispatch.support import fits_int, whole_elements
from opdispatch.tensor import Tensor

from . import support
from .bind import bind_greedy_pick, bind_moe, bind_multi_add, bind_softcap
from .specs.elementwise import multi_add_operands, rows_layout
from .specs.sort import MAX_EXPERTS

#: the longest chain of adds one multi_add kernel sums
MAX_ADDS = 8


def multi_add_check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """Adds each reading the previous as a; one dtype; operands readable as rows (rows_layout)."""
    for prev, n in zip(nodes, nodes[1:]):
        if n.srcs[0] is not prev:
            return f"add {n.name} does not read the add before it as its first source"
    inside = set(nodes)
    srcs = multi_add_operands(nodes)
    if any(s in inside for s in srcs):
        return "an operand is computed inside the group"
    dt = nodes[-1].dtype
    if dt.name not in FLOATS or any(t.dtype != dt for t in (*srcs, *nodes)):
        return "operands and results must share one dtype (f32, f16 or bf16)"
    if not nodes[-1].is_contiguous():
        return "the result must be contiguous"
    if not all(whole_elements(t) for t in srcs):
        return "strides must be whole elements"
    lay = rows_layout(nodes[-1].shape, srcs)
    return lay if isinstance(lay, str) else True


def softcap_check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """scale (no bias) -> tanh -> scale (no bias), each reading the one before."""
    s1, th, s2 = nodes
    if th.srcs[0] is not s1 or s2.srcs[0] is not th:
        return "the ops do not read each other in order"
    if s1.params["bias"] != 0.0 or s2.params["bias"] != 0.0:
        return "a scale has a bias"
    for n in nodes:
        ok = support.map_ok(device, n)
        if ok is not True:
            return f"{n.op}: {ok}"
    return True


# -- the top-k MoE router -----------------------------------------------------------------------------
#
# In our ops, the router is soft_max(logits) -> top_k(probs, k) -> get_rows(probs as
# rows of one value, ids), optionally normalized: -> sum_rows -> div. Graph.build
# puts the view of probs before top_k (get_rows reads it first):
#   soft_max, reshape|view, top_k, get_rows [, reshape|view, sum_rows, div]

VIEWS = frozenset({"reshape", "view"})
MOE_PATTERNS = (("topk_moe_norm", ("soft_max", VIEWS, "top_k", "get_rows", VIEWS, "sum_rows", "div")),
                ("topk_moe", ("soft_max", VIEWS, "top_k", "get_rows")))


def _is_plain_view(v: Tensor, of: Tensor, shape: tuple[int, ...]) -> bool:
    """v shows `of`'s contiguous storage, from its start, as `shape`."""
    return (v.srcs[0] is of and v.shape == shape and v.view_offset == of.view_offset
            and v.is_contiguous() and of.is_contiguous())


def moe_check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """True if the fused router computes `nodes` (one of MOE_PATTERNS); else why not."""
    probs, rows_view, topk, weights = nodes[:4]
    logits, mask, sinks = probs.srcs
    lead, experts = probs.shape[:-1], probs.shape[-1]
    k = topk.params["k"]
    checks = (
        (mask is None and sinks is None, "soft_max has a mask or sinks"),
        (logits.dtype.name == "f32" and logits.is_contiguous(), "logits must be contiguous f32"),
        (experts <= MAX_EXPERTS, f"more than {MAX_EXPERTS} experts"),
        (fits_int(math.prod(lead)), "at most 2**31 - 1 rows"),
        (topk.srcs[0] is probs, "top_k does not read the soft_max"),
        (_is_plain_view(rows_view, probs, (*lead, experts, 1)), "get_rows' table is not the probabilities as rows"),
        (weights.srcs[0] is rows_view and weights.srcs[1] is topk, "get_rows does not gather the top_k experts"),
        (weights.shape == (*lead, k, 1) and weights.is_contiguous(), "unexpected weights shape"),
    )
    for ok, reason in checks:
        if not ok:
            return reason
    if len(nodes) == 4:
        return True
    w2, total, out = nodes[4:]
    norm = (
        (_is_plain_view(w2, weights, (*lead, k)), "the weights view is not (rows, k)"),
        (total.srcs[0] is w2, "sum_rows does not sum the weights"),
        (out.srcs[0] is w2 and out.srcs[1] is total, "div does not divide the weights by their sum"),
        (out.shape == w2.shape and out.dtype.name == "f32" and out.is_contiguous(), "unexpected div result"),
    )
    for ok, reason in norm:
        if not ok:
            return reason
    return True


# -- the greedy pick -----------------------------------------------------------------------------------
#
# LlamaModel.build(greedy=True) ends a decode step with picked = argmax(logits) (B, C) -> (B,),
# cpy(picked, next_tokens view) (i32), cpy(picked, next_f32 view (B, 1)) (f32) and
# set_rows(token_log, that f32, kv_idx): four launches of about a microsecond of work each, most of
# it launch and memory latency. Graph.build puts the f32 view between the two copies (the second cpy
# reads it first). argmax_split's last block of each row writes all three destinations instead.

GREEDY_PATTERN = ("argmax", "cpy", "view", "cpy", "set_rows")
#: the pattern positions the fused kernel writes besides set_rows: the i32 copy is read outside the
#: group (a graph output: the next step embeds it); the f32 copy is read only by the set_rows, but it
#: is a state the kernel writes in place, declared so that the plan records the write
GREEDY_WRITES = (1, 3)


def _distinct_bases(*ts: Tensor) -> bool:
    return len({t.base for t in ts}) == len(ts)


def greedy_check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    """True if argmax_split's greedy pick computes `nodes` (GREEDY_PATTERN) exactly; else why not."""
    picked, tokens, f32_view, as_f32, log = nodes
    x = picked.srcs[0]
    ok = support.row_reduce_ok(device, picked)
    if ok is not True:
        return f"argmax: {ok}"
    dst, src, idx = log.srcs
    checks = (
        (x.shape[-1] > 0, "argmax of empty rows"),
        (tokens.srcs[0] is picked and tokens.dtype.name == "i32", "the first cpy does not copy the argmax into i32"),
        (tokens.is_contiguous(), "the i32 copy's destination is not contiguous"),
        (as_f32.srcs[0] is picked and as_f32.srcs[1] is f32_view and as_f32.dtype.name == "f32",
         "the second cpy does not copy the argmax into the f32 view"),
        (as_f32.is_contiguous(), "the f32 copy's destination is not contiguous"),
        (src is as_f32, "set_rows does not write the f32 copy"),
        (log.dtype.name == "f32", "set_rows must write f32 rows"),
        (as_f32.ndim == 2 and log.ndim == 2 and idx.ndim == 1,
         "batch axes: set_rows must take (B, 1) rows into (R, 1) at (B,) row ids"),
        (as_f32.shape[-1] == 1, "set_rows rows must hold one value"),
        (all(whole_elements(t) for t in (tokens, as_f32, log, idx)), "strides or offsets that split an element"),
        (_distinct_bases(x, tokens, as_f32, dst), "the logits and the three destinations must not share storage"),
    )
    for holds, reason in checks:
        if not holds:
            return reason
    return True


#: dispatch takes the first rule whose check passes: among rules of one first op, the longest first
FUSIONS: list[FusionRule] = [
    *sorted([*(FusionRule(name, pattern, bind=bind_moe, check=moe_check, outputs=(2,))
               for name, pattern in MOE_PATTERNS),
             FusionRule("greedy_pick", GREEDY_PATTERN, bind=bind_greedy_pick, check=greedy_check,
                        outputs=GREEDY_WRITES)],
            key=lambda r: -len(r.pattern)),
    FusionRule("softcap", ("scale", "tanh", "scale"), bind=bind_softcap, check=softcap_check),
    *(FusionRule(f"multi_add_{n}", ("add",) * n, bind=bind_multi_add, check=multi_add_check)
      for n in range(MAX_ADDS, 1, -1)),
]
