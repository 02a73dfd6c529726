"""Layer split: the placement rules on device descriptions, and the whole path over two CPU devices with memory
of their own (cpu0, cpu1) against one device; on two GPUs (marked gpu), against one GPU, and a model larger than
one GPU (refused on one H200, placed on two; on two GPUs, run)."""

from __future__ import annotations

import re

import attrs
import numpy as np
import pytest

from opdispatch.backends.cuda.devices import H200, discover
from opdispatch.cli import main
from opdispatch.compiler import compile
from opdispatch.errors import OutOfMemory, PlacementError
from opdispatch.graph import Graph
from opdispatch.hookspecs import Device
from opdispatch.manager import manager
from opdispatch.models.generate import Generator
from opdispatch.models.llama.config import PRESETS, LlamaConfig
from opdispatch.models.llama.model import LlamaModel
from opdispatch.models.llama.names import random_weights
from opdispatch.models.llama.stored import random_params
from opdispatch.placement import node_layers, place, split_layers
from opdispatch.tensor import Flag

from helpers import needs_two_gpus

CFG = attrs.evolve(PRESETS["tiny"], dtype="f32", cache_dtype="f32", layers=4)
PROMPT = [3, 141, 59, 26, 5, 35, 89, 79]
GIB = 2**30
#: A model larger than one H200 (140.4 GiB), within two: Llama-70B's layers (hidden 8192, 64/8 heads, ffn 28672),
#: 112 of them, vocab 32000, bf16: 179.5 GiB of weights, 1.28x one H200's memory. Random weights in their stored
#: format (random_params: every matrix a view of one 500 MiB pool, no host copy per weight) and q/k/v unstacked
#: (stacking would concatenate them into 19 GiB of new host arrays): the model needs no more host memory than its
#: largest matrix, so a 2x H200 host (256 GB) builds it, and so does this machine for the placement test.
OVER_ONE_GPU = LlamaConfig(vocab=32000, hidden=8192, layers=112, heads=64, kv_heads=8, ffn=28672, max_ctx=256,
                           dtype="bf16")


def gpu(name: str, free_gib: float) -> Device:
    """An H200 description named `name` with `free_gib` GiB free."""
    index = int(name.removeprefix("cuda"))
    return attrs.evolve(H200, name=name, props={**H200.props, "index": index, "free_memory": int(free_gib * GIB)})


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return random_weights(CFG, seed=7)


# -- placement rules -------------------------------------------------------------------
@pytest.mark.parametrize("free, split, ranges", [
    ((80, 80), None, [(0, 1, 2, 3), (4, 5, 6, 7)]),  # balanced by free memory
    ((120, 40), None, [(0, 1, 2, 3, 4, 5), (6, 7)]),  # 3:1 free
    ((80, 80), [3, 1], [(0, 1, 2, 3, 4, 5), (6, 7)]),  # given proportions win over free memory
    ((80, 80), [0, 1], [(), tuple(range(8))]),
])
def test_layers_are_cut_into_contiguous_ranges_by_memory_or_proportions(free, split, ranges) -> None:
    devices = [gpu("cuda0", free[0]), gpu("cuda1", free[1])]
    got = split_layers(list(range(8)), [5 * GIB] * 8, devices, split)
    assert [r.layers for r in got] == ranges
    assert [r.nbytes for r in got] == [5 * GIB * len(r) for r in ranges]
    assert [r.device.name for r in got] == ["cuda0", "cuda1"]


def test_uneven_layers_balance_their_bytes() -> None:
    costs = [9, 1, 1, 1, 1, 1, 1, 1, 1, 9]  # the embedding and the LM head weigh on the first and last layer
    got = split_layers(list(range(10)), costs, [gpu("cuda0", 1), gpu("cuda1", 1)])
    assert [r.layers for r in got] == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)]
    assert [r.nbytes for r in got] == [13, 13]


