"""Tensor split: the shard rules on device descriptions, the host rendezvous, and the whole path over two CPU
devices (cpu0, cpu1: their all_reduce_sum is a numpy sum of the ranks' parts) against one device; on two
GPUs (marked gpu), against one GPU, with the all-reduces by NCCL."""

from __future__ import annotations

import re
import threading

import attrs
import numpy as np
import pytest

from opdispatch import ops
from opdispatch.backends.cuda.devices import H200
from opdispatch.compiler import compile
from opdispatch.dtypes import to_host_float
from opdispatch.errors import LaunchError, OpError, PlacementError
from opdispatch.group import GroupPlan
from opdispatch.hookspecs import Device
from opdispatch.models.generate import Generator
from opdispatch.models.llama.config import PRESETS
from opdispatch.models.llama.model import LlamaModel
from opdispatch.models.llama.names import random_weights
from opdispatch.models.llama.split import tensor_split
from opdispatch.plugins.nccl.support import all_reduce_ok, nccl_module
from opdispatch.reference.collective import HostGroup
from opdispatch.shard import Shard, shard_cols, shard_rows
from opdispatch.tensor import input, param
from opdispatch.testing.metrics import nmse

from helpers import needs_two_gpus

CFG = attrs.evolve(PRESETS["tiny"], dtype="f32", cache_dtype="f32", layers=3)  # 4 heads, 2 KV heads, ffn 128
PROMPT = [3, 141, 59, 26, 5, 35, 89, 79]
PAIR = ["cpu0", "cpu1"]
#: the ranks sum their partial products in another order than one device's dot products: f32 rounding
BOUND = 1e-10


def gpu(name: str) -> Device:
    return attrs.evolve(H200, name=name, props={**H200.props, "index": int(name.removeprefix("cuda"))})


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return random_weights(CFG, seed=7)


def values(t) -> np.ndarray:  # noqa: ANN001 - a param
    return to_host_float(t.dtype, t.host_view(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1), 0))


# -- shard rules on device descriptions ------------------------------------------------------------------
@pytest.mark.parametrize("stack_qkv", [True, False], ids=["stacked-qkv", "qkv"])
def test_each_rank_holds_its_heads_kv_heads_and_ffn_features(weights, stack_qkv: bool) -> None:
    model = LlamaModel(CFG, weights, stack_qkv=stack_qkv)
    ranks = tensor_split(model, [gpu("cuda0"), gpu("cuda1")])
    hd, h = CFG.head_dim, CFG.hidden
    for r, part in enumerate(ranks):
        assert (part.heads, part.kv_heads, part.shard) == (2, 1, Shard(r, ("cuda0", "cuda1")))
        for i, (mine, whole) in enumerate(zip(part.layers, model.layers)):
            q = weights[f"model.layers.{i}.self_attn.q_proj.weight"][r * 2 * hd:(r + 1) * 2 * hd]
            k = weights[f"model.layers.{i}.self_attn.k_proj.weight"][r * hd:(r + 1) * hd]
            v = weights[f"model.layers.{i}.self_attn.v_proj.weight"][r * hd:(r + 1) * hd]
            if stack_qkv:
                assert mine.wqkv.shape == (2 * hd + 2 * hd, h)
                np.testing.assert_array_equal(values(mine.wqkv), np.concatenate([q, k, v]))
            else:
                for got, want in ((mine.wq, q), (mine.wk, k), (mine.wv, v)):
                    np.testing.assert_array_equal(values(got), want)
            o = weights[f"model.layers.{i}.self_attn.o_proj.weight"]
            np.testing.assert_array_equal(values(mine.wo), o[:, r * 2 * hd:(r + 1) * 2 * hd])
            f = CFG.ffn // 2
            mlp = {n: weights[f"model.layers.{i}.mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")}
            np.testing.assert_array_equal(values(mine.w_gate), mlp["gate_proj"][r * f:(r + 1) * f])
            np.testing.assert_array_equal(values(mine.w_up), mlp["up_proj"][r * f:(r + 1) * f])
            np.testing.assert_array_equal(values(mine.w_down), mlp["down_proj"][:, r * f:(r + 1) * f])
            assert mine.k_cache.shape == mine.v_cache.shape == (CFG.max_ctx, hd)  # its one KV head
            assert mine.attn_norm is whole.attn_norm and mine.ffn_norm is whole.ffn_norm  # replicated: shared
        assert part.embed is model.embed and part.lm_head is model.lm_head and part.norm is model.norm
        assert part.next_tokens is model.next_tokens and part.token_log is model.token_log


