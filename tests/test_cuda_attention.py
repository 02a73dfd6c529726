"""The cuda_attention plugin: soft_max, rope, flash_attn_ext, the rope -> view -> set_rows fusion and the
decode step's q/k/v rope + KV-cache writes in one launch.

Without a GPU: plans for a device description (who takes each node, declines
with their reasons), fusion matching, and the launch specs (kernel instance,
grid, arguments, one named record a kernel) against the kernels' own signatures. On a GPU: a
sweep against the numpy reference by NMSE (soft_max <= 1e-6, rope 1e-7 / the
f16 bound, flash_attn_ext <= 5e-4): masks f16/f32 with -inf blocks, fully
masked rows, sinks, ALiBi, softcap, head sizes 64..256, GQA 1/4/8, KV types
f32/f16/bf16/q8_0/q4_0, decode and prefill, non-contiguous and misaligned
views; fused rope+set_rows and rope_qkv_set_rows == unfused == reference;
CUDA-graph replay == direct launches.

Random inputs come from a fresh seed each run, printed on failure; set
OPDISPATCH_TEST_SEED to replay one.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import opdispatch as od
import opdispatch.plugins.cuda_attention as ca
from opdispatch import ops
from opdispatch.backends.cuda.args import KernelArgs
from opdispatch.backends.cuda.devices import H200, DeviceFacts, facts
from opdispatch.backends.cuda.kernels import KernelSpec, kernel_param_types, kernel_params
from opdispatch.fusion import gather
from opdispatch.graph import Graph
from opdispatch.hookspecs import Device
from opdispatch.plugins.cuda_attention import fusion, specs
from opdispatch.plugins.cuda_attention.specs import flash, rope, softmax
from opdispatch.tensor import Tensor
from opdispatch.testing.cases import Inputs, bound
from opdispatch.testing.harness import Status, run_case
from opdispatch.testing.metrics import nmse
from helpers import FAKE_WORD, FakeGuard, assert_graph_segments, edge_cases

gpu = pytest.mark.gpu

TURING = Device("cuda0", "cuda", "sm_75 (description)",
                {"cc": (7, 5), "sm_count": 40, "smem_per_block": 49152, "warp_size": 32})
CPU = Device("cpu", "cpu")
DEV = facts(H200)  # what the specs are sized by: 132 SMs, 228 KiB of shared memory an SM
ATTN_OPS = ("soft_max", "rope", "flash_attn_ext")


def steps_of(plan: od.Plan, op: str) -> list:
    return [s for s in plan.steps if s.kind in ("kernel", "fused") and any(n.op == op for n in s.nodes)]


def fa(d: int = 64, tq: int = 1, tk: int = 113, hq: int = 4, hkv: int = 2, kv: str = "f16", dv: int | None = None,
       mask: bool = False, **kw: object) -> Tensor:
    q = od.input("q", (1, hq, tq, d))
    k = od.input("k", (1, hkv, tk, d), kv)
    v = od.input("v", (1, hkv, tk, dv or d), kw.pop("v_dtype", kv))  # type: ignore[arg-type]
    m = od.input("m", (1, 1, tq, tk), "f16") if mask else None
    return ops.flash_attn_ext(q, k, v, m, 1 / math.sqrt(d), **kw)  # type: ignore[arg-type]


# -- the plugin, without a GPU --------------------------------------------------------------------


def test_kernels_and_rules_are_for_cuda_devices_only() -> None:
    assert list(ca.kernels(device=CPU)) == [] and list(ca.fusion_rules(device=CPU)) == []
    assert sorted(k.op for k in ca.kernels(device=H200)) == sorted(ATTN_OPS)
    assert [r.name for r in ca.fusion_rules(device=H200)] == ["rope_qkv_flash_attn_ext", "rope_qkv_set_rows",
                                                              "rope_set_rows"]
    assert all(r.pattern[0] == "rope" for r in ca.fusion_rules(device=H200))


def _soft_max() -> Tensor:
    return ops.soft_max(od.input("a", (2, 4, 7, 33)), od.input("m", (1, 4, 16, 33), "f16"), 0.1, 8.0,
                        od.input("s", (4,)))


def _rope() -> Tensor:
    return ops.rope(od.input("x", (1, 5, 4, 64), "f16"), od.input("p", (5,), "i32"), 32, "neox",
                    freq_factors=od.input("ff", (16,)), ext_factor=1.0, n_ctx_orig=4096)


@pytest.mark.parametrize(("build", "op", "kernel"), [
    (_soft_max, "soft_max", "soft_max_f32"),
    (_rope, "rope", "rope"),
    (lambda: fa(128, 1, 8192, 32, 8), "flash_attn_ext", "flash_attn_ext"),
    (lambda: fa(128, 128, 300, 8, 1, "q4_0", mask=True, sinks=od.input("s", (8,)), softcap=10.0), "flash_attn_ext",
     "flash_attn_ext"),
    (lambda: fa(256, 4, 1024, 8, 8, "bf16", mask=True, max_bias=8.0), "flash_attn_ext", "flash_attn_ext"),
])
def test_plans_each_op_on_the_gpu_description(build: Callable[[], Tensor], op: str, kernel: str) -> None:
    plan = od.compile(build(), H200)
    (step,) = steps_of(plan, op)
    assert (step.plugin, step.kernel, step.device.name) == ("cuda_attention", kernel, "cuda0"), plan.explain()
    assert f"cuda_attention:{kernel} on cuda0" in plan.explain()


def _rope_strided_rows() -> Tensor:
    x = od.input("x", (1, 3, 64, 4))  # rows of x are a transposed view: stride 16 bytes between values
    return ops.rope(x.permute(0, 1, 3, 2), od.input("p", (3,), "i32"), 64)


def _rope_odd_head() -> Tensor:
    return ops.rope(od.input("x", (1, 3, 2, 65)), od.input("p", (3,), "i32"), 64)


@pytest.mark.parametrize(("build", "op", "reason"), [
    (lambda: fa(192, 1, 113, dv=128), "flash_attn_ext", "K and V head sizes differ (kernels for equal sizes only)"),
    (lambda: fa(112, 4, 113), "flash_attn_ext", "head size not in 64, 80, 96, 128, 256"),
    (lambda: fa(32, 128, 113), "flash_attn_ext", "head size not in 64, 80, 96, 128, 256"),
    (lambda: fa(64, 1, 113, kv="f16", v_dtype="bf16"), "flash_attn_ext", "K and V must have the same dtype"),
    (_rope_strided_rows, "rope", "rows of x must be contiguous"),
    (_rope_odd_head, "rope", "the head size must be even"),
])
def test_declines_with_the_reason_and_falls_back_to_cpu(build: Callable[[], Tensor], op: str, reason: str) -> None:
    plan = od.compile(build(), H200)
    (step,) = steps_of(plan, op)
    assert step.device.name == "cpu" and step.plugin == "cpu", plan.explain()
    assert ("cuda_attention", reason) in step.declined
    assert f"cuda_attention ({reason})" in plan.explain()


def test_flash_attn_ext_needs_sm80() -> None:
    for tq in (8, 9):  # decode and prefill: both on mma.sync m16n8k16 and cp.async
        (step,) = steps_of(od.compile(fa(64, tq, 113), TURING), "flash_attn_ext")
        assert step.device.name == "cpu"
        reason = "the flash_attn_ext kernels need compute capability 8.0 (mma.sync m16n8k16, cp.async)"
        assert ("cuda_attention", reason) in step.declined


SM86 = Device("cuda0", "cuda", "sm_86 (description)",
              {"cc": (8, 6), "sm_count": 84, "smem_per_block": 49152, "smem_per_block_optin": 101376, "warp_size": 32})


@pytest.mark.parametrize(("d", "tq", "runs_on_gpu"), [(64, 1, True), (64, 100, True), (128, 1, False), (128, 100, False)])
def test_flash_attn_ext_declines_what_does_not_fit_shared_memory(d: int, tq: int, runs_on_gpu: bool) -> None:
    (step,) = steps_of(od.compile(fa(d, tq, 113), SM86), "flash_attn_ext")
    assert (step.plugin == "cuda_attention") == runs_on_gpu, step.declined
    if not runs_on_gpu:
        need = flash.decode_smem(d) if tq <= flash.DECODE_MAX_TQ else flash.prefill_smem(d)
        reason = f"the kernel for head size {d} needs {need} bytes of shared memory a block, cuda0 has 101376"
        assert ("cuda_attention", reason) in step.declined


def test_gate_declines_devices_without_32_lane_warps() -> None:
    wide = Device("cuda0", "cuda", "a 64-lane device", {"cc": (9, 0), "warp_size": 64})
    (step,) = steps_of(od.compile(_soft_max(), wide), "soft_max")
    assert step.device.name == "cpu"
    assert ("cuda_attention", "the kernels need 32-lane warps, cuda0 has 64") in step.declined


# -- fusion ---------------------------------------------------------------------------------------


def k_cache_write(cache: str = "f16", idx: str = "i64", mode: str = "neox", n_tok: int = 5, heads: int = 4,
                  d: int = 64, rows: int = 32, how: str = "view", batch: int = 1) -> Tensor:
    """rope(k) -> view (T, H*D) -> set_rows into the cache, as llama.cpp writes K."""
    k = od.input("k", (batch, n_tok, heads, d))
    kr = ops.rope(k, od.input("pos", (n_tok,), "i32"), d, mode)
    flat = kr.view((n_tok * batch, heads * d)) if how == "view" else kr.reshape((n_tok * batch, heads * d))
    if how == "per head":
        flat = kr.view((n_tok * heads, d))
        return ops.set_rows(od.state("cache", (rows * heads, d), cache), flat,
                            od.input("idx", (n_tok * heads,), idx))
    return ops.set_rows(od.state("cache", (rows, heads * d), cache), flat, od.input("idx", (n_tok * batch,), idx))


def test_graph_order_puts_rope_view_set_rows_next_to_each_other() -> None:
    y = k_cache_write()
    assert [n.op for n in Graph.build(y).nodes] == ["rope", "view", "set_rows"]
    y = k_cache_write(how="reshape")
    assert [n.op for n in Graph.build(y).nodes] == ["rope", "reshape", "set_rows"]


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("idx", ["i32", "i64"])
@pytest.mark.parametrize("how", ["view", "reshape"])
def test_fuses_rope_view_set_rows(cache: str, idx: str, how: str) -> None:
    plan = od.compile(k_cache_write(cache, idx, how=how), H200)
    (step,) = plan.fusions
    assert (step.plugin, step.kernel, step.device.name) == ("cuda_attention", "rope_set_rows", "cuda0")
    assert [n.op for n in step.nodes] == ["rope", how, "set_rows"]
    assert len([s for s in plan.steps if s.kind in ("kernel", "fused")]) == 1
    assert "cuda_attention [fused rope_set_rows] on cuda0" in plan.explain()
    guard = FakeGuard()
    spec, = rope.rope_set_rows_specs(*fusion.parts(step.nodes), fake_ptr, guard, DEV)
    assert spec.kernel in specs.KERNEL_SOURCES[rope.ROPE_CU]
    assert spec_types(spec) == kernel_param_types(rope.ROPE_CU)["rope_set_rows"]
    set_rows = step.nodes[-1]
    dst, _, ids = set_rows.srcs
    assert guard.uses == [(set_rows, ids, dst.shape[0], f"a row of {dst.describe()}", "that row is not written")]
    assert (int(spec.args.rows), int(spec.args.err_.word), int(spec.args.err_.tag)) == (dst.shape[0], FAKE_WORD, 0)


@pytest.mark.parametrize(("build", "reason"), [
    (lambda: k_cache_write("bf16"), r"cache dtype bf16 \(fused for f32, f16\)"),
    (lambda: k_cache_write("q8_0"), r"cache dtype q8_0"),
    (lambda: k_cache_write(how="per head"), r"the view's rows hold 64 values, not one token's heads x head size"),
    (lambda: k_cache_write(batch=2), r"rope has a batch axis of 2"),
])
def test_fusion_check_declines_what_ggml_does_not_fuse(build: Callable[[], Tensor], reason: str) -> None:
    y = build()
    graph = Graph.build(y)
    nodes = graph.nodes
    assert [n.op for n in nodes] == ["rope", "view", "set_rows"]
    answer = fusion.check(H200, nodes, graph)
    assert isinstance(answer, str) and re.search(reason, answer), answer
    plan = od.compile(y, H200)
    assert not plan.fusions
    (rope_step,) = steps_of(plan, "rope")
    assert rope_step.plugin == "cuda_attention"


def test_no_fusion_when_the_rotated_k_is_also_an_output() -> None:
    y = k_cache_write()
    rope = Graph.build(y).nodes[0]
    plan = od.compile([y, rope], H200)
    assert not plan.fusions
    assert steps_of(plan, "rope")[0].plugin == "cuda_attention"


def test_fusion_off_runs_three_nodes() -> None:
    plan = od.compile(k_cache_write(), H200, fusion=False)
    assert not plan.fusions
    assert steps_of(plan, "rope")[0].plugin == "cuda_attention"


def qkv_step(inp: Inputs, cache: str = "f16", idx: str = "i64", mode: str = "neox", rows: int = 3, heads: int = 8,
             kv_heads: int = 2, d: int = 64, n_dims: int | None = None, ctx: int = 32, v_cache: str | None = None,
             q_base: float = 10000.0, own_pos: bool = False, own_ids: bool = False, stacked: bool = True
             ) -> list[Tensor]:
    """The q/k/v part of LlamaModel.build's decode step (rows sequences of one token) over a stacked
    projection output (rows, (heads + 2 kv_heads) * d), or three projections (not `stacked`): outputs q
    as flash_attn_ext reads it (rows, heads, 1, d) and the K and V windows (1, kv_heads, ctx, d) of the
    caches, whose rows start random. own_pos / own_ids: q rotated at other positions, V written at other
    rows (the fusion declines)."""
    kv, n = kv_heads * d, n_dims or d
    q, k, v = (split_qkv if stacked else project_qkv)(inp, rows, heads, kv_heads, d)
    pos, ff = inp.ints((rows,), 0, 512), inp.uniform((n // 2,), lo=0.9, hi=1.1)
    qr = ops.rope(q, inp.ints((rows,), 0, 512) if own_pos else pos, n, mode, freq_base=q_base, freq_factors=ff)
    kr = ops.rope(k, pos, n, mode, freq_factors=ff)
    ids = inp.ids((rows,), ctx, idx)
    caches = [od.state(f"{what}_cache", (ctx, kv), dt, init=inp.rng.uniform(-1, 1, (ctx, kv)))
              for what, dt in (("k", cache), ("v", v_cache or cache))]
    keys = ops.set_rows(caches[0], kr.reshape(rows, kv), ids)
    values = ops.set_rows(caches[1], v, inp.ids((rows,), ctx, idx) if own_ids else ids)
    return [qr.reshape(rows, 1, heads, d).permute(0, 2, 1, 3), kv_window(keys, 1, kv_heads, ctx, d),
            kv_window(values, 1, kv_heads, ctx, d)]


def split_qkv(inp: Inputs, rows: int, heads: int, kv_heads: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """A random stacked q/k/v projection output (rows, (heads + 2 kv_heads) * d), as LlamaModel.build
    splits it: q (1, rows, heads, d) and k (1, rows, kv_heads, d) views, v (rows, kv_heads * d)."""
    hidden, kv = heads * d, kv_heads * d
    qkv = inp.uniform((rows, hidden + 2 * kv))
    rs, es = qkv.strides
    q = qkv.view((1, rows, heads, d), (rows * rs, rs, d * es, es))
    k = qkv.view((1, rows, kv_heads, d), (rows * rs, rs, d * es, es), hidden * es)
    return q, k, qkv.view((rows, kv), (rs, es), (hidden + kv) * es)


def project_qkv(inp: Inputs, rows: int, heads: int, kv_heads: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as LlamaModel.build makes them from projections it cannot stack (a Q4_K_M file's v is
    q6_K, its q and k q4_K): three mul_mats of one input, v's weights in another dtype. Graph.build puts
    the k and v projections between the q and the k nodes (QKV_HOIST). Values are small multiples of
    1/64, so every device computes the products exactly and the bounds stay those of the fused ops."""
    def weights(n: int, dtype: str) -> Tensor:
        return inp.given(inp.rng.integers(-3, 4, (n, 32)) / 64, dtype)

    x = inp.given(inp.rng.integers(-3, 4, (rows, 32)).astype(np.float32))
    q = ops.mul_mat(weights(heads * d, "f32"), x).reshape(1, rows, heads, d)
    k = ops.mul_mat(weights(kv_heads * d, "f32"), x).reshape(1, rows, kv_heads, d)
    return q, k, ops.mul_mat(weights(kv_heads * d, "f16"), x)