def test_too_little_memory_names_the_devices_and_bytes() -> None:
    with pytest.raises(OutOfMemory, match=r"layer split over cuda0, cuda1: .*need 42949672960 bytes .*in all.*"
                                          r"cuda0 .*cuda1 .*too little memory on layers 0-3 on cuda0.*"
                                          r"20401094656 bytes free; layers 4-7 on cuda1"):
        split_layers(list(range(8)), [5 * GIB] * 8, [gpu("cuda0", 19), gpu("cuda1", 19)])


@pytest.mark.parametrize("split, match", [([1], "one proportion >= 0 per device"), ([1, -1], "per device"),
                                          ([0, 0], "not all 0"), ([1, float("nan")], "per device")])
def test_bad_proportions_are_refused(split, match: str) -> None:
    with pytest.raises(PlacementError, match=match):
        split_layers([0, 1], [1, 1], [gpu("cuda0", 1), gpu("cuda1", 1)], split)


def test_layer_tags_place_each_layer_whole_and_the_ends_with_the_first_and_last_layers(weights) -> None:
    model = LlamaModel(CFG, weights)
    outputs, inp = model.build(3, 0)
    graph = Graph.build(outputs)
    layers = node_layers(graph)
    for i, layer in enumerate(model.layers):  # every node reading a layer's weights or cache is in that layer
        for n in graph.nodes:
            if any(s is not None and s.base in (layer.wqkv, layer.w_down, layer.k_cache, layer.attn_norm)
                   for s in n.srcs):
                assert layers[n] == i
    # The rms_norm opening a layer goes with it: its only user reads the layer's norm weight.
    norms = [n for n in graph.nodes if n.op == "rms_norm"]
    assert [layers[n] for n in norms] == [0, 0, 1, 1, 2, 2, 3, 3, 3]
    embed = next(n for n in graph.nodes if n.op == "get_rows")
    assert layers[embed] == 0 and layers[outputs[0]] == 3
    p = place(graph, [gpu("cuda0", 1), gpu("cuda1", 1)])
    assert [r.layers for r in p.ranges] == [(0, 1), (2, 3)]
    assert p.homes[model.embed].name == "cuda0" and p.homes[model.lm_head].name == "cuda1"
    assert p.homes[model.layers[3].k_cache].name == "cuda1" and p.homes[inp.pos].name == "cuda0"
    assert p.nodes[outputs[0]].name == "cuda1"


def test_a_plan_over_two_gpu_descriptions_copies_only_the_residual_stream_and_inputs() -> None:
    cfg = attrs.evolve(CFG, hidden=256, heads=4, kv_heads=2)  # head_dim 64: attention runs on the GPU
    model = LlamaModel(cfg, random_weights(cfg))
    outputs, inp = model.build(1, 5)
    plan = compile(outputs, devices=[gpu("cuda0", 1), gpu("cuda1", 1)])
    copies = [s for s in plan.steps if s.kind == "copy"]
    assert all(s.kernel == "cuda0->cuda1" and not s.note for s in copies)
    assert {s.out for s in copies if s.out.is_leaf} == {inp.pos, inp.kv_idx, inp.mask}
    (boundary,) = [s.out for s in copies if not s.out.is_leaf]
    assert boundary.op == "add" and node_layers(plan.graph)[boundary] == 1  # the residual after layer 1
    # One segment a device: every cuda0 launch, the copies, then every cuda1 launch; fusions stay on one device.
    launches = [s.device.name for s in plan.steps if s.kind in ("kernel", "fused")]
    assert launches == sorted(launches) and set(launches) == {"cuda0", "cuda1"}
    assert plan.fusions and all(plan.placement.nodes[n] is s.device for s in plan.fusions for n in s.nodes)
    text = plan.explain()
    assert text.startswith("plan on cuda0, cuda1:")
    assert "layer split: layers 0-1 on cuda0" in text and "layers 2-3 on cuda1" in text