@pytest.mark.parametrize("devices, what", [
    (["cuda0", "cuda1", "cuda2"], r"the attention heads \(4\) is not a multiple of 3"),
    (["cuda0", "cuda1", "cuda2", "cuda3"], r"the KV heads \(2\) is not a multiple of 4"),
])
def test_heads_that_do_not_divide_are_refused(weights, devices, what: str) -> None:
    with pytest.raises(PlacementError, match=f"tensor split over {len(devices)} devices .*: {what}"):
        tensor_split(LlamaModel(CFG, weights), [gpu(d) for d in devices])


def test_ffn_features_that_do_not_divide_are_refused() -> None:
    cfg = attrs.evolve(CFG, heads=4, kv_heads=4, ffn=90, layers=1)
    with pytest.raises(PlacementError, match=r"the ffn features \(90\) is not a multiple of 4"):
        tensor_split(LlamaModel(cfg, random_weights(cfg)), ["cpu0", "cpu1", "cpu2", "cpu3"])


def test_block_formats_split_along_k_only_into_whole_blocks() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 1024)).astype(np.float32)
    t = param("w", w, "q4_K")  # 256-value blocks: 4 per row
    whole = values(t)
    for parts in (2, 4):
        for r in range(parts):
            cut = shard_cols(t, Shard(r, [f"cuda{i}" for i in range(parts)]))
            assert cut.shape == (6, 1024 // parts) and cut.dtype.name == "q4_K"
            np.testing.assert_array_equal(values(cut), whole[:, r * 1024 // parts:(r + 1) * 1024 // parts])
    with pytest.raises(PlacementError, match=r"'w' \(6, 1024\) q4_K splits K = 1024 into 128 columns per device, "
                                             r"not a whole number of q4_K's 256-value blocks"):
        shard_cols(t, Shard(0, [f"cuda{i}" for i in range(8)]))
    rows = shard_rows(t, Shard(1, ["cuda0", "cuda1", "cuda2"]))  # rows: whole rows, any format
    np.testing.assert_array_equal(values(rows), whole[2:4])


def test_a_quantized_model_whose_k_splits_into_partial_blocks_is_refused() -> None:
    cfg = attrs.evolve(CFG, hidden=256, heads=2, kv_heads=2, ffn=512, layers=1, dtype="q4_0", cache_dtype="f16")
    ranks = tensor_split(LlamaModel(cfg, random_weights(cfg)), ["cpu0", "cpu1"])  # o_proj: 4 q4_0 blocks a rank
    assert ranks[1].layers[0].wo.shape == (256, 128) and ranks[1].layers[0].w_down.shape == (256, 256)
    cfg = attrs.evolve(cfg, dtype="q4_K")
    with pytest.raises(PlacementError, match=r"o_proj.* splits K = 256 into 128 columns per device, not a whole "
                                             r"number of q4_K's 256-value blocks"):
        tensor_split(LlamaModel(cfg, random_weights(cfg)), ["cpu0", "cpu1"])


def test_shards_and_ops_refuse_bad_groups() -> None:
    with pytest.raises(PlacementError, match="two distinct devices or more"):
        Shard(0, ["cuda0", "cuda0"])
    with pytest.raises(PlacementError, match=r"rank 2 outside 0\.\.1"):
        Shard(2, ["cuda0", "cuda1"])
    x = input("x", (2, 8))
    with pytest.raises(OpError, match=r"all_reduce_sum: rank must be in 0\.\.1, got 2"):
        ops.all_reduce_sum(x, "cpu0,cpu1", 2)
    with pytest.raises(OpError, match=r"all_reduce_sum: group 'cpu0, cpu1' must name distinct devices"):
        ops.all_reduce_sum(x, "cpu0, cpu1", 0)
    with pytest.raises(OpError, match="all_reduce_sum: source dtype f16 not supported"):
        ops.all_reduce_sum(input("h", (2, 8), "f16"), "cpu0,cpu1", 0)


def test_compile_refuses_a_tensor_split_misused(weights) -> None:
    outputs, _ = LlamaModel(CFG, weights).build(1, 0)
    with pytest.raises(PlacementError, match=r"split='tensor' needs one graph per device \(2: cpu0, cpu1\)"):
        compile(outputs, devices=PAIR, split="tensor")
    with pytest.raises(PlacementError, match="split must be 'layer', 'tensor' or proportions, got 'rows'"):
        compile(outputs, devices=PAIR, split="rows")
    with pytest.raises(PlacementError, match=r"split='tensor' needs devices=\[\.\.\.\] of two devices or more"):
        compile(outputs, "cpu", split="tensor")


def test_nccl_takes_the_all_reduces_of_each_rank_on_gpu_descriptions() -> None:
    cfg = attrs.evolve(CFG, hidden=256, heads=4, kv_heads=2, layers=2)  # head_dim 64: attention on the GPU
    ranks = tensor_split(LlamaModel(cfg, random_weights(cfg)), [gpu("cuda0"), gpu("cuda1")])
    outs, inp = ranks[0].build(1, 5)
    plan = compile([outs, ranks[1].build(1, 5, inputs=inp)[0]], devices=[gpu("cuda0"), gpu("cuda1")], split="tensor")
    assert isinstance(plan, GroupPlan) and [p.device.name for p in plan.plans] == ["cuda0", "cuda1"]
    for r, p in enumerate(plan.plans):
        steps = [s for s in p.steps if s.kind == "kernel" and s.out.op == "all_reduce_sum"]
        assert len(steps) == 2 * cfg.layers
        assert all(s.out.params == {"group": "cuda0,cuda1", "rank": r} for s in steps)
        assert all(s.plugin == "nccl" and s.kernel == "nccl" and s.device.name == f"cuda{r}" for s in steps)
        assert not [s for s in p.steps if s.kind == "copy"]  # the whole step on the GPU: one segment
        assert re.search(rf"all_reduce_sum 'all_reduce_sum\.\d+' \(1, 256\) f32 +nccl:nccl on cuda{r}", p.explain())


def test_nccl_declines_another_ranks_node_and_says_why_it_is_missing() -> None:
    x = ops.all_reduce_sum(input("x", (1, 256)), "cuda0,cuda1", 1)
    assert all_reduce_ok(gpu("cuda1"), x) is True
    assert all_reduce_ok(gpu("cuda0"), x) == "rank 1 of group cuda0,cuda1 is cuda1, not cuda0"
    assert all_reduce_ok(gpu("cuda1"), ops.all_reduce_sum(input("y", (1, 256)), "cpu0,cuda1", 1)) == (
        "group cpu0,cuda1 holds devices that are not CUDA GPUs")
    nccl, why = nccl_module()
    real = attrs.evolve(gpu("cuda1"), backend_factory=lambda d: None)  # a device that runs: NCCL must be there
    if nccl is None:
        assert all_reduce_ok(real, x) == why and "CuPy" in why
    else:
        assert all_reduce_ok(real, x) is True


# -- the host rendezvous --------------------------------------------------------------------------------
def test_the_host_rendezvous_gives_every_rank_all_parts_and_wakes_them_when_aborted() -> None:
    group = HostGroup(("cpu0", "cpu1", "cpu2"))
    got: dict[int, list] = {}

    def rank(r: int) -> None:
        got[r] = group.exchange(r, np.full(3, r, np.float32))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    rank(0)
    for t in threads:
        t.join()
    assert all([p.tolist() for p in got[r]] == [[0] * 3, [1] * 3, [2] * 3] for r in range(3))
    errors = []
    waiting = threading.Thread(target=lambda: errors.append(pytest.raises(LaunchError, group.exchange, 1, np.zeros(1))))
    waiting.start()
    while group.barrier.n_waiting < 1:
        pass
    group.abort()
    waiting.join(10)
    assert not waiting.is_alive() and "rank 1 (cpu1) of group cpu0,cpu1,cpu2 was left alone" in str(errors[0].value)


# -- the whole path on two CPU devices -----------------------------------------------------------------------
@pytest.mark.parametrize("stack_qkv", [True, False], ids=["stacked-qkv", "qkv"])
def test_two_cpu_devices_give_the_logits_and_tokens_of_one(weights, stack_qkv: bool) -> None:
    one = Generator(LlamaModel(CFG, weights, stack_qkv=stack_qkv), "cpu")
    two = Generator(LlamaModel(CFG, weights, stack_qkv=stack_qkv), devices=PAIR, split="tensor")
    for tokens in (PROMPT, [17], [42]):  # prefill, then decode steps on the split KV cache
        ref, got = one.forward(tokens), two.forward(tokens)
        assert nmse(got.astype(np.float64), ref.astype(np.float64)) <= BOUND
        assert (got.argmax(-1) == ref.argmax(-1)).all()
    a = Generator(LlamaModel(CFG, weights), "cpu").generate(PROMPT, 12)
    b = Generator(LlamaModel(CFG, weights, stack_qkv=stack_qkv), devices=PAIR, split="tensor").generate(PROMPT, 12)
    assert b.tokens == a.tokens  # greedy on the device: each rank picks the same token into its own state


def test_explain_shows_each_ranks_all_reduces(weights) -> None:
    gen = Generator(LlamaModel(CFG, weights), devices=PAIR, split="tensor")
    out = gen.generate(PROMPT, 3)
    plan = out.decode_plan
    assert isinstance(plan, GroupPlan)
    text = plan.explain()
    assert text.startswith("tensor split over cpu0, cpu1: rank 0 on cpu0 (")
    for r, dev in enumerate(PAIR):
        reduces = re.findall(rf"all_reduce_sum 'all_reduce_sum\.\d+' \(1, 64\) f32 +cpu:numpy on {dev}", text)
        assert len(reduces) == 2 * CFG.layers, dev
        assert f"rank {r}: plan on {dev}:" in text
    assert not any(s.kind == "copy" for p in plan.plans for s in p.steps)  # the ranks meet in the collectives only
    assert plan.placement.devices[1].name == "cpu1" and "rank 1 on cpu1" in plan.placement.describe()


def test_a_quantized_tied_model_over_two_cpu_devices_gives_the_tokens_of_one() -> None:
    cfg = attrs.evolve(CFG, dtype="q8_0", cache_dtype="f16", layers=2)
    w = {k: v for k, v in random_weights(cfg, seed=5).items() if k != "lm_head.weight"}  # tied LM head
    a = Generator(LlamaModel(cfg, w), "cpu").generate(PROMPT, 8)
    gen = Generator(LlamaModel(cfg, w), devices=PAIR, split="tensor")
    b = gen.generate(PROMPT, 8)
    assert b.tokens == a.tokens
    assert gen.ranks[0].lm_head is gen.ranks[1].lm_head is gen.model.embed


def test_a_mixture_of_experts_over_two_cpu_devices() -> None:
    cfg = attrs.evolve(PRESETS["tiny-moe"], dtype="f32", cache_dtype="f32")
    w = random_weights(cfg, seed=2)
    ref = Generator(LlamaModel(cfg, w), "cpu").forward(PROMPT)
    gen = Generator(LlamaModel(cfg, w), devices=PAIR, split="tensor")
    got = gen.forward(PROMPT)
    assert nmse(got.astype(np.float64), ref.astype(np.float64)) <= BOUND
    assert gen.ranks[1].layers[0].w_down.shape == (cfg.experts, cfg.hidden, cfg.ffn // 2)


def test_batched_decode_over_two_cpu_devices(weights) -> None:
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]]
    one = Generator(LlamaModel(CFG, weights, max_seqs=3), "cpu", batch=3).generate_batch(prompts, 5)
    gen = Generator(LlamaModel(CFG, weights, max_seqs=3), devices=PAIR, split="tensor", batch=3)
    two = gen.generate_batch(prompts, 5)
    assert two.tokens == one.tokens


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_rank_does_not_leave_its_peer_waiting(weights, failing: int) -> None:
    gen = Generator(LlamaModel(CFG, weights), devices=PAIR, split="tensor")
    plan, inp = gen.step(1, 0)
    feeds = inp.feeds([5], 0)
    ref = plan.run(feeds)[0]

    def run(p):  # noqa: ANN001, ANN202 - one rank fails before its first all-reduce, the other waits there
        if p is plan.plans[failing]:
            raise ValueError(f"rank {failing} failed")
        return p.run(feeds)

    with pytest.raises(ValueError, match=f"rank {failing} failed"):  # the failure, not its peer's PeerFailed
        plan._each(run)
    np.testing.assert_array_equal(plan.run(feeds)[0], ref)  # the group works again


# -- two GPUs ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("preset", ["tiny", "1b"])
def test_two_gpus_tensor_split_give_the_greedy_tokens_of_one(preset: str) -> None:
    cfg = attrs.evolve(PRESETS[preset], max_ctx=256)
    w = random_weights(cfg, seed=3)
    prompt = list(range(5, 5 + 24))
    ref_gen = Generator(LlamaModel(cfg, w), "cuda0")
    ref_logits = ref_gen.forward(prompt)
    one = Generator(LlamaModel(cfg, w), "cuda0").generate(prompt, 24)
    gen = Generator(LlamaModel(cfg, w), devices=["cuda0", "cuda1"], split="tensor")
    logits = gen.forward(prompt)
    err = nmse(logits.astype(np.float64), ref_logits.astype(np.float64))
    assert err <= 1e-4, f"NMSE {err:.3g} of the tensor split's prefill logits against one GPU's"
    gen.reset()
    two = gen.generate(prompt, 24)
    assert two.tokens == one.tokens
    assert all(s.plugin == "nccl" for p in two.decode_plan.plans for s in p.steps if s.out.op == "all_reduce_sum")


@pytest.mark.gpu
@needs_two_gpus
def test_a_tensor_split_step_is_captured_with_its_nccl_all_reduces(weights) -> None:
    from opdispatch.backends.cuda.backend import Segment

    cfg = attrs.evolve(CFG, hidden=256, heads=4, kv_heads=2)
    w = random_weights(cfg, seed=4)
    ref = Generator(LlamaModel(cfg, w), "cuda0").forward(PROMPT)
    gen = Generator(LlamaModel(cfg, w), devices=["cuda0", "cuda1"], split="tensor")
    got = gen.forward(PROMPT)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    plan = gen.step(len(PROMPT), 0)[0]
    for rank in plan.plans:
        segments = [r for r in rank._shared.bound.runners if isinstance(r, Segment)]
        assert len(segments) == 1  # the whole step, all-reduces included, is one CUDA graph per GPU
        assert segments[0].runner.captures == 1 and not segments[0].runner.disabled
    for _ in range(3):  # replays: the graphs' NCCL kernels meet on the GPUs
        gen.reset()
        np.testing.assert_allclose(gen.forward(PROMPT), got, rtol=0, atol=1e-6 * np.abs(ref).max())


@pytest.mark.gpu
def test_nccl_runs_a_group_of_one_gpu_inside_a_captured_segment() -> None:
    from opdispatch.backends.cuda.backend import Segment

    x = input("x", (4, 2048))
    y = ops.mul(ops.all_reduce_sum(ops.scale(x, 2.0), "cuda0", 0), x)  # kernels on both sides: one segment
    plan = compile([y], "cuda0")
    (step,) = [s for s in plan.steps if s.out.op == "all_reduce_sum"]
    assert (step.plugin, step.kernel, step.device.name) == ("nccl", "nccl", "cuda0"), plan.explain()
    values = np.random.default_rng(0).standard_normal((4, 2048)).astype(np.float32)
    for _ in range(3):  # direct, captured, replayed
        np.testing.assert_allclose(plan.run({x: values})[0], 2 * values * values, rtol=1e-6)
    (segment,) = [r for r in plan._shared.bound.runners if isinstance(r, Segment)]
    assert segment.runner.captures == 1 and not segment.runner.disabled