def qkv_group(graph: Graph, pattern: tuple = fusion.QKV_PATTERN) -> list[Tensor]:
    """The group the q/k/v rules gather from the first rope of `graph`."""
    first = [n.op for n in graph.nodes].index("rope")
    gathered = gather(graph.nodes, first, pattern, fusion.QKV_HOIST)
    assert gathered is not None, [n.op for n in graph.nodes]
    return gathered[0]


def kv_window(cache: Tensor, seqs: int, kv_heads: int, ctx: int, d: int) -> Tensor:
    """The (seqs, kv_heads, ctx, d) attention window of a cache (rows of kv_heads * d): sequence b reads
    rows b * ctx .., as LlamaModel.build's windows do."""
    row = cache.strides[0]
    return cache.view((seqs, kv_heads, ctx, d), (ctx * row, cache.dtype.row_bytes(d), row, cache.dtype.block_bytes))


STACKED = pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])


@pytest.mark.parametrize(("stacked", "order", "between"), [
    (True, ["view", "rope", "reshape", "permute", "view", "rope", "reshape", "set_rows", "view", "view", "set_rows",
            "view"], ["view", "view"]),
    (False, ["mul_mat", "reshape", "rope", "reshape", "permute", "mul_mat", "reshape", "rope", "reshape", "set_rows",
             "view", "mul_mat", "set_rows", "view"], ["mul_mat", "reshape", "mul_mat"]),
], ids=["stacked", "unstacked"])
def test_qkv_step_emits_the_fused_pattern_and_independent_nodes_between(stacked: bool, order: list,
                                                                        between: list) -> None:
    nodes = Graph.build(qkv_step(Inputs(np.random.default_rng(0)), stacked=stacked)).nodes
    assert [n.op for n in nodes] == order
    first = order.index("rope")
    assert gather(nodes, first, fusion.QKV_PATTERN) is None  # k's and v's own nodes come between
    group, skipped = gather(nodes, first, fusion.QKV_PATTERN, fusion.QKV_HOIST)
    assert [n.op for n in skipped] == between and group[-1] is nodes[-2]