def host_bytes(arrays) -> int:  # noqa: ANN001 - numpy arrays
    """The host memory behind `arrays`: the bytes of the distinct arrays that own their storage."""
    owners = {}
    for a in arrays:
        while isinstance(a.base, np.ndarray):
            a = a.base
        owners[id(a)] = a.nbytes
    return sum(owners.values())


def test_a_model_larger_than_one_h200_is_refused_on_one_and_placed_on_two() -> None:
    model = LlamaModel(OVER_ONE_GPU, random_params(OVER_ONE_GPU), stack_qkv=False)
    weights = sum(t.nbytes for t in model.params.values())
    assert weights > 1.25 * H200.props["total_memory"]
    assert host_bytes(t.data for t in model.params.values()) < GIB  # one pool, no host copy per weight
    outputs, _ = model.build(1, 5, greedy=True)
    graph = Graph.build(outputs)
    need = sum(t.nbytes for t in graph.leafs if t.flags & (Flag.PARAM | Flag.STATE))
    free = H200.props["free_memory"]
    with pytest.raises(OutOfMemory, match=rf"layer split over cuda0: the params and states need {need} bytes "
                                          rf"\(179\.\d\d GiB\) in all, free: cuda0 {free} bytes \(140\.40 GiB\); "
                                          rf"too little memory on layers 0-111 on cuda0 .*: {free} bytes free"):
        place(graph, [gpu("cuda0", free / GIB)])
    two = [gpu("cuda0", free / GIB), gpu("cuda1", free / GIB)]
    p = place(graph, two)
    assert [r.layers for r in p.ranges] == [tuple(range(56)), tuple(range(56, 112))]
    assert sum(r.nbytes for r in p.ranges) == need and all(r.nbytes < 0.7 * free for r in p.ranges)
    plan = compile(outputs, devices=two)
    assert "layer split: layers 0-55 on cuda0" in plan.explain() and "layers 56-111 on cuda1" in plan.explain()


def test_compile_refuses_devices_and_split_misused(weights) -> None:
    outputs, _ = LlamaModel(CFG, weights).build(1, 0)
    with pytest.raises(PlacementError, match="give device .* or devices, not both"):
        compile(outputs, "cpu", devices=["cpu0", "cpu1"])
    with pytest.raises(PlacementError, match="needs devices=.* of two devices or more"):
        compile(outputs, "cpu", split=[1])
    with pytest.raises(PlacementError, match="needs distinct devices, got cpu0, cpu0"):
        compile(outputs, devices=["cpu0", "cpu0"])
    with pytest.raises(PlacementError, match=r"one proportion >= 0 per device \(cpu0, cpu1\)"):
        compile(outputs, devices=["cpu0", "cpu1"], split=[1, 2, 3])


def test_numbered_cpus_are_the_cpu_with_memory_of_its_own() -> None:
    mgr = manager()
    one, two = mgr.device("cpu0"), mgr.device("cpu1")
    assert mgr.device("cpu1") is two and one is not two
    assert (one.kind, one.host_memory, two.name) == ("cpu", False, "cpu1")
    assert "cpu1" not in [d.name for d in mgr.devices()]


# -- the whole path on two CPU devices ------------------------------------------------------
@pytest.mark.parametrize("split", [None, [1, 3]])
def test_two_cpu_devices_give_the_logits_and_tokens_of_one(weights, split) -> None:
    one = Generator(LlamaModel(CFG, weights), "cpu")
    two = Generator(LlamaModel(CFG, weights), devices=["cpu0", "cpu1"], split=split)
    np.testing.assert_array_equal(two.forward(PROMPT), one.forward(PROMPT))  # prefill, exactly
    np.testing.assert_array_equal(two.forward([17]), one.forward([17]))  # a decode step on the cache
    a = Generator(LlamaModel(CFG, weights), "cpu").generate(PROMPT, 10)
    b = Generator(LlamaModel(CFG, weights), devices=["cpu0", "cpu1"], split=split).generate(PROMPT, 10)
    assert b.tokens == a.tokens  # greedy: the token picked on cpu1 is copied back to cpu0's state each step
    plan = b.decode_plan
    assert plan.placement is not None and [r.layers for r in plan.placement.ranges] == (
        [(0, 1), (2, 3)] if split is None else [(0,), (1, 2, 3)])
    text = plan.explain()
    assert re.search(r"copy 'add\.\d+' .* cpu0->cpu1", text)
    assert re.search(r"copy 'sample\.next' .* cpu1->cpu0 \(write-back\)", text)
    assert " on cpu0" in text and " on cpu1" in text