@STACKED
@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("idx", ["i32", "i64"])
@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_fuses_the_decode_steps_rope_and_kv_writes(cache: str, idx: str, mode: str, stacked: bool) -> None:
    plan = od.compile(qkv_step(Inputs(np.random.default_rng(0)), cache, idx, mode, stacked=stacked), H200)
    (step,) = plan.fusions
    assert (step.plugin, step.kernel, step.device.name) == ("cuda_attention", "rope_qkv_set_rows", "cuda0")
    assert [n.op for n in step.nodes] == list(fusion.QKV_PATTERN)
    rope_q, _, k_rows, v_rows = fusion.qkv_parts(step.nodes)
    assert step.writes == (rope_q, k_rows) and step.out is v_rows
    projections = [] if stacked else ["mul_mat"] * 3  # hoisted ahead of the group
    assert [(s.kind, s.out.op) for s in plan.steps if s.kind != "view"] == [
        *(("kernel", op) for op in projections), ("fused", "set_rows")]  # one launch after them, no copies
    guard = FakeGuard()
    (spec,) = rope.rope_qkv_specs(*fusion.qkv_parts(step.nodes), fake_ptr, guard, DEV)
    assert spec.kernel in specs.KERNEL_SOURCES[rope.ROPE_CU]
    assert spec.kernel == rope.rope_qkv_kernel(mode == "neox", cache, idx)
    assert spec_types(spec) == kernel_param_types(rope.ROPE_CU)["rope_qkv_set_rows"]
    rows = min(k_rows.shape[0], v_rows.shape[0])
    (use,) = guard.uses
    assert use[:3] == (k_rows, k_rows.srcs[2], rows) and "K cache" in use[3] and "V cache" in use[3]
    assert (int(spec.args.rows), int(spec.args.err_.word), int(spec.args.err_.tag)) == (rows, FAKE_WORD, 0)
    a = spec.args
    vec, tokens, hq, gq, hk, gk, v_cols, qs_h, qs_t, ks_h, ks_t, vs_t, kcs, vcs = (int(v) for v in (
        a.vec, a.tokens, a.hq, a.gq, a.hk, a.gk, a.v_cols, a.qs_h, a.qs_t, a.ks_h, a.ks_t, a.vs_t, a.kcs, a.vcs))
    q_row, k_row, v_row = ((8 + 2 * 2) * 64,) * 3 if stacked else (8 * 64, 2 * 64, 2 * 64)
    assert (vec, tokens, hq, gq, hk, gk, v_cols) == (1, 3, 8, 8, 2, 2, 128)  # 16-byte rows; a head a thread
    assert (qs_h, qs_t, ks_h, ks_t, vs_t, kcs, vcs) == (64, q_row, 64, k_row, v_row, 128, 128)
    units = 64 // 8  # f32 chunks of 4 pairs
    assert spec.grid == (-(-max(3 * 8 * units, 3 * 2 * units, 3 * 128 // 4) // rope.ROPE_BLOCK), 3)


def test_fused_qkv_takes_pairs_where_rows_do_not_tile() -> None:
    plan = od.compile(qkv_step(Inputs(np.random.default_rng(0)), d=66, n_dims=40), H200)
    (step,) = plan.fusions
    (spec,) = rope.rope_qkv_specs(*fusion.qkv_parts(step.nodes), fake_ptr, FakeGuard(), DEV)
    assert int(spec.args.vec) == 0
    assert spec.grid == (-(-max(3 * 8 * 33, 3 * 2 * 132) // rope.ROPE_BLOCK), 3)


@STACKED
@pytest.mark.parametrize(("kw", "reason"), [
    (dict(cache="bf16"), r"^k: cache dtype bf16"),
    (dict(v_cache="f32"), r"the K cache is f16, the V cache f32"),
    (dict(own_ids=True), r"K and V rows are written at different row ids"),
    (dict(own_pos=True), r"q and k rotate with different positions"),
    (dict(q_base=500000.0), r"q and k rotate with different positions, frequency factors or parameters"),
])
def test_qkv_fusion_declines_with_the_reason_and_k_still_fuses(kw: dict, reason: str, stacked: bool) -> None:
    outputs = qkv_step(Inputs(np.random.default_rng(0)), **kw, stacked=stacked)
    graph = Graph.build(outputs)
    answer = fusion.check_qkv(H200, qkv_group(graph), graph)
    assert isinstance(answer, str) and re.search(reason, answer), answer
    plan = od.compile(outputs, H200)
    k_part = [] if kw.get("cache") == "bf16" else ["rope_set_rows"]  # ggml fuses f32/f16 caches only
    assert [s.kernel for s in plan.fusions] == k_part
    assert re.search(r"not fused: rope_qkv_set_rows \(" + reason.lstrip("^"), plan.explain())


@STACKED
def test_no_qkv_fusion_when_the_rotated_k_is_also_an_output(stacked: bool) -> None:
    outputs = qkv_step(Inputs(np.random.default_rng(0)), stacked=stacked)
    rope_k = qkv_group(Graph.build(outputs))[3]
    plan = od.compile([*outputs, rope_k], H200)
    assert not plan.fusions
    assert "not fused: rope_qkv_set_rows (an intermediate result is read outside the group)" in plan.explain()


def attn_step(inp: Inputs, cache: str = "f16", idx: str = "i64", mode: str = "neox", seqs: int = 3, heads: int = 8,
              kv_heads: int = 2, d: int = 64, ctx: int = 320, stacked: bool = True) -> list[Tensor]:
    """LlamaModel.build's decode step from the stacked projection (or three, not `stacked`) to the attention:
    `seqs` sequences of one token, sequence b in cache rows b * ctx .., each at a random position of its
    window (masked past it); outputs the attention (seqs, 1, heads, d) and the two caches, whose other rows
    start random."""
    kv = kv_heads * d
    q, k, v = (split_qkv if stacked else project_qkv)(inp, seqs, heads, kv_heads, d)
    positions = inp.rng.integers(0, ctx, seqs)
    pos, ids, mask = od.input("pos", (seqs,), "i32"), od.input("ids", (seqs,), idx), od.input("m", (seqs, 1, 1, ctx),
                                                                                             "f16")
    inp.feeds[pos] = positions.astype(np.int32)
    inp.feeds[ids] = (np.arange(seqs) * ctx + positions).astype(np.int32 if idx == "i32" else np.int64)
    inp.feeds[mask] = np.where(np.arange(ctx) <= positions[:, None], 0, -np.inf).astype(np.float16).reshape(
        seqs, 1, 1, ctx)
    ff = inp.uniform((d // 2,), lo=0.9, hi=1.1)
    qr, kr = ops.rope(q, pos, d, mode, freq_factors=ff), ops.rope(k, pos, d, mode, freq_factors=ff)
    caches = [od.state(f"{what}_cache", (seqs * ctx, kv), cache, init=inp.rng.uniform(-1, 1, (seqs * ctx, kv)))
              for what in ("k", "v")]
    keys = ops.set_rows(caches[0], kr.reshape(seqs, kv), ids)
    values = ops.set_rows(caches[1], v, ids)
    keys_w, values_w = (kv_window(c, seqs, kv_heads, ctx, d) for c in (keys, values))
    out = ops.flash_attn_ext(qr.reshape(seqs, 1, heads, d).permute(0, 2, 1, 3), keys_w, values_w, mask, d ** -0.5)
    return [out, keys, values]


@STACKED
@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("idx", ["i32", "i64"])
@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_fuses_the_decode_steps_rope_kv_writes_and_attention(cache: str, idx: str, mode: str, stacked: bool) -> None:
    plan = od.compile(attn_step(Inputs(np.random.default_rng(0)), cache, idx, mode, stacked=stacked), H200)
    (step,) = plan.fusions
    assert (step.plugin, step.kernel) == ("cuda_attention", "rope_qkv_flash_attn_ext"), plan.explain()
    assert [n.op for n in step.nodes] == list(fusion.ATTN_PATTERN)
    projections = [] if stacked else ["kernel"] * 3  # the projections, hoisted ahead of the group
    assert [s.kind for s in plan.steps if s.kind != "view"] == [*projections, "fused"]  # one launch after them
    fused = fusion.fused_qkv(step.nodes)
    assert (fused.row0, fused.rows_b) == (0, 320)
    stored = {step.nodes[-1].base, *(n.base for n in plan.graph.leafs),
              *(step.nodes[j].base for j in fusion.ATTN_OUTPUTS), *(s.out for s in plan.steps if s.kind == "kernel")}

    def ptr(t: Tensor) -> int:  # only what has storage: rope(q) is computed inside the kernel
        assert t.base in stored, f"{t.describe()} has no storage"
        return fake_ptr(t)

    guard = FakeGuard()
    (spec,) = flash.flash_plan(step.nodes[-1], DEV, fused).specs(ptr, [BASE, BASE, BASE], guard)
    assert spec.kernel == flash.decode_kernel(64, cache, mode, idx)
    assert spec.kernel in specs.KERNEL_SOURCES[flash.DECODE_CU]
    assert spec_types(spec) == kernel_param_types(flash.DECODE_CU)["fattn_decode"]
    rows = min(fused.k_cache.shape[0], fused.v_cache.shape[0])
    assert [u[:3] for u in guard.uses] == [(fused.k_cache, fused.idx, rows)]
    assert (int(spec.args.new_rows), int(spec.args.err_.word), int(spec.args.err_.tag)) == (rows, FAKE_WORD, 0)
    assert spec.smem == flash.decode_smem(64, True) > flash.decode_smem(64)


@pytest.mark.parametrize("seqs", [1, 2, 16])
def test_decode_attention_fuses_at_the_1b_batch_with_the_unfused_kernels_splits(seqs: int) -> None:
    # The 1b preset's attention (32 / 8 heads, D = 64, a 768-key window): 16 sequences x 8 KV heads are 128
    # blocks before splitting; fused or not, 4 blocks an SM hold them 4 times (132 SMs), so the fused kernel
    # takes the same splits and the whole decode step is one launch a layer.
    outputs = attn_step(Inputs(np.random.default_rng(0)), seqs=seqs, heads=32, kv_heads=8, ctx=768)
    (step,) = od.compile(outputs, H200).fusions
    assert step.kernel == "rope_qkv_flash_attn_ext", step.declined
    assert flash.decode_blocks_per_sm(64, DEV.smem_per_sm, True) == flash.decode_blocks_per_sm(64, DEV.smem_per_sm) == 4
    node, fused = step.nodes[-1], fusion.fused_qkv(step.nodes)
    plan, plain = flash.flash_plan(node, DEV, fused), flash.flash_plan(node, DEV)
    assert (plan.nsplit, plan.chunk) == (plain.nsplit, plain.chunk)
    assert plan.nsplit * seqs * 8 <= DEV.sm_count * 4  # one wave
    assert fused.rows_b == 768 and [fused.k_cache.shape, fused.v_cache.shape] == [(seqs * 768, 512)] * 2
    (spec,) = plan.specs(fake_ptr, [BASE] * 3, FakeGuard())
    assert spec.grid == (plan.nsplit, 8, seqs) and spec.smem == flash.decode_smem(64, True)


def test_attention_runs_unfused_where_the_fused_kernel_would_split_the_kv_less() -> None:
    # D = 128 on a device whose shared memory holds 3 unfused blocks an SM: the fused kernel's registers
    # (2 blocks) would give 16 sequences x 8 KV heads fewer splits, so the q/k/v part fuses alone
    big = Device("cuda0", "cuda", "an sm_90 GPU with more shared memory",
                 {**H200.props, "smem_per_sm": 3 * (flash.decode_smem(128, True) + 1024)})
    dev = facts(big)
    assert flash.decode_blocks_per_sm(128, dev.smem_per_sm, True) < flash.decode_blocks_per_sm(128, dev.smem_per_sm)
    outputs = attn_step(Inputs(np.random.default_rng(0)), seqs=16, heads=32, kv_heads=8, d=128, ctx=768)
    graph = Graph.build(outputs)
    answer = fusion.check_attn(big, qkv_group(graph, fusion.ATTN_PATTERN), graph)
    assert isinstance(answer, str) and "fewer KV splits than the unfused attention" in answer, answer
    assert [s.kernel for s in od.compile(outputs, big).fusions] == ["rope_qkv_set_rows"]
    assert [s.kernel for s in od.compile(outputs, H200).fusions] == ["rope_qkv_flash_attn_ext"]  # 2 blocks either way


def test_fused_decode_copies_k_v_and_mask_before_the_pdl_wait_only_from_leaves() -> None:
    # fattn_decode's kv_early: the caches are states (set_rows' destinations), the mask a graph input;
    # a mask some node computes may be the kernel ahead's output
    outputs = attn_step(Inputs(np.random.default_rng(0)))
    (step,) = od.compile(outputs, H200).fusions
    fused, node = fusion.fused_qkv(step.nodes), step.nodes[-1]
    mask = node.srcs[3]
    assert fused.reads_early(mask) and fused.reads_early(None)
    assert not fused.reads_early(ops.scale(mask, 1.0))
    (spec,) = flash.flash_plan(node, DEV, fused).specs(fake_ptr, [BASE] * 3, FakeGuard())
    (plain,) = flash.flash_plan(node, DEV).specs(fake_ptr, [BASE] * 3, FakeGuard())
    assert (int(spec.args.kv_early), int(plain.args.kv_early)) == (1, 0)  # unfused: set_rows wrote the new row
    assert int(spec.args.mask_vec) == int(plain.args.mask_vec) == 1  # 320 keys: 640-byte mask rows


@pytest.mark.parametrize(("tk", "mask", "vec"), [(128, True, 1), (100, True, 0), (128, False, 0)])
def test_decode_copies_mask_rows_by_cp_async_where_they_are_16_byte_aligned(tk: int, mask: bool, vec: int) -> None:
    # two query rows: mask rows tk * 2 bytes apart
    (spec,) = flash.flash_plan(fa(tq=2, tk=tk, mask=mask), DEV).specs(fake_ptr, [BASE] * 3, FakeGuard())
    assert int(spec.args.mask_vec) == vec


@pytest.mark.parametrize(("kw", "reason", "fused"), [
    (dict(d=80), r"^head size 80 \(fused for 64, 128\)", ["rope_qkv_set_rows"]),
    (dict(cache="bf16"), r"^k: cache dtype bf16", []),
])
@STACKED
def test_attention_fusion_declines_with_the_reason_and_the_smaller_rules_still_fuse(
        kw: dict, reason: str, fused: list, stacked: bool) -> None:
    outputs = attn_step(Inputs(np.random.default_rng(0)), **kw, stacked=stacked)
    graph = Graph.build(outputs)
    answer = fusion.check_attn(H200, qkv_group(graph, fusion.ATTN_PATTERN), graph)
    assert isinstance(answer, str) and re.search(reason, answer), answer
    assert [s.kernel for s in od.compile(outputs, H200).fusions] == fused


# -- launch specs, without a GPU ------------------------------------------------------------------

BASE = 0x7F00_0000_0000

def fake_ptr(t: Tensor) -> int:
    return BASE + t.view_offset


def spec_types(spec: KernelSpec) -> tuple[type, ...]:
    """The argument types of a spec, whose arguments are the named record of its kernel."""
    assert isinstance(spec.args, KernelArgs) and spec.kernel.split("<")[0] in type(spec.args).KERNELS, spec.kernel
    return tuple(type(a) for a in spec.arg_values)


def test_rope_layout_picks_chunks_where_rows_allow_and_fills_the_gpu() -> None:
    # rows, heads, d, n_dims, bytes of x, 16-byte rows; the H200's SM count
    chunks = lambda *a: rope.rope_layout(*a, DEV.sm_count)  # noqa: E731
    assert chunks(4096, 32, 128, 128, 2, True) == rope.RopeLayout(True, 8, chunks(4096, 32, 128, 128, 2, True).groups,
                                                                  4096, 4)  # 8 chunks of 8 f16 pairs (16 values)
    assert chunks(4096, 32, 128, 128, 4, True).units == 16  # f32: 4 pairs a chunk
    assert chunks(4096, 32, 128, 128, 4, False) == rope.RopeLayout(False, 64,
                                                                   chunks(4096, 32, 128, 128, 4, True).groups,
                                                                   4096)  # misaligned rows: pairs
    assert not chunks(9, 2, 96, 40, 2, True).vec and chunks(9, 2, 96, 40, 4, True).vec  # 40 % 16, 40 % 8
    assert not chunks(9, 2, 66, 66, 4, True).vec
    # heads a thread: ROPE_HEADS_PER_THREAD on large launches, fewer (down to one) while the grid is small
    big = chunks(1 << 20, 32, 128, 128, 2, True)
    assert big.groups == 32 // rope.ROPE_HEADS_PER_THREAD and big.threads == (1 << 20) * 8 * big.groups
    assert chunks(1, 32, 64, 64, 4, True).groups == 32  # a decode step: a head a thread
    # the fill is the device's: a GPU of one SM is filled by 8 heads a thread at 64 rows, the H200 is not
    assert (rope.rope_layout(64, 32, 128, 128, 2, True, 1).groups, chunks(64, 32, 128, 128, 2, True).groups) == (4, 32)
    fill = DEV.sm_count * rope.ROPE_FILL_THREADS_PER_SM
    for rows in (1, 64, 1024, 4096, 16384):
        lay = chunks(rows, 20, 128, 128, 2, True)
        hpt = -(-20 // lay.groups)
        assert hpt <= rope.ROPE_HEADS_PER_THREAD and (hpt == 1 or lay.threads >= fill)
        assert lay.grid == (-(-lay.threads // rope.ROPE_BLOCK),)


@pytest.mark.parametrize(("rows", "heads", "d", "elem", "share"), [
    (4096, 32, 128, 2, 4), (4096, 32, 128, 4, 2), (16384, 32, 128, 2, 4), (1, 32, 64, 4, 4), (1, 8, 128, 2, 4),
    (9, 20, 128, 2, 4), (3, 5, 128, 2, 1), (1, 2, 64, 4, 1), (7, 6, 96, 4, 1), (5, 12, 256, 2, 2)])
def test_rope_lanes_that_share_angles_hold_one_chunk_of_one_token(rows: int, heads: int, d: int, elem: int,
                                                                  share: int) -> None:
    """rope.cu's chunk_angles: lane r of a sharing set takes angles from lanes first + f * units (f < share)
    of its warp, which must be threads of the launch holding the same chunk of the same token, in the
    set's consecutive head groups."""
    lay = rope.rope_layout(rows, heads, d, d, elem, True, DEV.sm_count)
    assert lay.vec and lay.share == share
    for idx in range(lay.threads):
        u, g, bt = idx % lay.units, idx // lay.units % lay.groups, idx // (lay.units * lay.groups)
        r, lane = g % lay.share, idx % 32
        for f in range(lay.share):
            src = lane - r * lay.units + f * lay.units
            assert 0 <= src < 32
            other = idx - lane + src
            assert other < lay.threads
            assert (other % lay.units, other // lay.units % lay.groups, other // (lay.units * lay.groups)) == \
                (u, g - r + f, bt)


def _rope_pairs(d: int, n_dims: int, neox: bool) -> dict:
    """rope.cu's pair_of: element -> (its partner, the angle index or None when passed through)."""
    out = {}
    for j in range(d // 2):
        e0, e1, i = (2 * j, 2 * j + 1, None) if 2 * j >= n_dims else (j, j + n_dims // 2, j) if neox else \
            (2 * j, 2 * j + 1, j)
        out[e0], out[e1] = (e1, i), (e0, i)
    return out


def _rope_layout_pairs(lay: rope.RopeLayout, d: int, n_dims: int, neox: bool, e: int, heads: int) -> dict:
    """What rope.cu's threads do (slot_of, then rope_chunks or rope_pairs) for one token row:
    (head, element) -> (partner, angle index or None)."""
    out = {}
    for idx in range(lay.threads // lay.rows):
        u, g = idx % lay.units, idx // lay.units % lay.groups
        for h in range(g, heads, lay.groups):
            if lay.vec:  # chunk u: E pairs in two packs of E values
                jj = u * e
                rot = 2 * jj < n_dims
                o0, o1 = (jj, jj + n_dims // 2) if neox and rot else (2 * jj, 2 * jj + e)
                at = lambda k: o0 + k if k < e else o1 + k - e  # noqa: E731 - k-th of the chunk's 2e values
                pairs = [((at(k), at(e + k)) if neox else (at(2 * k), at(2 * k + 1)), jj + k if rot else None)
                         for k in range(e)]
            else:
                e0, e1, i = (2 * u, 2 * u + 1, None) if 2 * u >= n_dims else (u, u + n_dims // 2, u) if neox else \
                    (2 * u, 2 * u + 1, u)
                pairs = [((e0, e1), i)]
            for (a, b), i in pairs:
                for x, y in ((a, b), (b, a)):
                    assert (h, x) not in out
                    out[h, x] = (y, i)
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("elem", [2, 4])
@pytest.mark.parametrize("packs", [False, True])
def test_rope_threads_rotate_every_pair_of_every_head_once(neox: bool, elem: int, packs: bool) -> None:
    for d, n_dims, heads, rows in [(64, 64, 1, 1), (128, 96, 3, 9), (128, 32, 8, 1), (256, 128, 5, 4096),
                                   (80, 80, 20, 1), (128, 128, 32, 4096), (66, 40, 3, 2)]:
        lay = rope.rope_layout(rows, heads, d, n_dims, elem, packs, DEV.sm_count)
        got, pairs = _rope_layout_pairs(lay, d, n_dims, neox, 16 // elem, heads), _rope_pairs(d, n_dims, neox)
        assert len(got) == heads * d
        for (h, x), (y, i) in got.items():
            assert (y, i) == pairs[x] or (i is None and pairs[x][1] is None)  # passed-through values: copied


def test_every_kernel_signature_is_readable() -> None:
    for source, name in ((softmax.SOFTMAX_CU, "soft_max_f32"), (rope.ROPE_CU, "rope_kernel"),
                         (rope.ROPE_CU, "rope_set_rows"), (flash.DECODE_CU, "fattn_decode"),
                         (flash.PREFILL_CU, "fattn_prefill"), (flash.MASK_CU, "fattn_mask_flags"),
                         (flash.PREFILL_WGMMA_CU, "fattn_prefill_wgmma")):
        assert kernel_param_types(source)[name]


def test_every_launched_kernel_has_a_record_following_its_head() -> None:
    records = {kernel: cls for module in (softmax, rope, flash) for cls in vars(module).values()
               if isinstance(cls, type) and issubclass(cls, KernelArgs) and cls is not KernelArgs
               for kernel in cls.KERNELS}
    assert sorted(records) == ["fattn_decode", "fattn_mask_flags", "fattn_prefill", "fattn_prefill_wgmma",
                               "rope_kernel", "rope_qkv_set_rows", "rope_set_rows", "soft_max_f32"]
    for source, names in specs.KERNEL_SOURCES.items():
        heads = kernel_params(source)
        for kernel in {name.split("<")[0] for name in names}:
            assert records[kernel].names() == heads[kernel], kernel


@pytest.mark.parametrize(("shape", "mask", "view", "kernel", "grid"), [
    ((4, 4096), None, None, "soft_max_f32<128, 8, true, float>", 4),
    ((4, 4097), "f16", None, "soft_max_f32<1024, 8, false, od::f16>", 4),
    ((2, 3, 5, 33), "f32", None, "soft_max_f32<32, 8, false, float>", 30),
    ((1, 3, 2, 200001), "f32", None, "soft_max_f32<1024, 0, false, float>", 6),
    ((1, 3, 2, 200000), "f16", None, "soft_max_f32<1024, 0, true, od::f16>", 6),
    ((1, 3, 2, 32768), "f16", None, "soft_max_f32<1024, 8, true, od::f16>", 6),
    ((1,), None, None, "soft_max_f32<32, 8, false, float>", 1),
    ((10, 64), None, lambda a: a.view((4, 64), (512, 4), 4), "soft_max_f32<32, 8, false, float>", 4),
    ((3, 6, 64), "f16", lambda a: a.permute(1, 0, 2), "soft_max_f32<32, 8, true, od::f16>", 18),
])
def test_soft_max_spec_picks_the_variant(shape: tuple, mask: str | None, view: Callable | None, kernel: str,
                                         grid: int) -> None:
    a = od.input("a", shape)
    a = view(a) if view else a
    m = od.input("m", (1, 1, *pad2(a.shape)), mask) if mask else None
    node = ops.soft_max(a, m)
    (spec,) = softmax.softmax_specs(node, fake_ptr)
    assert (spec.kernel, spec.grid) == (kernel, (grid,))
    assert spec.kernel in specs.KERNEL_SOURCES[softmax.SOFTMAX_CU]
    assert spec_types(spec) == kernel_param_types(softmax.SOFTMAX_CU)["soft_max_f32"]


def pad2(shape: tuple) -> tuple:
    return ((1,) + tuple(shape))[-2:] if len(shape) < 2 else tuple(shape[-2:])


def test_soft_max_spec_passes_strides_and_alibi() -> None:
    a = od.input("a", (3, 5, 7, 40)).permute(1, 0, 2, 3)  # (5, 3, 7, 40)
    m = od.input("m", (1, 3, 9, 40), "f16")
    (spec,) = softmax.softmax_specs(ops.soft_max(a, m, 0.5, 8.0), fake_ptr)
    s = spec.args
    ncols, nrows, nheads, as1, as2, as3 = s.ncols, s.nrows, s.nheads, s.as1, s.as2, s.as3
    m2, m3, ms1, ms2, ms3, scale, alibi, m0, m1, nlog2 = (s.m2, s.m3, s.ms1, s.ms2, s.ms3, s.scale, s.use_alibi,
                                                          s.m0, s.m1, s.n_head_log2)
    assert spec.arg_values[4:] == (ncols, nrows, nheads, as1, as2, as3, m2, m3, ms1, ms2, ms3, scale, alibi, m0, m1,
                                   nlog2)  # C order
    assert (ncols, nrows, nheads, as1, as2, as3) == (40, 7, 3, 40, 5 * 7 * 40, 7 * 40)
    assert (m2, m3, ms1, ms2, ms3) == (3, 1, 40, 9 * 40, 3 * 9 * 40)
    assert (scale, alibi, nlog2) == (np.float32(0.5), 1, 2)
    assert m0 == np.float32(2.0 ** -4) and m1 == np.float32(2.0 ** -2)


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_rope_spec(mode: str, dt: str) -> None:
    x = od.input("x", (2, 5, 3, 80), dt).permute(0, 2, 1, 3)  # (2, 3, 5, 80): tokens 3, heads 5
    node = ops.rope(x, od.input("p", (3,), "i32"), 64, mode, freq_base=500000.0, freq_scale=0.25, ext_factor=1.0,
                    attn_factor=1.2, n_ctx_orig=4096)
    (spec,) = rope.rope_specs(node, fake_ptr, DEV)
    assert spec.kernel == rope.rope_kernel(mode == "neox", dt) and spec.kernel in specs.KERNEL_SOURCES[rope.ROPE_CU]
    assert spec_types(spec) == kernel_param_types(rope.ROPE_CU)["rope_kernel"]
    assert spec.arg_values[:4] == (BASE, BASE, 0, BASE)  # x, positions, no frequency factors, output
    total, vec, heads, groups, tokens, xs_h, xs_t, xs_b, d, n_dims = (int(a) for a in spec.arg_values[4:14])
    units = 80 // (32 // node.dtype.block_bytes)  # chunks of two 16-byte packs: rows of x 16-byte aligned
    assert (total, vec, heads, groups, tokens) == (2 * 3 * 5 * units, 1, 5, 5, 3)  # small: a head a thread
    assert (xs_h, xs_t, xs_b, d, n_dims) == (3 * 80, 80, 15 * 80, 80, 64)
    theta_scale, freq_scale, ext, mscale, lo, hi = (float(a) for a in spec.arg_values[14:])
    assert theta_scale == pytest.approx(500000.0 ** (-2 / 64), rel=1e-6)
    assert mscale == pytest.approx(1.2 * (1 + 0.1 * math.log(4)), rel=1e-6)
    from opdispatch.ops.attention import rope_yarn_corr_dims
    assert (lo, hi) == rope_yarn_corr_dims(64, 4096, 500000.0, 32.0, 1.0)
    assert spec.grid == (-(-total // rope.ROPE_BLOCK),) and spec.block == rope.ROPE_BLOCK
    # a row of x one element off 16 bytes: pairs
    (spec,) = rope.rope_specs(node, lambda t: fake_ptr(t) + (2 if t is x else 0), DEV)
    assert (int(spec.args.total), int(spec.args.vec)) == (2 * 3 * 5 * 40, 0)


@pytest.mark.parametrize(("d", "tq", "tk", "hq", "hkv", "kv", "ncg"), [
    (128, 1, 8192, 32, 8, "f16", 1),
    (128, 1, 8192, 32, 8, "bf16", 1),
    (64, 1, 113, 4, 4, "q8_0", 1),
    (64, 4, 512, 8, 1, "q4_0", 2),  # 8 heads x 4 rows = 32 columns: two blocks of 16
    (256, 8, 1024, 16, 2, "f32", 4),
    (96, 3, 100, 6, 3, "f16", 1),
    (64, 2, 1, 2, 2, "f16", 1),
    (128, 1, 4096, 64, 2, "f16", 2),  # GQA 32
    (64, 1, 1025, 32, 8, "f16", 1),
    (64, 1, 768, 32, 8, "f16", 1),  # the 1.1B Llama's short context: a tile a block
    (128, 4, 1024, 32, 4, "bf16", 2),
])
def test_decode_plan(d: int, tq: int, tk: int, hq: int, hkv: int, kv: str, ncg: int) -> None:
    node = fa(d, tq, tk, hq, hkv, kv, mask=True, sinks=od.input("s", (hq,)))
    plan = flash.flash_plan(node, DEV)
    assert plan.kind == "decode"
    assert plan.chunk % flash.DECODE_BN == 0 and (plan.nsplit - 1) * plan.chunk < tk <= plan.nsplit * plan.chunk
    rows = tq * hq
    guard = FakeGuard()
    launches = plan.specs(fake_ptr, [BASE + 2**20, BASE + 2**21, BASE + 2**22], guard)
    assert len(launches) == 1  # one launch: the last split of a group merges, no combine kernel
    assert guard.uses == [] and int(launches[0].args.err_.word) == 0  # unfused: no row ids
    main = launches[0]
    assert main.kernel == flash.decode_kernel(d, kv) and main.kernel in specs.KERNEL_SOURCES[flash.DECODE_CU]
    assert main.grid == (plan.nsplit, hkv * ncg, 1) and main.block == 128
    assert main.smem == flash.decode_smem(d) <= DEV.smem_per_block_optin
    assert spec_types(main) == kernel_param_types(flash.DECODE_CU)["fattn_decode"]
    args = main.args
    assert int(args.sinks) == BASE and int(args.out) == BASE  # fake_ptr
    if plan.nsplit == 1:  # the block finishes the softmax: no workspace
        assert plan.workspaces == () and int(args.ws_acc) == int(args.ws_ml) == int(args.counters) == 0
        return
    assert [(w.nbytes, w.zeroed) for w in plan.workspaces] == [
        (plan.nsplit * rows * d * 4, False), (plan.nsplit * rows * 8, False), (hkv * ncg * 4, True)]
    assert tuple(int(a) for a in (args.ws_acc, args.ws_ml, args.counters)) == (BASE + 2**20, BASE + 2**21,
                                                                                BASE + 2**22)


@pytest.mark.parametrize(("tk", "batch", "nsplit"), [(1, 1, 1), (64, 1, 1), (512, 1, 8), (768, 1, 12),
                                                     (1024, 64, 1), (1025, 1, 17), (2048, 1, 32), (2048, 16, 4)])
def test_decode_splits_short_kv_down_to_a_tile(tk: int, batch: int, nsplit: int) -> None:
    # the 1.1B Llama's attention: 32 query heads on 8 KV heads, D = 64; one block of 8 (a KV
    # head) streaming 12 tiles alone took 17.4 us on the H200, so short KV splits too
    node = ops.flash_attn_ext(od.input("q", (batch, 32, 1, 64)), od.input("k", (batch, 8, tk, 64), "f16"),
                              od.input("v", (batch, 8, tk, 64), "f16"))
    plan = flash.flash_plan(node, DEV)
    assert plan.nsplit == nsplit
    assert len(plan.specs(fake_ptr, [BASE] * len(plan.workspaces), FakeGuard())) == 1


@pytest.mark.parametrize("batch", [1, 16])
def test_decode_splits_fill_the_gpu_in_one_wave(batch: int) -> None:
    node = ops.flash_attn_ext(od.input("q", (batch, 32, 1, 128)), od.input("k", (batch, 8, 8192, 128), "f16"),
                              od.input("v", (batch, 8, 8192, 128), "f16"))
    plan = flash.flash_plan(node, DEV)
    blocks, slots = plan.nsplit * batch * 8, 132 * flash.decode_blocks_per_sm(128, DEV.smem_per_sm)
    assert 0.9 * slots <= blocks <= slots
    assert plan.nsplit == (32 if batch == 1 else 2)
    half = facts(Device("cuda0", "cuda", "a GPU of 66 SMs", {**H200.props, "sm_count": 66}))
    assert flash.flash_plan(node, half).nsplit == plan.nsplit // 2


A100 = facts(Device("cuda0", "cuda", "sm_80 (description)", {**H200.props, "cc": (8, 0)}))


@pytest.mark.parametrize(("d", "kv", "mask", "dev", "wgmma"), [
    (128, "f16", True, A100, False), (64, "bf16", False, A100, False), (80, "f32", True, DEV, False),
    (96, "f16", False, DEV, False), (256, "q8_0", True, DEV, False), (128, "q4_0", False, DEV, False),
    (256, "bf16", True, DEV, False), (128, "f16", True, DEV, True), (128, "bf16", False, DEV, True),
    (64, "bf16", False, DEV, None), (64, "f16", True, DEV, None),
])
def test_prefill_plan(d: int, kv: str, mask: bool, dev: DeviceFacts, wgmma: bool | None) -> None:
    """fattn_prefill_wgmma on compute capability 9.0 for f16/bf16 K/V of the head sizes it is configured for
    (None: where flash.WGMMA_CONFIG has the head size), else fattn_prefill; the grid, block, shared memory and mask
    flags of each kernel's tiles."""
    wgmma = d in flash.WGMMA_CONFIG if wgmma is None else wgmma
    node = fa(d, 300, 1000, 8, 2, kv, mask=mask)
    plan = flash.flash_plan(node, dev)
    assert plan.kind == "prefill"
    assert flash.prefill_wgmma(d, kv, dev) == wgmma
    bm, bn = flash.prefill_tile_m(d, wgmma), flash.prefill_tile_n(d, wgmma)
    assert (bm, bn) == ((64 * flash.WGMMA_CONFIG[d][0], flash.WGMMA_CONFIG[d][1]) if wgmma
                        else (64 if d > 128 else 128, 32 if d > 128 else 64))
    n_qt, n_kt = -(-300 // bm), -(-1000 // bn)
    assert [w.nbytes for w in plan.workspaces] == ([n_qt * n_kt] if mask else [])
    launches = plan.specs(fake_ptr, [BASE + 2**20] if mask else [], FakeGuard())
    main = launches[-1]
    source = flash.PREFILL_WGMMA_CU if wgmma else flash.PREFILL_CU
    assert main.source == source and main.kernel == flash.prefill_kernel(d, kv, wgmma)
    assert main.kernel in specs.KERNEL_SOURCES[source]
    assert main.grid == (n_qt, 8, 1) and main.block == (bm * 2 if wgmma else 128)
    assert main.smem == flash.prefill_smem(d, wgmma) <= DEV.smem_per_block_optin
    assert spec_types(main) == kernel_param_types(source)[main.kernel.split("<")[0]]
    assert int(main.args.n_kv_tiles) == n_kt
    if mask:
        flags = launches[0]
        assert (flags.kernel, flags.grid) == (flash.MASK_FLAGS, (n_kt, n_qt, 1))
        assert spec_types(flags) == kernel_param_types(flash.MASK_CU)["fattn_mask_flags"]
        assert (int(flags.args.bm), int(flags.args.bn)) == (bm, bn)


def test_prefill_nodes_of_one_mask_share_its_flags() -> None:
    """The prefill nodes of a plan reading one mask with the same tiles share its flags (flash.mask_flags_role): the
    first computes them (fattn_mask_flags, then its kernel), the later ones only read that role; another mask, other
    query rows or keys, a state's mask (set_rows may write it between them) or no shared dict: flags of their own."""
    q, k, v = od.input("q", (1, 8, 300, 128)), od.input("k", (1, 2, 1000, 128), "f16"), od.input("v", (1, 2, 1000, 128),
                                                                                                "f16")
    mask, other = od.input("m", (1, 1, 304, 1000), "f16"), od.input("m2", (1, 1, 304, 1000), "f16")
    cache = od.state("c", (1, 1, 304, 1000), "f16")

    def node(m: Tensor, tq: int = 300) -> Tensor:
        return ops.flash_attn_ext(q if tq == 300 else od.input("q1", (1, 8, tq, 128)), k, v, m, 0.1)

    def kernels(plan: flash.FlashPlan) -> list[str]:
        return [s.kernel.split("<")[0] for s in plan.specs(fake_ptr, [BASE], FakeGuard())]

    shared: dict = {}
    first, again, new_mask, shorter = (flash.flash_plan(n, DEV, shared=shared)
                                       for n in (node(mask), node(mask), node(other), node(mask, 200)))
    assert kernels(first) == ["fattn_mask_flags", "fattn_prefill_wgmma"] and kernels(again) == ["fattn_prefill_wgmma"]
    assert first.workspaces == again.workspaces
    for own in (new_mask, shorter):
        assert kernels(own) == kernels(first) and own.workspaces[0].what not in (
            first.workspaces[0].what, *(w.what for p in (new_mask, shorter) if p is not own for w in p.workspaces))
    assert kernels(flash.flash_plan(node(other), DEV, shared=shared)) == ["fattn_prefill_wgmma"]
    for _ in range(2):  # a state's mask, and a plan of its own (no shared dict): computed every time
        assert kernels(flash.flash_plan(node(cache), DEV, shared=shared)) == kernels(first)
        assert kernels(flash.flash_plan(node(mask), DEV)) == kernels(first)


def test_prefill_wgmma_smem_fits_the_h200() -> None:
    """Q and the K/V stages of every configured fattn_prefill_wgmma, and its 1024-byte alignment, within a block's
    227 KiB."""
    for d, (wgs, bn, stages) in flash.WGMMA_CONFIG.items():
        assert flash.prefill_smem(d, True) == 1024 + 2 * d * (64 * wgs + stages * 2 * bn) <= DEV.smem_per_block_optin


def test_every_name_expression_is_declared_for_the_compile_test() -> None:
    assert set(specs.KERNEL_SOURCES) == set((Path(ca.__file__).parent / "kernels").glob("*.cu"))
    for d, kv, tq in itertools.product(flash.HEAD_SIZES, flash.KV_TYPES, (1, 2, 5, 8, 9, 64)):
        if kv.startswith("q") and d % 32:
            continue  # block formats need rows of whole blocks
        for spec in flash.flash_plan(fa(d, tq, 200, 8, 2, kv, mask=True), DEV).specs(fake_ptr, [BASE] * 3,
                                                                                     FakeGuard()):
            assert spec.kernel in specs.KERNEL_SOURCES[spec.source]


# -- on a GPU ------------------------------------------------------------------------------------------

FA_BOUND = bound("flash_attn_ext")  # 5e-4
SOFT_MAX_BOUND = bound("soft_max")  # 1e-6


def assert_close(got: np.ndarray, ref: np.ndarray, limit: float, what: str) -> None:
    assert got.shape == ref.shape, what
    assert not np.isnan(got).any(), f"{what}: NaN in the output (an element not written?)"
    err = nmse(got, ref)
    assert err <= limit, f"{what}: NMSE {err:.3g} > {limit:g}"


def run_on_gpu(outputs: Tensor | list[Tensor], feeds: dict, **kw: object) -> tuple[od.Plan, list[np.ndarray]]:
    """Run on cuda0 (arenas poisoned first) with every attention node taken by cuda_attention there."""
    plan = od.compile(outputs, "cuda0", **kw)
    for s in plan.steps:
        if s.kind in ("kernel", "fused") and s.nodes[0].op in ATTN_OPS:
            assert (s.plugin, s.device.name) == ("cuda_attention", "cuda0"), plan.explain()
    plan.poison()
    return plan, plan.run(feeds)


def reference(outputs: Tensor | list[Tensor], feeds: dict) -> list[np.ndarray]:
    return od.compile(outputs, "cpu").run(feeds)


def check_case(y: Tensor, inp: Inputs, limit: float, what: str) -> None:
    _, (got,) = run_on_gpu(y, inp.feeds)
    (ref,) = reference(y, inp.feeds)
    assert_close(got, ref, limit, what)


# soft_max: (shape, mask shape or None, mask dtype, scale, max_bias, sinks, layout, empty rows)
SOFT_MAX_CASES = {
    "1 column": ((4, 1), None, None, 1.0, 0.0, False, "contig", False),
    "5 columns, f16 mask": ((2, 4, 3, 5), (1, 1, 3, 5), "f16", 0.1, 0.0, False, "contig", False),
    "1-d": ((33,), None, None, 0.1, 0.0, True, "contig", False),
    "16, f32 mask, alibi, sinks": ((2, 4, 3, 16), (1, 1, 3, 16), "f32", 1.0, 8.0, True, "contig", False),
    "33, mask rows > R, batch broadcast": ((2, 4, 3, 33), (2, 1, 8, 33), "f16", 0.1, 8.0, True, "contig", False),
    "33, per-head mask": ((2, 4, 3, 33), (1, 4, 16, 33), "f16", 0.1, 8.0, True, "contig", False),
    "33, full mask": ((2, 4, 3, 33), (2, 4, 3, 33), "f32", 0.1, 0.0, False, "contig", False),
    "1023 float4-less, fully masked rows": ((2, 4, 4, 1023), (1, 1, 4, 1023), "f16", 1.0, 0.0, False, "contig", True),
    "1024, fully masked rows and sinks": ((2, 4, 4, 1024), (1, 1, 4, 1024), "f16", 1.0, 8.0, True, "contig", True),
    "4096, f16 mask": ((1, 8, 16, 4096), (1, 1, 16, 4096), "f16", 0.088, 0.0, False, "contig", False),
    "4097, f32 mask": ((1, 4, 5, 4097), (1, 1, 5, 4097), "f32", 0.1, 8.0, True, "contig", False),
    "32768 (float4, register cache full)": ((1, 2, 3, 32768), (1, 1, 3, 32768), "f16", 0.1, 0.0, True, "contig", False),
    "40000 (two passes, float4)": ((1, 2, 2, 40000), (1, 1, 2, 40000), "f32", 0.1, 8.0, False, "contig", False),
    "200001 (two passes)": ((1, 3, 2, 200001), None, None, 1.0, 0.0, False, "contig", False),
    "200001, f32 mask, alibi, sinks": ((1, 3, 2, 200001), (1, 1, 2, 200001), "f32", 0.1, 8.0, True, "contig", False),
    "200001, f16 mask, masked rows": ((1, 2, 2, 200001), (1, 1, 2, 200001), "f16", 0.1, 0.0, True, "contig", True),
    "permuted heads/rows": ((2, 4, 3, 64), (1, 1, 4, 64), "f16", 0.1, 8.0, True, "perm", False),
    "strided rows (misaligned)": ((3, 5, 100), (1, 5, 100), "f16", 0.1, 0.0, False, "strided", False),
    "strided long rows": ((2, 2, 50000), (1, 2, 50000), "f32", 1.0, 0.0, True, "strided", False),
}


@gpu
@pytest.mark.parametrize("case", list(SOFT_MAX_CASES))
def test_soft_max_matches_the_reference(case: str, rng) -> None:  # noqa: ANN001
    shape, mshape, mdt, scale, max_bias, sinks, layout, empty = SOFT_MAX_CASES[case]
    inp = Inputs(rng)
    a = inp.uniform(shape, layout=layout)
    m = inp.mask(mshape, mdt, empty) if mshape else None
    s = inp.uniform((pad4_(shape)[1],)) if sinks else None
    check_case(ops.soft_max(a, m, scale, max_bias, s), inp, SOFT_MAX_BOUND, f"soft_max {case}")


def pad4_(shape: tuple) -> tuple:
    return (1,) * (4 - len(shape)) + tuple(shape)


# rope: dtype, mode, shape, n_dims, freq factors, yarn, layout
ROPE_CASES = [
    (dt, mode, shape, n_dims, ff, yarn, layout)
    for (dt, mode, ff, yarn), (shape, n_dims, layout) in zip(
        itertools.product(("f32", "f16"), ("normal", "neox"), (False, True), (False, True)),
        itertools.cycle([((2, 13, 4, 64), 64, "contig"), ((1, 7, 3, 128), 64, "perm"), ((2, 5, 4, 80), 80, "strided"),
                         ((1, 9, 2, 96), 32, "contig"), ((3, 4, 5, 128), 128, "perm"), ((1, 1, 1, 66), 40, "contig")]))
] + [  # the chunk layout (16-byte packs) in every dtype and mode, 20 heads, pass-through chunks, the fallback
    (dt, mode, shape, n_dims, ff, ff, layout) for dt, mode in itertools.product(("f32", "f16"), ("normal", "neox"))
    for shape, n_dims, ff, layout in [((2, 6, 12, 128), 96, True, "contig"), ((1, 3, 8, 64), 64, False, "perm"),
                                      ((1, 4, 3, 128), 128, False, "strided"), ((1, 5, 20, 128), 128, False, "contig")]
] + [  # launches large enough for several heads a thread, in rounds of ROPE_HEADS_IN_FLIGHT, uneven head groups
    (dt, mode, (1, 6000, 20, 128), n_dims, True, False, "contig")
    for dt, mode, n_dims in [("f32", "normal", 128), ("f16", "neox", 128), ("f16", "normal", 96), ("f32", "neox", 64)]
] + [  # 32 heads: lanes of 2 (f32) or 4 (f16) head groups share a chunk's angles, several heads a thread
    (dt, mode, (1, 2048, 32, 128), 128, ff, False, "contig") for dt, mode, ff in [("f32", "neox", False),
                                                                                  ("f16", "normal", True)]
]


@gpu
@pytest.mark.parametrize(("dt", "mode", "shape", "n_dims", "ff", "yarn", "layout"), ROPE_CASES)
def test_rope_matches_the_reference(dt: str, mode: str, shape: tuple, n_dims: int, ff: bool, yarn: bool,
                                    layout: str, rng) -> None:  # noqa: ANN001
    inp = Inputs(rng)
    params = dict(freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0,
                  n_ctx_orig=0)
    if yarn:
        params.update(freq_base=500000.0, freq_scale=0.25, ext_factor=1.0, attn_factor=1.2, n_ctx_orig=4096)
    x = inp.uniform(shape, dt, layout=layout)
    f = inp.uniform((n_dims // 2,), lo=0.9, hi=1.1) if ff else None
    y = ops.rope(x, inp.ints((shape[1],), 0, 512), n_dims, mode, freq_factors=f, **params)
    check_case(y, inp, bound("rope", dt), f"rope {dt} {mode} {shape} n_dims={n_dims} ff={ff} yarn={yarn} {layout}")


def fa_graph(inp: Inputs, d: int, tq: int, tk: int, hq: int, hkv: int, kv: str = "f16", mask: str = "",
             batch: int = 1, sinks: bool = False, max_bias: float = 0.0, softcap: float = 0.0, q_dtype: str = "f32",
             layout: str = "perm", mask_shape: tuple | None = None) -> Tensor:
    """flash_attn_ext on inputs laid out like ggml's KV cache ('perm': tokens outside heads)."""
    q = inp.uniform((batch, hq, tq, d), q_dtype, layout="perm")
    if layout == "misaligned":  # rows start 2 bytes (one f16) past a 16-byte boundary: no 16-byte loads
        kl = inp.uniform((batch, hkv, tk, d + 32), kv)
        vl = inp.uniform((batch, hkv, tk, d + 32), kv)
        unit = kl.dtype.block_bytes if not kl.dtype.is_quant else kl.dtype.block_bytes
        k = kl.view((batch, hkv, tk, d), kl.strides, unit)
        v = vl.view((batch, hkv, tk, d), vl.strides, unit)
    else:
        k = inp.uniform((batch, hkv, tk, d), kv, layout=layout)
        v = inp.uniform((batch, hkv, tk, d), kv, layout=layout)
    m = None
    if mask:
        rows = -(-tq // 16) * 16
        shape = mask_shape or (1, 1, rows, tk)
        if mask == "causal":  # query row t sees keys up to tk - tq + t
            r = np.arange(shape[2])[:, None]
            c = np.arange(tk)[None, :]
            values = np.broadcast_to(np.where(c > tk - tq + r, -np.inf, 0.0), shape)
            if max_bias:
                values = values - np.abs(c - r) / tk
            m = inp._leaf(shape, "f16", values)
        else:
            m = inp.mask(shape, "f16", empty_rows=mask == "empty rows")
    s = inp.uniform((hq,)) if sinks else None
    return ops.flash_attn_ext(q, k, v, m, 1.0 / math.sqrt(d), max_bias, softcap, s)


FA_CASES: dict[str, dict] = {}
# head sizes x query rows (decode 1/4, prefill 128/35) x GQA 1/4/8 x kv 113/512/1024, with and without mask
for _d in flash.HEAD_SIZES:
    for _tq, _gqa, _tk, _mask in [(1, 1, 113, "random"), (1, 4, 1024, ""), (1, 8, 512, "random"), (4, 4, 113, "random"),
                                  (4, 1, 512, ""), (4, 8, 1024, "random"), (128, 1, 113, "random"), (128, 4, 512, ""),
                                  (128, 8, 1024, "random"), (35, 4, 1024, "causal"), (8, 2, 300, "random")]:
        FA_CASES[f"d={_d} q={_tq} gqa={_gqa} kv={_tk} mask={_mask or 'none'}"] = dict(
            d=_d, tq=_tq, tk=_tk, hq=2 * _gqa, hkv=2, mask=_mask)
# every K/V type, with sinks / ALiBi / softcap, decode and prefill
for _kv, _d, _tq in itertools.product(("f32", "f16", "bf16", "q8_0", "q4_0"), (64, 128), (1, 4, 128)):
    _opt = {1: dict(sinks=True), 4: dict(max_bias=8.0, mask="random"), 128: dict(softcap=10.0, mask="random")}[_tq]
    FA_CASES[f"{_kv} d={_d} q={_tq} {_opt}"] = dict(d=_d, tq=_tq, tk=512, hq=8, hkv=2, kv=_kv, **_opt)
    FA_CASES[f"{_kv} d={_d} q={_tq} all options"] = dict(d=_d, tq=_tq, tk=113, hq=4, hkv=4, kv=_kv, mask="random",
                                                         sinks=True, max_bias=8.0, softcap=10.0, batch=2)
for _tq in (1, 4, 64):
    FA_CASES[f"empty rows q={_tq}"] = dict(d=64, tq=_tq, tk=113, hq=4, hkv=2, mask="empty rows")
    FA_CASES[f"empty rows and sinks q={_tq}"] = dict(d=64, tq=_tq, tk=113, hq=4, hkv=2, mask="empty rows", sinks=True)
    FA_CASES[f"mask per batch and head q={_tq}"] = dict(d=64, tq=_tq, tk=200, hq=4, hkv=2, mask="random", batch=2,
                                                      mask_shape=(2, 4, -(-_tq // 16) * 16, 200))
    FA_CASES[f"q f16 q={_tq}"] = dict(d=128, tq=_tq, tk=300, hq=8, hkv=2, mask="random", q_dtype="f16")
    FA_CASES[f"contiguous kv q={_tq}"] = dict(d=96, tq=_tq, tk=300, hq=8, hkv=1, mask="random", layout="contig")
    for _kv in ("f16", "bf16", "f32", "q8_0"):
        FA_CASES[f"misaligned {_kv} q={_tq}"] = dict(d=64, tq=_tq, tk=100, hq=4, hkv=2, kv=_kv, mask="random",
                                                    layout="misaligned")
for _kv in ("f16", "bf16"):  # prefill of head size 128 (fattn_prefill_wgmma on the H200) with no 16-byte loads
    FA_CASES[f"misaligned {_kv} d=128 causal q=130"] = dict(d=128, tq=130, tk=300, hq=4, hkv=2, kv=_kv, mask="causal",
                                                           layout="misaligned")
FA_CASES["long kv 8192 decode gqa 4"] = dict(d=128, tq=1, tk=8192, hq=32, hkv=8, batch=2)
FA_CASES["long kv 8192 decode bf16 mask"] = dict(d=128, tq=1, tk=8192, hq=8, hkv=2, kv="bf16", mask="random")
FA_CASES["long kv 8192 prefill causal"] = dict(d=128, tq=256, tk=8192, hq=4, hkv=1, mask="causal")
FA_CASES["causal 300x300 alibi"] = dict(d=64, tq=300, tk=300, hq=4, hkv=2, mask="causal", max_bias=8.0)
FA_CASES["causal d=256 bf16 sinks"] = dict(d=256, tq=200, tk=200, hq=2, hkv=1, kv="bf16", mask="causal", sinks=True)
# prefill: query tiles of 128 rows (64 for d=256) with a partial last one, causal tile skipping
# (diagonal tiles read the mask, tiles above it are skipped), kv lengths not a multiple of the tile
for _d, _tq, _tk in [(128, 1000, 1000), (64, 129, 129), (96, 255, 300), (80, 130, 1024), (256, 65, 113),
                     (128, 2048, 2048)]:
    FA_CASES[f"prefill causal d={_d} q={_tq} kv={_tk}"] = dict(d=_d, tq=_tq, tk=_tk, hq=4, hkv=1, mask="causal",
                                                              q_dtype="f16")
FA_CASES["prefill causal bf16 softcap q=300 kv=1200"] = dict(d=128, tq=300, tk=1200, hq=4, hkv=2, kv="bf16",
                                                             mask="causal", softcap=10.0)
FA_CASES["prefill q8_0 causal q=200 kv=700"] = dict(d=128, tq=200, tk=700, hq=2, hkv=1, kv="q8_0", mask="causal")
FA_CASES["prefill no mask q=131 kv=1000 gqa 4"] = dict(d=128, tq=131, tk=1000, hq=8, hkv=2)
# prefill tiles with no mask reads (all-zero mask blocks, no mask) on the unchecked cp.async loader
# of D = 64 / 128 / 256, the scale folded into the exponent, beside diagonal tiles and sinks
FA_CASES["prefill no mask d=64 q=256 kv=1024 gqa 2"] = dict(d=64, tq=256, tk=1024, hq=4, hkv=2, q_dtype="f16")
FA_CASES["prefill no mask d=256 bf16 q=128 kv=512"] = dict(d=256, tq=128, tk=512, hq=2, hkv=1, kv="bf16")
FA_CASES["prefill causal sinks d=128 q=640 kv=640 gqa 4"] = dict(d=128, tq=640, tk=640, hq=8, hkv=2, mask="causal",
                                                                 sinks=True, q_dtype="f16")
# prefill block order (q tiles in phases of halving length across batch and heads: 9 tiles -> 5, 2, 2)
# with batch 3, and whole mixed (diagonal) tiles read as 32-bit mask pairs, ALiBi on, a partial q tile
FA_CASES["prefill causal alibi batch 3 d=128 q=1100 kv=1100 gqa 2"] = dict(d=128, tq=1100, tk=1100, hq=4, hkv=2,
                                                                          mask="causal", max_bias=8.0, batch=3,
                                                                          q_dtype="f16")
# decode: many splits of 64-key tiles, kv not a multiple of 64, more than 16 columns a KV head
FA_CASES["decode q=8 gqa 8 (64 columns) kv=5000"] = dict(d=128, tq=8, tk=5000, hq=16, hkv=2, mask="random")
FA_CASES["decode gqa 32 kv=3001 bf16 sinks"] = dict(d=128, tq=1, tk=3001, hq=64, hkv=2, kv="bf16", sinks=True)
FA_CASES["decode batch 16 kv=8192"] = dict(d=128, tq=1, tk=8192, hq=32, hkv=8, batch=16)
FA_CASES["decode d=256 q=2 kv=4097 alibi softcap"] = dict(d=256, tq=2, tk=4097, hq=8, hkv=2, mask="random",
                                                          max_bias=8.0, softcap=10.0)
FA_CASES["decode q4_0 kv=6000 q=3"] = dict(d=64, tq=3, tk=6000, hq=8, hkv=1, kv="q4_0", mask="random")
# short-KV decode, split down to a tile a block: the last block of each group merges the partials,
# adds the sinks and writes the output; and one split (one tile, or more groups than the GPU holds at
# once): the block finishes the softmax itself
FA_CASES["short kv llama 1.1b d=64 gqa 4 kv=768"] = dict(d=64, tq=1, tk=768, hq=32, hkv=8)
FA_CASES["short kv d=64 gqa 4 kv=700 mask batch 3"] = dict(d=64, tq=1, tk=700, hq=32, hkv=8, mask="random",
                                                            batch=3)
FA_CASES["short kv d=128 gqa 8 kv=512 causal sinks batch 2"] = dict(d=128, tq=1, tk=512, hq=16, hkv=2,
                                                                     mask="causal", sinks=True, batch=2)
FA_CASES["short kv d=64 gqa 8 kv=1000 sinks no mask"] = dict(d=64, tq=1, tk=1000, hq=8, hkv=1, sinks=True)
FA_CASES["short kv d=128 gqa 4 kv=1024 mask sinks batch 4"] = dict(d=128, tq=1, tk=1024, hq=32, hkv=8,
                                                                    mask="random", sinks=True, batch=4)
FA_CASES["short kv d=128 gqa 4 kv=1025 mask sinks batch 4"] = dict(d=128, tq=1, tk=1025, hq=32, hkv=8,
                                                                mask="random", sinks=True, batch=4)
FA_CASES["short kv q=4 gqa 8 (2 column groups) kv=900 alibi softcap"] = dict(
    d=64, tq=4, tk=900, hq=16, hkv=2, mask="random", max_bias=8.0, softcap=10.0, batch=2)
FA_CASES["one split kv=60 mask sinks batch 2"] = dict(d=64, tq=1, tk=60, hq=32, hkv=8, mask="random", sinks=True,
                                                      batch=2)
FA_CASES["one split batch 40 kv=1000 gqa 4"] = dict(d=128, tq=1, tk=1000, hq=32, hkv=8, mask="random", batch=40)
FA_CASES["short kv empty rows and sinks q=2 kv=640 batch 2"] = dict(d=128, tq=2, tk=640, hq=8, hkv=2,
                                                                     mask="empty rows", sinks=True, batch=2)
FA_CASES["short kv bf16 d=128 gqa 8 kv=333 f16 q"] = dict(d=128, tq=1, tk=333, hq=16, hkv=2, kv="bf16",
                                                           mask="random", q_dtype="f16")
FA_CASES["short kv q8_0 d=64 gqa 4 kv=1024 sinks batch 2"] = dict(d=64, tq=1, tk=1024, hq=8, hkv=2, kv="q8_0",
                                                                   mask="random", sinks=True, batch=2)


@gpu
@pytest.mark.parametrize("case", list(FA_CASES))
def test_flash_attn_ext_matches_the_reference(case: str, rng) -> None:  # noqa: ANN001
    inp = Inputs(rng)
    y = fa_graph(inp, **FA_CASES[case])
    check_case(y, inp, FA_BOUND, f"flash_attn_ext {case}")


#: the cases fattn_prefill_wgmma takes on a compute capability 9.0 GPU
WGMMA_CASES = [case for case, kw in FA_CASES.items() if kw["tq"] > flash.DECODE_MAX_TQ
               and flash.prefill_wgmma(kw["d"], kw.get("kv", "f16"), DEV)]


def test_the_wgmma_prefill_cases_cover_its_configurations() -> None:
    """Every head size and K/V type of fattn_prefill_wgmma, causal and partial tiles, misaligned rows (no cp.async),
    softcap, ALiBi and sinks are among the GPU cases it runs on the H200."""
    kws = [FA_CASES[c] for c in WGMMA_CASES]
    assert {(kw["d"], kw.get("kv", "f16")) for kw in kws} == set(itertools.product(flash.WGMMA_CONFIG,
                                                                                   flash.WGMMA_KV_TYPES))
    assert any(kw.get("mask") == "causal" and kw["tq"] % 128 for kw in kws)
    assert any(kw.get("layout") == "misaligned" for kw in kws)
    assert all(any(kw.get(opt) for kw in kws) for opt in ("softcap", "max_bias", "sinks"))


@gpu
@pytest.mark.parametrize("case", WGMMA_CASES)
def test_mma_sync_prefill_matches_the_reference(case: str, rng, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The cases the H200 runs on fattn_prefill_wgmma, on fattn_prefill (what other GPUs run them on)."""
    monkeypatch.setattr(flash, "WGMMA_KV_TYPES", ())
    inp = Inputs(rng)
    y = fa_graph(inp, **FA_CASES[case])
    assert flash.flash_plan(y, DEV).specs(fake_ptr, [BASE], FakeGuard())[-1].kernel.startswith("fattn_prefill<")
    _, (got,) = run_on_gpu(y, inp.feeds)
    (ref,) = reference(y, inp.feeds)
    assert_close(got, ref, FA_BOUND, f"flash_attn_ext on fattn_prefill {case}")


@gpu
def test_prefills_of_one_mask_read_the_flags_the_first_computed(rng) -> None:  # noqa: ANN001
    """A chain of prefill attentions reading masks a, b, a (each one's q the one before's output): the third reads
    the flags the first computed in the same run (one fattn_mask_flags launch a mask: two roles in the plan's
    shared dict), which b's did not overwrite; a and b skip different tiles, so reading b's flags would be wrong.
    All three match the reference on every run."""
    inp = Inputs(rng)
    tq, tk, d = 300, 1000, 128
    k, v = (inp.uniform((1, 2, tk, d), "f16", layout="perm") for _ in range(2))
    rows = -(-tq // 16) * 16
    causal = np.where(np.arange(tk)[None, :] > tk - tq + np.arange(rows)[:, None], -np.inf, 0.0)
    a = inp._leaf((1, 1, rows, tk), "f16", causal[None, None])
    b = inp.mask((1, 1, rows, tk), "f16", hidden=(128, 640))
    q, outs = inp.uniform((1, 8, tq, d), layout="perm"), []
    for m in (a, b, a):
        outs.append(ops.flash_attn_ext(q, k, v, m, 1.0 / math.sqrt(d)))
        q = ops.permute(outs[-1], (0, 2, 1, 3))
    plan, got = run_on_gpu(outs, inp.feeds)
    shared = plan._bind().shared["cuda0"]
    assert sum(1 for key in shared if key[:1] == (flash.MASK_FLAGS,)) == 2
    refs = reference(outs, inp.feeds)
    for run in range(2):
        for i, (g, r) in enumerate(zip(got, refs)):
            assert_close(g, r, FA_BOUND, f"prefill {i} (mask {'aba'[i]}), run {run + 1}")
        plan.poison()
        got = plan.run(inp.feeds)


@gpu
def test_split_decode_counters_reset_between_runs(rng) -> None:  # noqa: ANN001
    # the last split of each group merges and zeroes the group's counter: a counter left over
    # from a run would make a wrong block merge (missing partials) or none (output unwritten)
    inp = Inputs(rng)
    y = fa_graph(inp, 64, 1, 768, 32, 8, mask="random", sinks=True)
    plan, (first,) = run_on_gpu(y, inp.feeds)
    assert flash.flash_plan(y, DEV).nsplit > 1
    (ref,) = reference(y, inp.feeds)
    assert_close(first, ref, FA_BOUND, "split decode, first run")
    for i in range(3):
        plan.poison()
        (again,) = plan.run(inp.feeds)
        np.testing.assert_array_equal(again, first, err_msg=f"run {i + 2} differs from the first")


@gpu
@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("idx", ["i32", "i64"])
@pytest.mark.parametrize(("mode", "n_tok"), [("normal", 1), ("neox", 7), ("neox", 64), ("normal", 13)])
def test_fused_rope_set_rows_matches_unfused_and_reference(cache: str, idx: str, mode: str, n_tok: int,
                                                           rng) -> None:  # noqa: ANN001
    heads, d, rows = 8, 128, 256
    inp = Inputs(rng)
    k = inp.uniform((1, n_tok, heads, d), layout="perm")
    kr = ops.rope(k, inp.ints((n_tok,), 0, 512), d, mode, freq_factors=inp.uniform((d // 2,), lo=0.9, hi=1.1))
    dst = od.state("cache", (rows, heads * d), cache, init=rng.uniform(-1, 1, (rows, heads * d)))
    y = ops.set_rows(dst, kr.view((n_tok, heads * d)), inp.ids((n_tok,), rows, idx))
    plan, (fused,) = run_on_gpu(y, inp.feeds)
    assert len(plan.fusions) == 1, plan.explain()
    limit = bound("set_rows", cache)
    ref_plan = od.compile(y, "cpu")
    ref_plan.write(dst, dst.data.view(np.float32 if cache == "f32" else np.float16).reshape(rows, heads * d))
    (ref,) = ref_plan.run(inp.feeds)
    assert_close(fused.astype(np.float64), ref.astype(np.float64), limit, f"fused rope+set_rows {cache} {idx}")
    plan2, _ = run_on_gpu(y, inp.feeds, fusion=False)
    assert not plan2.fusions
    plan2.write(dst, dst.data.view(np.float32 if cache == "f32" else np.float16).reshape(rows, heads * d))
    (unfused,) = plan2.run(inp.feeds)
    assert_close(fused.astype(np.float64), unfused.astype(np.float64), limit, "fused vs unfused")


@gpu
@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("idx", ["i32", "i64"])
@pytest.mark.parametrize(("mode", "rows", "d", "n_dims"), [
    ("neox", 1, 64, 64), ("normal", 4, 128, 128), ("neox", 16, 64, 32), ("neox", 300, 128, 128),
    ("normal", 5, 66, 40),  # rows that 16-byte chunks do not tile: the pair layout, v a value a thread
])
@STACKED
def test_fused_rope_qkv_matches_unfused_and_reference(cache: str, idx: str, mode: str, rows: int, d: int,
                                                      n_dims: int, stacked: bool, rng) -> None:  # noqa: ANN001
    inp = Inputs(rng)
    outputs = qkv_step(inp, cache, idx, mode, rows=rows, d=d, n_dims=n_dims, ctx=512, stacked=stacked)
    plan = check_cache_step(outputs, inp.feeds, {"q": bound("rope"), "K cache": bound("set_rows", cache),
                                                 "V cache": bound("set_rows", cache)}, f"{cache} {idx} {mode}")
    assert [(s.plugin, s.kernel) for s in plan.fusions] == [("cuda_attention", "rope_qkv_set_rows")], plan.explain()


def check_cache_step(outputs: list[Tensor], feeds: dict, limits: dict[str, float], label: str,
                     times: int = 1) -> od.Plan:
    """Runs `outputs` (the last ones: set_rows results into caches) fused on cuda0, unfused on cuda0 and on
    the CPU, each from the caches' initial rows (plans on one device share their buffers) with arenas
    poisoned, `times` times on cuda0 fused (more than one: CUDA-graph replays); asserts the outputs, named
    by `limits`' keys, agree within their bounds. Returns the fused plan."""
    caches = [o.base for o in outputs[1:]]

    def run(device: str, times: int = 1, **kw: object) -> tuple[od.Plan, list[np.ndarray]]:
        plan = od.compile(outputs, device, **kw)
        for _ in range(times):
            for c in caches:
                plan.write(c, c.data.view(np.float32 if c.dtype.name == "f32" else np.float16).reshape(c.shape))
            plan.poison()
            got = plan.run(feeds)
        return plan, got

    plan, fused = run("cuda0", times)
    plain_plan, plain = run("cuda0", fusion=False)
    assert not plain_plan.fusions
    _, ref = run("cpu")
    for (what, limit), got, want, other in zip(limits.items(), fused, ref, plain):
        got = got.astype(np.float64)
        assert_close(got, want.astype(np.float64), limit, f"fused {what} vs reference ({label})")
        assert_close(got, other.astype(np.float64), limit, f"fused {what} vs unfused ({label})")
    return plan


@gpu
@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("idx", ["i32", "i64"])
@pytest.mark.parametrize(("mode", "seqs", "d", "ctx"), [
    ("neox", 1, 64, 320), ("normal", 3, 128, 320), ("neox", 3, 128, 1100), ("neox", 8, 64, 777),
])
@STACKED
def test_fused_decode_attention_matches_unfused_and_reference(cache: str, idx: str, mode: str, seqs: int, d: int,
                                                              ctx: int, stacked: bool, rng) -> None:  # noqa: ANN001
    inp = Inputs(rng)
    outputs = attn_step(inp, cache, idx, mode, seqs=seqs, d=d, ctx=ctx, stacked=stacked)
    limits = {"attention": bound("flash_attn_ext"), "K cache": bound("set_rows", cache),
              "V cache": bound("set_rows", cache)}
    plan = check_cache_step(outputs, inp.feeds, limits, f"{cache} {idx} {mode}", times=3)
    assert "rope_qkv_flash_attn_ext" in [s.kernel for s in plan.fusions], plan.explain()


@gpu
@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("seqs", [2, 5, 16])
def test_fused_decode_attention_at_the_1b_batch_matches_unfused_and_reference(cache: str, mode: str, seqs: int,
                                                                               rng) -> None:  # noqa: ANN001
    # The 1b preset's attention (32 / 8 heads, D = 64, a 768-key window; 16 sequences: 4 splits of 3 tiles),
    # each sequence at its own position: the attention and both caches as unfused and on the CPU, and the
    # new K/V rows written at their ids only (every other row as it was).
    inp = Inputs(rng)
    outputs = attn_step(inp, cache, "i64", mode, seqs=seqs, heads=32, kv_heads=8, ctx=768)
    limits = {"attention": bound("flash_attn_ext"), "K cache": bound("set_rows", cache),
              "V cache": bound("set_rows", cache)}
    plan = check_cache_step(outputs, inp.feeds, limits, f"{seqs} sequences {cache} {mode}", times=2)
    (step,) = plan.fusions
    assert step.kernel == "rope_qkv_flash_attn_ext", plan.explain()
    ids = inp.feeds[fusion.fused_qkv(step.nodes).idx].astype(np.int64)
    others = np.setdiff1d(np.arange(seqs * 768), ids)
    caches = [o.base for o in outputs[1:]]
    initial = [c.data.view(np.float32 if cache == "f32" else np.float16).reshape(c.shape) for c in caches]
    runs = []
    for where in ("cuda0", "cpu"):
        run = od.compile(outputs, where)
        for c, rows in zip(caches, initial):
            run.write(c, rows)
        run.poison()
        runs.append(run.run(inp.feeds)[1:])
    for what, got, want, rows in zip(("K cache", "V cache"), *runs, initial):
        got, want = (x.reshape(rows.shape).astype(np.float64) for x in (got, want))
        assert np.array_equal(got[others], rows[others].astype(np.float64)), f"{what}: a row not at the ids changed"
        assert_close(got[ids], want[ids], limits[what], f"{what}: the new rows")
        assert not np.array_equal(got[ids], rows[ids].astype(np.float64)), f"{what}: the new rows not written"


def attention_block(seed: int) -> tuple[list[Tensor], dict]:
    """rope, soft_max, decode and prefill attention in one graph, on fresh inputs drawn from `seed`."""
    inp = Inputs(np.random.default_rng(seed))
    kr = ops.rope(inp.uniform((1, 9, 4, 64)), inp.ints((9,), 0, 512), 64, "neox")
    sm = ops.soft_max(inp.uniform((2, 4, 9, 300)), inp.mask((1, 1, 9, 300)), 0.1, 8.0)
    dec = fa_graph(inp, 128, 1, 2048, 32, 8, mask="random", sinks=True)
    pre = fa_graph(inp, 64, 100, 300, 4, 2, mask="causal")
    return [kr, sm, dec, pre], inp.feeds


@gpu
def test_cuda_graph_replay_matches_direct_launches(monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    seeds = [int(s) for s in rng.integers(0, 2**31, 4)]
    results = {}
    for disabled in ("1", "0"):
        monkeypatch.setenv("OPDISPATCH_DISABLE_CUDA_GRAPHS", disabled)
        results[disabled] = []
        for seed in seeds:  # structurally equal graphs: one cached plan, bound once (direct, capture, replays)
            outputs, feeds = attention_block(seed)
            plan = od.compile(outputs, "cuda0")
            results[disabled].append(plan.run(feeds))
        assert_graph_segments(plan, disabled)
    outputs, feeds = attention_block(seeds[-1])
    for got, ref in zip(results["0"][-1], reference(outputs, feeds)):
        assert_close(got, ref, FA_BOUND, "replayed graph vs reference")
    for direct, replayed in zip(results["1"], results["0"]):
        for a, b in zip(direct, replayed):
            assert np.array_equal(a, b)


@gpu
@pytest.mark.parametrize("case", edge_cases("soft_max", "flash_attn_ext"))
def test_edge_values_match_the_reference(case, seed: int) -> None:  # noqa: ANN001
    """The sweep's edge-value cases (docs/ops.md, "Edge values") on cuda_attention, NaN positions included:
    soft_max rows of -inf (zeros), with a NaN or +inf (NaN); flash_attn_ext with NaN K rows under the mask
    (skipped) and fully masked rows (zeros), in the decode and the prefill kernel."""
    res = run_case(case, "cuda0", plugin="cuda_attention", seed=seed)
    assert res.status is Status.PASS, res.describe()