def test_a_tied_lm_head_is_held_by_both_devices(weights) -> None:
    tied = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    ref = Generator(LlamaModel(CFG, tied), "cpu").forward(PROMPT)
    gen = Generator(LlamaModel(CFG, tied), devices=["cpu0", "cpu1"])
    np.testing.assert_array_equal(gen.forward(PROMPT), ref)
    plan = gen.step(len(PROMPT), 0)[0]
    (bind,) = [s for s in plan.steps if s.kind == "copy" and s.note == "bind"]
    assert bind.out is gen.model.embed and bind.kernel == "cpu0->cpu1"


def test_batched_decode_over_two_cpu_devices(weights) -> None:
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]]
    one = Generator(LlamaModel(CFG, weights, max_seqs=3), "cpu", batch=3).generate_batch(prompts, 5)
    two = Generator(LlamaModel(CFG, weights, max_seqs=3), devices=["cpu0", "cpu1"], batch=3).generate_batch(prompts, 5)
    assert two.tokens == one.tokens


@pytest.mark.parametrize(("split", "parts", "bad", "why"), [
    ("layer", "layer 0 on cpu0 .*; layer 1 on cpu1 ", ["--devices", "cpu0"], "--devices needs two distinct devices"),
    ("tensor", "rank 0 on cpu0 .*; rank 1 on cpu1 ", ["--devices", "cpu0,cpu1,cpu2", "--split", "tensor"],
     "the attention heads (4) is not a multiple of 3"),
])
def test_cli_run_over_the_cpu_pair_generates_what_one_cpu_does(split: str, parts: str, bad: list, why: str,
                                                                capsys) -> None:  # noqa: ANN001
    """`opdispatch run --devices cpu0,cpu1 --split S` prints the split and the tokens one CPU generates; a split
    that cannot be made is a clean error (exit status 2)."""
    def tokens(*argv: str) -> tuple[str, str]:
        assert main(["run", "--tokens", "5", "--prompt-len", "6", *argv]) == 0
        out = capsys.readouterr().out
        return re.search(r"^prompt: 6 tokens; generated: ([\d ]+)$", out, re.M).group(1), out

    ref, _ = tokens("--device", "cpu")
    got, out = tokens("--devices", "cpu0,cpu1", "--split", split)
    assert got == ref
    assert re.search(f"^device: cpu0, cpu1, {split} split: {parts}", out, re.M)
    assert main(["run", *bad]) == 2
    assert why in capsys.readouterr().err


def test_info_names_the_cpu_pair_and_peer_access(capsys) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cpu0, cpu1, ...: the CPU with memory of its own each" in out
    if len(discover()[0]) >= 2:
        assert "  cuda0 -> cuda1: " in out and "  cuda1 -> cuda0: " in out
    else:
        assert "peer access" not in out


# -- two GPUs ------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("preset", ["tiny", "1b"])
def test_two_gpus_give_the_greedy_tokens_of_one(preset: str) -> None:
    cfg = attrs.evolve(PRESETS[preset], max_ctx=256)
    w = random_weights(cfg, seed=3)
    prompt = list(range(5, 5 + 24))
    one = Generator(LlamaModel(cfg, w), "cuda0").generate(prompt, 24)
    gen = Generator(LlamaModel(cfg, w), devices=["cuda0", "cuda1"])
    two = gen.generate(prompt, 24)
    assert two.tokens == one.tokens
    assert {d.name for d in two.decode_plan.placement.devices} == {"cuda0", "cuda1"}


@pytest.mark.gpu
@needs_two_gpus
def test_each_gpu_segment_is_captured_as_its_own_cuda_graph(weights) -> None:
    from opdispatch.backends.cuda.backend import Segment

    ref = Generator(LlamaModel(CFG, weights), "cuda0").forward(PROMPT)
    gen = Generator(LlamaModel(CFG, weights), devices=["cuda0", "cuda1"])
    got = gen.forward(PROMPT)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    plan = gen.step(len(PROMPT), 0)[0]
    segments = [r for r in plan._shared.bound.runners if isinstance(r, Segment)]
    assert sorted(s.backend.device.name for s in segments) == ["cuda0", "cuda1"]
    assert all(s.runner.captures == 1 and not s.runner.disabled for s in segments)


@pytest.mark.gpu
@needs_two_gpus
def test_the_over_one_gpu_shape_split_over_two_gpus_gives_the_logits_and_tokens_of_one() -> None:
    """OVER_ONE_GPU's layers, 4 of them (7 GiB): the kernels of the larger model, one GPU against two."""
    cfg = attrs.evolve(OVER_ONE_GPU, layers=4)
    w = random_params(cfg, seed=5)
    ref = Generator(LlamaModel(cfg, w, stack_qkv=False), "cuda0")
    ref_logits, ref_tokens = ref.forward(PROMPT), ref.generate(PROMPT, 8).tokens
    gen = Generator(LlamaModel(cfg, w, stack_qkv=False), devices=["cuda0", "cuda1"])
    logits = gen.forward(PROMPT)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-4 * np.abs(ref_logits).max())
    two = gen.generate(PROMPT, 8)
    assert two.tokens == ref_tokens
    assert [r.layers for r in two.decode_plan.placement.ranges] == [(0, 1), (2, 3)]


@pytest.mark.gpu
@needs_two_gpus
def test_a_model_larger_than_one_gpu_runs_split_over_two() -> None:
    """OVER_ONE_GPU whole: refused on one GPU before anything is allocated; by layers over two, its prefill
    logits finite, its greedy tokens valid, the same twice, and the same with the layers cut elsewhere (split
    3:2, what each GPU runs moves, its values do not). Its kernels against one GPU: the test above."""
    w = random_params(OVER_ONE_GPU, seed=5)
    model = LlamaModel(OVER_ONE_GPU, w, stack_qkv=False)
    with pytest.raises(OutOfMemory, match=r"cuda0: the plan needs \d+ bytes \(\d+\.\d\d GiB\) of cuda0 memory and "
                                          r"\d+ bytes \(\d+\.\d\d GiB\) are free"):
        Generator(model, "cuda0").forward(PROMPT)
    gen = Generator(model, devices=["cuda0", "cuda1"])
    logits = gen.forward(PROMPT)
    assert np.isfinite(logits).all() and logits.std() > 0
    out = gen.generate(PROMPT, 8)
    assert all(0 <= t < OVER_ONE_GPU.vocab for t in out.tokens) and len(out.tokens) == 8
    cut = out.decode_plan.placement.ranges[1].layers[0]  # balanced by free memory: about half
    assert 40 < cut < 72, out.decode_plan.placement.describe()
    assert gen.generate(PROMPT, 8).tokens == out.tokens
    moved = Generator(model, devices=["cuda0", "cuda1"], split=[3, 2])
    np.testing.assert_allclose(moved.forward(PROMPT), logits, rtol=0, atol=1e-4 * np.abs(logits).max())
    again = moved.generate(PROMPT, 8)
    assert again.tokens == out.tokens
    assert again.decode_plan.placement.ranges[1].layers[0] == 67 != cut
