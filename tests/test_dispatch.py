"""Dispatch: plugin order, prefer/exclude, fall-through, isolation, explain(), fusion."""

from __future__ import annotations

import sys
import textwrap
import warnings

import attrs
import numpy as np
import pytest

import opdispatch as od
from opdispatch import compiler, ops, sched
from opdispatch.backends.base import StagedTransfers
from opdispatch.backends.cpu import HostBackend
from opdispatch.fusion import can_fuse, gather, hoistable, index_by_first_op, pattern_matches
from opdispatch.graph import Graph
from opdispatch.hookspecs import (HOOK_NAMES, PRIORITY_BUILTIN, AbsentDevice, FusionRule, Hooks, Kernel, PluginInfo,
                                  hookimpl)
from opdispatch.reference import load, store
from opdispatch.errors import DispatchError, PluginError
from opdispatch.manager import PluginManager, PluginWarning
from toy import TOY, ToyPlugin, manager_with, toy_device


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.uniform(-1, 1, shape).astype(np.float32)


def add_mul_graph(shape=(4, 6)):  # noqa: ANN001, ANN201
    a, b, c = (od.input(n, shape) for n in "abc")
    return (a, b, c), ops.mul(ops.add(a, b), c)


def kernel_steps(plan: od.Plan) -> list:
    return [s for s in plan.steps if s.kind in ("kernel", "fused")]


def test_first_accepting_plugin_in_priority_order_runs_the_node() -> None:
    mgr = manager_with(ToyPlugin("low", 150), ToyPlugin("high", 250))
    assert [p.name for p in mgr.order()] == ["high", "low", "cpu"]
    (a, b, c), y = add_mul_graph()
    plan = od.compile(y, TOY, plugins=mgr, fusion=False)
    assert [s.plugin for s in kernel_steps(plan)] == ["high", "high"]
    assert "high:toy_add" in plan.explain()


def test_prefer_and_exclude_and_env_reorder(monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = manager_with(ToyPlugin("low", 150), ToyPlugin("high", 250))
    assert [p.name for p in mgr.order(prefer=["low"])] == ["low", "high", "cpu"]
    assert [p.name for p in mgr.order(exclude=["high"])] == ["low", "cpu"]
    monkeypatch.setenv("OPDISPATCH_PLUGINS", "cpu,-high")
    assert [p.name for p in mgr.order()] == ["cpu", "low"]
    with pytest.raises(PluginError, match="unknown plugin 'nope'"):
        mgr.order(prefer=["nope"])


def test_prefer_changes_who_runs_and_results_agree() -> None:
    rng = np.random.default_rng()
    mgr = manager_with(ToyPlugin("low", 150), ToyPlugin("high", 250, offset=0.5))
    (a, b, c), y = add_mul_graph()
    feeds = {a: rand(rng, 4, 6), b: rand(rng, 4, 6), c: rand(rng, 4, 6)}
    want = (feeds[a] + feeds[b]) * feeds[c]
    got_low = od.compile(y, TOY, plugins=mgr, prefer=["low"], fusion=False).run(feeds)[0]
    got_high = od.compile(y, TOY, plugins=mgr, fusion=False).run(feeds)[0]
    np.testing.assert_allclose(got_low, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_high, (feeds[a] + feeds[b] + 0.5) * feeds[c], rtol=1e-6, atol=1e-6)


def test_decline_with_reason_falls_through_to_cpu_with_copies() -> None:
    rng = np.random.default_rng()
    mgr = manager_with(ToyPlugin())
    a, b = od.input("a", (3, 5)), od.input("b", (5,))  # broadcast: the toy declines
    y = ops.add(a, b)
    plan = od.compile(y, TOY, plugins=mgr)
    (step,) = kernel_steps(plan)
    assert step.device.name == "cpu" and step.plugin == "cpu"
    assert ("toy", "no broadcasting") in step.declined
    text = plan.explain()
    assert "toy (no broadcasting)" in text and "no plugin accepts it on toy0" in text
    assert sum(s.kind == "copy" for s in plan.steps) == 2  # a and b go to the cpu
    fa, fb = rand(rng, 3, 5), rand(rng, 5)
    np.testing.assert_allclose(plan.run({a: fa, b: fb})[0], fa + fb, rtol=1e-6)


def test_no_plugin_anywhere_names_everyone_asked() -> None:
    mgr = PluginManager(strict=False)
    mgr.register(ToyPlugin(), "toy")
    from opdispatch.reference import plugin as cpu_plugin

    class NoCpuKernels:
        @hookimpl
        def devices(self):  # noqa: ANN202
            return cpu_plugin.devices()

    mgr.register(NoCpuKernels(), "cpu_devices_only")
    a = od.input("a", (3, 5))
    with pytest.raises(DispatchError, match=r"no plugin runs neg .*'a'|no plugin runs neg"):
        od.compile(ops.neg(a), TOY, plugins=mgr)


def test_plugin_raising_in_a_hook_is_named_and_isolated() -> None:
    class Broken:
        @hookimpl
        def plugin_info(self) -> PluginInfo:
            return PluginInfo("broken", priority=300)

        @hookimpl
        def kernels(self, device):  # noqa: ANN001, ANN202
            raise RuntimeError("kaboom")

    mgr = manager_with(Broken(), ToyPlugin())
    (a, b, c), y = add_mul_graph()
    with pytest.warns(PluginWarning, match="plugin 'broken' raised in kernels: RuntimeError: kaboom"):
        plan = od.compile(y, TOY, plugins=mgr, fusion=False)
    assert [s.plugin for s in kernel_steps(plan)] == ["toy", "toy"]
    strict = manager_with(Broken(), ToyPlugin(), strict=True)
    with pytest.raises(PluginError, match="'broken' raised in kernels"):
        od.compile(y, TOY, plugins=strict, fusion=False)


def test_plugin_raising_in_a_support_predicate_is_skipped_with_its_name() -> None:
    def bad_supports(device, node):  # noqa: ANN001, ANN202
        raise ValueError("bad predicate")

    class Flaky:
        @hookimpl
        def plugin_info(self) -> PluginInfo:
            return PluginInfo("flaky", priority=300)

        @hookimpl
        def kernels(self, device):  # noqa: ANN001, ANN202
            yield Kernel("add", bind=None, supports=bad_supports)  # type: ignore[arg-type]

    mgr = manager_with(Flaky(), ToyPlugin())
    (a, b, c), y = add_mul_graph()
    with pytest.warns(PluginWarning, match="'flaky' raised in supports of add"):
        plan = od.compile(y, TOY, plugins=mgr, fusion=False)
    first = kernel_steps(plan)[0]
    assert first.plugin == "toy" and first.declined[0][0] == "flaky"


def test_hooks_not_matching_the_specs_are_left_out() -> None:
    class Misspelled:
        @hookimpl
        def kernel(self, device):  # noqa: ANN001, ANN202 - not a hook
            return []

    class WrongArgs:
        @hookimpl
        def kernels(self, device, extra):  # noqa: ANN001, ANN202
            return []

    mgr = PluginManager(strict=False)
    with pytest.warns(PluginWarning, match="'Misspelled' left out: unknown hook"):
        assert mgr.register(Misspelled(), "Misspelled") is None
    with pytest.warns(PluginWarning, match="'WrongArgs' left out: hooks do not match"):
        assert mgr.register(WrongArgs(), "WrongArgs") is None
    assert [n for n, _ in mgr.skipped] == ["Misspelled", "WrongArgs"]
    with pytest.raises(PluginError, match="'Misspelled'"):
        PluginManager(strict=True).register(Misspelled(), "Misspelled")


def test_entry_point_that_fails_to_import_is_named(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    dist = tmp_path / "fakeplug-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplug\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""
        [opdispatch_test]
        good = fake_good_plugin
        bad = fake_bad_plugin
    """))
    (tmp_path / "fake_good_plugin.py").write_text(textwrap.dedent("""
        from opdispatch.hookspecs import PluginInfo, hookimpl
        @hookimpl
        def plugin_info():
            return PluginInfo("good", "2.0")
    """))
    (tmp_path / "fake_bad_plugin.py").write_text("raise ImportError('missing libfoo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mgr = PluginManager(strict=False)
    with pytest.warns(PluginWarning, match="'bad' left out: failed to import fake_bad_plugin: ImportError: missing libfoo"):
        mgr.load_entry_points("opdispatch_test")
    assert "good" in mgr.plugins and mgr.plugins["good"].info.version == "2.0"
    for mod in ("fake_good_plugin", "fake_bad_plugin"):
        sys.modules.pop(mod, None)
    with pytest.raises(PluginError, match="'bad'"):
        PluginManager(strict=True).load_entry_points("opdispatch_test")


def test_builtin_plugins_load_through_entry_points_in_strict_mode() -> None:
    mgr = PluginManager(strict=True)
    mgr.load_entry_points()
    names = [p.name for p in mgr.order()]
    for name in ("cuda_matmul", "cuda_attention", "cuda_norm", "cuda_misc", "cuda", "cpu"):
        assert name in names
    assert names[-1] == "cpu"
    assert all(p.origin.startswith("entry point") for p in mgr.order())
    for name in ("cuda_matmul", "cuda_attention", "cuda_norm", "cuda_misc"):
        plugin = mgr.plugins[name]
        assert plugin.priority == PRIORITY_BUILTIN and plugin.origin == f"entry point opdispatch.plugins.{name}"


def test_fusion_applies_and_matches_unfused_results() -> None:
    rng = np.random.default_rng()
    toy = ToyPlugin()
    mgr = manager_with(toy)
    (a, b, c), y = add_mul_graph()
    feeds = {a: rand(rng, 4, 6), b: rand(rng, 4, 6), c: rand(rng, 4, 6)}
    fused = od.compile(y, TOY, plugins=mgr, fusion=True)
    unfused = od.compile(y, TOY, plugins=mgr, fusion=False)
    assert [s.kind for s in kernel_steps(fused)] == ["fused"]
    assert [s.kind for s in kernel_steps(unfused)] == ["kernel", "kernel"]
    assert "toy [fused add_mul]" in fused.explain()
    out_f, out_u = fused.run(feeds)[0], unfused.run(feeds)[0]
    assert toy.fused_runs == 1
    np.testing.assert_allclose(out_f, out_u, rtol=1e-6)
    np.testing.assert_allclose(out_f, (feeds[a] + feeds[b]) * feeds[c], rtol=1e-6)


def test_fusion_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = manager_with(ToyPlugin())
    (a, b, c), y = add_mul_graph((2, 3))
    monkeypatch.setenv("OPDISPATCH_DISABLE_FUSION", "1")
    assert not od.compile(y, TOY, plugins=mgr).fusions


def test_no_fusion_when_the_intermediate_is_used_elsewhere_or_an_output() -> None:
    mgr = manager_with(ToyPlugin())
    a, b, c = (od.input(n, (2, 3)) for n in "abc")
    s = ops.add(a, b)
    y = ops.mul(s, c)
    assert not od.compile([y, s], TOY, plugins=mgr).fusions  # s is an output
    z = ops.mul(s, c)
    w = ops.add(z, s)  # s read outside the group
    assert not od.compile(w, TOY, plugins=mgr).fusions


def test_fusion_check_declines_and_nodes_run_unfused() -> None:
    mgr = manager_with(ToyPlugin())
    a, b, c = (od.input(n, (2, 3)) for n in "abc")
    y = ops.mul(c, ops.add(a, b))  # the add is mul's second source
    plan = od.compile(y, TOY, plugins=mgr)
    assert not plan.fusions and len(kernel_steps(plan)) == 2


def test_plan_cache_reuses_plans_for_equal_graphs() -> None:
    rng = np.random.default_rng()
    mgr = manager_with(ToyPlugin())
    (a1, b1, c1), y1 = add_mul_graph()
    (a2, b2, c2), y2 = add_mul_graph()
    p1 = od.compile(y1, TOY, plugins=mgr)
    p2 = od.compile(y2, TOY, plugins=mgr)
    assert p2.steps is p1.steps  # same plan, answering to the new graph's tensors
    feeds = {a2: rand(rng, 4, 6), b2: rand(rng, 4, 6), c2: rand(rng, 4, 6)}
    np.testing.assert_allclose(p2.run(feeds)[0], (feeds[a2] + feeds[b2]) * feeds[c2], rtol=1e-6)
    (a3, b3, c3), y3 = add_mul_graph((4, 7))
    assert od.compile(y3, TOY, plugins=mgr).steps is not p1.steps


@pytest.mark.parametrize("switch", ["OPDISPATCH_DISABLE_CUDA_GRAPHS", "OPDISPATCH_PDL"])
def test_plan_cache_keys_on_the_switches_read_at_bind(monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    mgr = manager_with(ToyPlugin())
    p1 = od.compile(add_mul_graph()[1], TOY, plugins=mgr)
    monkeypatch.setenv(switch, "0" if switch == "OPDISPATCH_PDL" else "1")
    assert od.compile(add_mul_graph()[1], TOY, plugins=mgr).steps is not p1.steps


def test_run_checks_feeds() -> None:
    a = od.input("a", (2, 3))
    plan = od.compile(ops.neg(a), "cpu")
    with pytest.raises(KeyError, match="no value for input 'a'"):
        plan.run({})
    with pytest.raises(ValueError, match=r"input 'a' \(2, 3\) f32: got shape \(3, 2\)"):
        plan.run({a: np.ones((3, 2))})
    np.testing.assert_array_equal(plan.run({"a": np.full((2, 3), 2.0)})[0], np.full((2, 3), -2.0))


def test_a_failing_kernel_is_named_and_the_plan_stays_usable() -> None:
    calls = {"n": 0}

    def bind(ctx, node):  # noqa: ANN001, ANN202
        out = ctx.array(node)

        def launch() -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise FloatingPointError("overflow")
            out[...] = 1.0

        return launch

    class Once:
        @hookimpl
        def plugin_info(self) -> PluginInfo:
            return PluginInfo("once")

        @hookimpl
        def kernels(self, device):  # noqa: ANN001, ANN202
            if device.kind == "toy":
                yield Kernel("neg", bind, name="neg_once")

    mgr = manager_with(Once(), ToyPlugin())
    a = od.input("a", (2, 2))
    plan = od.compile(ops.neg(a), TOY, plugins=mgr)
    with pytest.raises(Exception, match=r"neg 'neg\.\d+' \(2, 2\) f32 by once:neg_once failed: FloatingPointError"):
        plan.run({a: np.ones((2, 2))})
    np.testing.assert_array_equal(plan.run({a: np.ones((2, 2))})[0], np.ones((2, 2)))


def test_warnings_do_not_leak_from_a_clean_manager() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager_with(ToyPlugin())


class SumToo(ToyPlugin):
    """Fuses add -> mul and also writes the sum, which others may read (FusionRule.outputs)."""

    @hookimpl
    def fusion_rules(self, device):  # noqa: ANN001, ANN202
        if device.kind == "toy":
            yield FusionRule("add_mul_keep_sum", ("add", "mul"), bind=self._bind_both, outputs=(0,))

    def _bind_both(self, ctx, nodes):  # noqa: ANN001, ANN202
        add, mul = nodes
        out_sum, out = ctx.array(add), ctx.array(mul)
        a, b, c = (ctx.array(t) for t in (add.srcs[0], add.srcs[1], mul.srcs[1]))

        def launch() -> None:
            s = load(a, "f32") + load(b, "f32")
            store(out_sum, s, add)
            store(out, s * load(c, "f32"), mul)

        return launch


def test_a_fused_group_may_write_declared_extra_outputs() -> None:
    rng = np.random.default_rng()
    mgr = manager_with(SumToo())
    a, b, c = (od.input(n, (3, 4)) for n in "abc")
    s = ops.add(a, b)
    y = ops.mul(s, c)
    z = ops.neg(s)  # reads the sum outside the group: on the cpu, copied from the toy device
    plan = od.compile([y, z], TOY, plugins=mgr)
    (fused,) = plan.fusions
    assert fused.writes == (s,) and "(also writes 'add." in plan.explain()
    feeds = {a: rand(rng, 3, 4), b: rand(rng, 3, 4), c: rand(rng, 3, 4)}
    oy, oz = plan.run(feeds)
    np.testing.assert_allclose(oy, (feeds[a] + feeds[b]) * feeds[c], rtol=1e-6)
    np.testing.assert_allclose(oz, -(feeds[a] + feeds[b]), rtol=1e-6)
    # Without the declaration the same group is refused, and explain() says why.
    plain = od.compile([y, z], TOY, plugins=manager_with(ToyPlugin()))
    assert not plain.fusions
    assert "not fused: add_mul (an intermediate result is read outside the group)" in plain.explain()


def test_fusion_rule_outputs_are_checked() -> None:
    with pytest.raises(ValueError, match="outputs \\(1,\\) must be positions before the last"):
        FusionRule("bad", ("add", "mul"), bind=lambda ctx, nodes: None, outputs=(1,))


def test_plan_cache_keeps_the_most_recently_used_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler, "PLAN_CACHE_SIZE", 2)
    mgr = manager_with()
    plans = [od.compile(ops.neg(od.input("x", (n,))), "cpu", plugins=mgr) for n in (1, 2)]
    assert od.compile(ops.neg(od.input("x", (1,))), "cpu", plugins=mgr).steps is plans[0].steps  # now most recent
    od.compile(ops.neg(od.input("x", (3,))), "cpu", plugins=mgr)  # evicts the plan for (2,)
    assert len(compiler.plan_cache(mgr).plans) == 2
    assert od.compile(ops.neg(od.input("x", (1,))), "cpu", plugins=mgr).steps is plans[0].steps
    assert od.compile(ops.neg(od.input("x", (2,))), "cpu", plugins=mgr).steps is not plans[1].steps


# -- Plan.run's staged transfers (bind.Feeder) -----------------------------------------------


class Counting(HostBackend):
    """A host backend that counts Plan.run's staged copies and synchronizes."""

    log: list = []

    def upload(self, buf, offset, host, host_offset, nbytes):  # noqa: ANN001, ANN201
        Counting.log.append(("upload", nbytes))
        super().upload(buf, offset, host, host_offset, nbytes)

    def download(self, host, host_offset, buf, offset, nbytes):  # noqa: ANN001, ANN201
        Counting.log.append(("download", nbytes))
        super().download(host, host_offset, buf, offset, nbytes)

    def write(self, buf, offset, data):  # noqa: ANN001, ANN201
        Counting.log.append(("write", data.size))
        super().write(buf, offset, data)

    def synchronize(self) -> None:
        Counting.log.append(("sync", 0))


class NoStaging(HostBackend):
    staging = None  # not a staging backend: Plan.run writes and reads one tensor at a time


def test_run_uploads_every_input_in_one_copy_and_waits_once() -> None:
    rng = np.random.default_rng()
    dev = toy_device("stage0", host_memory=True)
    dev = attrs.evolve(dev, backend_factory=Counting)
    mgr = manager_with(ToyPlugin(device=dev))
    (a, b, c), y = add_mul_graph()
    plan = od.compile(y, dev, plugins=mgr, fusion=False)
    feeds = {a: rand(rng, 4, 6), b: rand(rng, 4, 6), c: rand(rng, 4, 6)}
    plan.run(feeds)  # binds
    Counting.log.clear()
    got = plan.run(feeds)[0]
    np.testing.assert_allclose(got, (feeds[a] + feeds[b]) * feeds[c], rtol=1e-6)
    # one upload of the three inputs (each padded to the feeder's alignment), one download, one wait
    assert Counting.log == [("upload", 3 * 256), ("download", 4 * 6 * 4), ("sync", 0)]
    # write/read still work on the inputs' shared block, and the next run overwrites what write put there
    plan.write(c, np.zeros((4, 6), np.float32))
    plan.launch()
    np.testing.assert_array_equal(plan.read(y), np.zeros((4, 6)))
    np.testing.assert_array_equal(plan.read(a), feeds[a])
    np.testing.assert_allclose(plan.run(feeds)[0], got, rtol=0)


def test_run_without_copy_returns_views_that_the_next_run_overwrites() -> None:
    a = od.input("a", (3,))
    plan = od.compile(ops.neg(a), "cpu")
    first = plan.run({a: np.ones(3)}, copy=False)[0]
    kept = plan.run({a: np.ones(3)})[0]
    np.testing.assert_array_equal(first, -np.ones(3))
    plan.run({a: np.full(3, 2.0)}, copy=False)
    np.testing.assert_array_equal(first, np.full(3, -2.0))  # the same staging bytes
    np.testing.assert_array_equal(kept, -np.ones(3))  # a copy is the caller's


def test_inputs_shared_between_plans_and_states_fed_through_run() -> None:
    mgr = manager_with()  # a plan cache of its own: no equal graph's plan (with its own leafs) answers
    a, x = od.input("a", (2, 3)), od.input("x", (2, 3))
    s = od.state("s", (2, 3))
    first = od.compile(ops.neg(a), "cpu", plugins=mgr)
    first.run({a: np.ones((2, 3))})  # a gets its buffer in first's block
    second = od.compile(ops.add(ops.add(a, x), s), "cpu", plugins=mgr)
    out = second.run({a: np.full((2, 3), 2.0), x: np.full((2, 3), 3.0), s: np.full((2, 3), 4.0)})[0]
    np.testing.assert_array_equal(out, np.full((2, 3), 9.0))
    np.testing.assert_array_equal(first.read(a), np.full((2, 3), 2.0))  # one buffer for a, both plans
    np.testing.assert_array_equal(second.read(s), np.full((2, 3), 4.0))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda0", marks=pytest.mark.gpu)])
def test_submitted_runs_chain_through_a_state_and_read_waits_for_them(device: str) -> None:
    rng = np.random.default_rng()
    x, s = od.input("x", (3, 5)), od.state("s", (3, 5))
    plan = od.compile(ops.cpy(ops.add(s, x), s), device)  # s += x, in place
    start = rand(rng, 3, 5)
    plan.write(s, start)
    xs = [rand(rng, 3, 5) for _ in range(6)]
    want = start.astype(np.float32)
    for v in xs:
        plan.submit({x: v})  # no wait: each run reads the s the previous one wrote
        want = want + v  # the same f32 additions in the same order (a sum near 0 loses digits)
    np.testing.assert_allclose(plan.read(s), want, rtol=1e-6, atol=1e-6)
    # a run after submits takes its own inputs, and returns its output
    np.testing.assert_allclose(plan.run({x: xs[0]})[0], want + xs[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(KeyError, match="no value for input"):
        plan.submit({})


def test_a_backend_without_staging_writes_and_reads_each_tensor() -> None:
    rng = np.random.default_rng()
    dev = attrs.evolve(toy_device("plain0", host_memory=True), backend_factory=NoStaging)
    mgr = manager_with(ToyPlugin(device=dev))
    (a, b, c), y = add_mul_graph()
    plan = od.compile(y, dev, plugins=mgr, fusion=False)
    feeds = {a: rand(rng, 4, 6), b: rand(rng, 4, 6), c: rand(rng, 4, 6)}
    np.testing.assert_allclose(plan.run(feeds)[0], (feeds[a] + feeds[b]) * feeds[c], rtol=1e-6)
    assert "plain0" not in plan._bind().feeders


def test_can_fuse_lets_views_be_read_outside_when_the_group_writes_their_bytes() -> None:
    a, b, c = od.input("a", (3, 4)), od.input("b", (3, 4)), od.input("c", (12,))
    s = ops.add(a, b)
    flat = s.reshape(12)  # a view of the sum, read inside the group (mul) and outside (neg)
    graph = Graph.build([ops.mul(flat, c), ops.neg(flat)])
    assert [n.op for n in graph.nodes] == ["add", "reshape", "mul", "neg"]
    assert not can_fuse(graph, graph.nodes[:3], ("add", "reshape", "mul"))  # the sum exists only inside the kernel
    assert can_fuse(graph, graph.nodes[:3], ("add", "reshape", "mul"), outputs=(0,))  # written: the view is free
    # a view of a tensor made before the group: its bytes are there whatever the group does
    d = od.input("d", (3, 4))
    e = d.reshape(12)
    graph = Graph.build([ops.mul(ops.add(c, c), e), ops.neg(e)])
    assert [n.op for n in graph.nodes] == ["add", "reshape", "mul", "neg"]
    assert can_fuse(graph, graph.nodes[:3], ("add", "reshape", "mul"))


def hoisting(*rules: FusionRule) -> PluginManager:
    """The toy plugin (add, mul, and its contiguous add_mul) and `rules` tried before its own."""
    return manager_with(Rules("hoisting", *rules, priority=300), ToyPlugin())


def test_a_rule_hoists_independent_nodes_of_its_hoist_ops_ahead_of_the_group() -> None:
    rng = np.random.default_rng()
    toy = ToyPlugin()
    a, b, c, d = (od.input(n, (3, 4)) for n in "abcd")
    s, t = ops.add(a, b), ops.add(c, d)
    y = ops.mul(s, t)
    graph = Graph.build(y)
    assert graph.nodes == [s, t, y]  # t, read by the group's mul, lands between its add and the mul
    assert gather(graph.nodes, 0, ("add", "mul")) is None  # no hoist: consecutive nodes only (ggml's rule)
    assert gather(graph.nodes, 0, ("add", "mul"), {"add"}) == ([s, y], [t])
    assert gather(graph.nodes, 0, ("add", "mul"), {"add"}, end=2) is None  # not past `end`
    rule = FusionRule("add_mul_hoisting", ("add", "mul"), bind=toy._bind_add_mul, check=toy._check_add_mul,
                      hoist="add")
    assert rule.hoist == frozenset({"add"})
    plan = od.compile(y, TOY, plugins=hoisting(rule))
    assert [(s_.kind, s_.kernel, s_.nodes) for s_ in plan.steps] == [
        ("kernel", "toy_add", (t,)), ("fused", "add_mul_hoisting", (s, y))]  # t runs first
    feeds = {x: rand(rng, 3, 4) for x in (a, b, c, d)}
    np.testing.assert_allclose(plan.run(feeds)[0], (feeds[a] + feeds[b]) * (feeds[c] + feeds[d]), rtol=1e-6)
    # the same rule without hoist: the old, contiguous behaviour, nothing fused
    plain = FusionRule("add_mul_plain", ("add", "mul"), bind=toy._bind_add_mul, check=toy._check_add_mul)
    assert not od.compile(y, TOY, plugins=hoisting(plain)).fusions


def test_a_node_that_reads_the_group_is_not_hoisted_and_the_group_does_not_fuse() -> None:
    rng = np.random.default_rng()
    sum_too = SumToo()
    a, b, c = (od.input(n, (3, 4)) for n in "abc")
    s = ops.add(a, b)
    t = ops.add(s, c)  # reads the group's sum, which the fused kernel writes (outputs=(0,)): hoisted, it
    y = ops.mul(s, t)  # would read s before the kernel writes it
    graph = Graph.build(y)
    assert graph.nodes == [s, t, y]
    assert not hoistable(t, [s]) and gather(graph.nodes, 0, ("add", "mul"), {"add"}) is None
    rule = FusionRule("add_mul_keep_sum_hoisting", ("add", "mul"), bind=sum_too._bind_both,
                      check=sum_too._check_add_mul, outputs=(0,), hoist="add")
    plan = od.compile(y, TOY, plugins=hoisting(rule))
    assert not plan.fusions and [n.op for s_ in plan.steps for n in s_.nodes] == ["add", "add", "mul"]
    feeds = {x: rand(rng, 3, 4) for x in (a, b, c)}
    ab = feeds[a] + feeds[b]
    np.testing.assert_allclose(plan.run(feeds)[0], ab * (ab + feeds[c]), rtol=1e-6)


def test_hoisted_nodes_fuse_among_themselves_before_the_group_that_hoisted_them() -> None:
    rng = np.random.default_rng()

    def bind_neg_mul(ctx, nodes):  # noqa: ANN001, ANN202
        neg, mul = nodes
        out, a, s = ctx.array(mul), ctx.array(neg.srcs[0]), ctx.array(mul.srcs[1])
        return lambda: store(out, -load(a, "f32") * load(s, "f32"), mul)

    def bind_add_sub(ctx, nodes):  # noqa: ANN001, ANN202
        add, sub = nodes
        out, b, c, e = ctx.array(sub), ctx.array(add.srcs[0]), ctx.array(add.srcs[1]), ctx.array(sub.srcs[1])
        return lambda: store(out, load(b, "f32") + load(c, "f32") - load(e, "f32"), sub)

    a, b, c, d, e = (od.input(n, (2, 3)) for n in "abcde")
    n, s1, s2 = ops.neg(a), ops.add(b, c), ops.add(d, e)
    diff = ops.sub(s1, s2)
    y = ops.mul(n, diff)
    assert Graph.build(y).nodes == [n, s1, s2, diff, y]
    outer = FusionRule("neg_mul", ("neg", "mul"), bind=bind_neg_mul, hoist={"add", "sub"})
    inner = FusionRule("add_sub", ("add", "sub"), bind=bind_add_sub, hoist="add")  # inside what outer hoists
    plan = od.compile(y, TOY, plugins=hoisting(outer, inner))
    assert [(s_.kind, s_.nodes) for s_ in plan.steps] == [("kernel", (s2,)), ("fused", (s1, diff)),
                                                          ("fused", (n, y))]
    feeds = {x: rand(rng, 2, 3) for x in (a, b, c, d, e)}
    want = -feeds[a] * (feeds[b] + feeds[c] - feeds[d] - feeds[e])
    np.testing.assert_allclose(plan.run(feeds)[0], want, rtol=1e-5, atol=1e-6)


def test_hoisting_keeps_reads_and_in_place_writes_of_a_buffer_in_order() -> None:
    cache = od.state("cache", (4, 3), "f32")
    x, ids = od.input("x", (2, 3)), od.input("ids", (2,), "i64")
    written = ops.set_rows(cache, x, ids)
    assert not hoistable(ops.neg(cache), [written])  # reads the buffer the group writes in place
    assert not hoistable(cache.reshape(12), [written])  # a view of it too
    assert not hoistable(ops.set_rows(cache, x, ids), [ops.neg(cache)])  # writes in place what the group reads
    assert hoistable(ops.neg(x), [written]) and hoistable(x.reshape(6), [written])  # reads what the group reads
    with pytest.raises(ValueError, match="hoist must be op names"):
        FusionRule("bad_hoist", ("add", "mul"), bind=lambda ctx, nodes: None, hoist=("add", 3))


# -- the contract: hooks read off the specs, unique rule names, pattern sets, the rule index ----------


def test_hook_names_are_read_off_the_spec_class() -> None:
    specs = {name for name in dir(Hooks) if not name.startswith("_")}
    assert set(HOOK_NAMES) == specs and "absent_devices" in HOOK_NAMES
    mgr = manager_with(ToyPlugin())
    assert set(PluginManager().pm.hook.__dict__) >= specs
    assert set(mgr.plugins["toy"].hooks) == {"plugin_info", "devices", "kernels", "fusion_rules"}


class Rules:
    """Yields the given fusion rules for the toy device (and nothing else)."""

    def __init__(self, name: str, *rules: FusionRule, priority: int = 200) -> None:
        self.name, self.rules, self.priority = name, rules, priority

    @hookimpl
    def plugin_info(self) -> PluginInfo:
        return PluginInfo(self.name, priority=self.priority)

    @hookimpl
    def fusion_rules(self, device):  # noqa: ANN001, ANN202
        return list(self.rules) if device.kind == "toy" else []


def test_a_fusion_rule_name_two_plugins_yield_is_rejected_naming_both() -> None:
    toy = ToyPlugin()  # yields add_mul
    twin = Rules("twin", FusionRule("add_mul", ("add", "mul"), bind=toy._bind_add_mul), priority=100)
    mgr = manager_with(toy, twin)
    with pytest.warns(PluginWarning, match="fusion rule 'add_mul' of plugin 'twin' is rejected: plugin 'toy' "
                                           "already yields a rule of that name"):
        rules = mgr.fusion_rules(mgr.order(), TOY)
    assert [(p.name, r.name) for p, r in rules] == [("toy", "add_mul")]  # the first plugin's rule stays
    (a, b, c), y = add_mul_graph()
    with pytest.warns(PluginWarning, match="'twin'.*'toy'"):
        assert od.compile(y, TOY, plugins=mgr).fusions[0].plugin == "toy"
    strict = manager_with(ToyPlugin(), Rules("twin", *twin.rules, priority=100), strict=True)
    with pytest.raises(PluginError, match="fusion rule 'add_mul' of plugin 'twin' is rejected: plugin 'toy'"):
        od.compile(y, TOY, plugins=strict)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # distinct names from several plugins are fine
        both = manager_with(ToyPlugin(), Rules("other", FusionRule("add_mul_2", ("add", "mul"), bind=toy._bind_add_mul),
                                               priority=100))
        assert [r.name for _, r in both.fusion_rules(both.order(), TOY)] == ["add_mul", "add_mul_2"]


def test_a_set_in_a_pattern_matches_each_of_its_ops_and_nothing_else() -> None:
    rule = FusionRule("either_then_mul", ({"add", "sub"}, "mul"), bind=lambda ctx, nodes: None)
    assert rule.pattern == (frozenset({"add", "sub"}), "mul")
    a, b, c = (od.input(n, (2, 3)) for n in "abc")
    for first, fits in ((ops.add, True), (ops.sub, True), (ops.div, False)):
        graph = Graph.build(ops.mul(first(a, b), c))
        assert pattern_matches([n.op for n in graph.nodes], rule.pattern) is fits
        assert can_fuse(graph, graph.nodes, rule.pattern) is fits
        assert (gather(graph.nodes, 0, rule.pattern) is not None) is fits
    assert not pattern_matches(["add"], rule.pattern)  # and in number
    with pytest.raises(ValueError, match="a set in the pattern needs one or more op names"):
        FusionRule("empty", (set(), "mul"), bind=lambda ctx, nodes: None)


def bind_add_view_mul(ctx, nodes):  # noqa: ANN001, ANN201 - (a + b) * c through a view of the sum
    add, mul = nodes[0], nodes[-1]
    out, a, b, c = ctx.array(mul), ctx.array(add.srcs[0]), ctx.array(add.srcs[1]), ctx.array(mul.srcs[1])
    return lambda: store(out, (load(a, "f32") + load(b, "f32")) * load(c, "f32"), mul)


@pytest.mark.parametrize("view, fused", [(lambda t: t.reshape(2, 3), True), (lambda t: t.view((2, 3), (12, 4)), True),
                                         (lambda t: t.permute(0, 1), False)])
def test_a_set_pattern_fuses_each_member_through_the_scheduler(view, fused: bool) -> None:  # noqa: ANN001
    rng = np.random.default_rng()
    rule = FusionRule("add_view_mul", ("add", {"view", "reshape"}, "mul"), bind=bind_add_view_mul)
    mgr = manager_with(Rules("sets", rule), ToyPlugin())
    a, b, c = (od.input(n, (2, 3)) for n in "abc")
    plan = od.compile(ops.mul(view(ops.add(a, b)), c), TOY, plugins=mgr)
    assert [s.kernel for s in plan.fusions] == (["add_view_mul"] if fused else [])
    feeds = {a: rand(rng, 2, 3), b: rand(rng, 2, 3), c: rand(rng, 2, 3)}
    np.testing.assert_allclose(plan.run(feeds)[0], (feeds[a] + feeds[b]) * feeds[c], rtol=1e-6)


def test_rules_are_indexed_by_their_first_op_and_only_those_are_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    bind = ToyPlugin()._bind_add_mul
    add_mul = FusionRule("r_add_mul", ("add", "mul"), bind=bind)
    neg_mul = FusionRule("r_neg_mul", ("neg", "mul"), bind=bind)
    either = FusionRule("r_either", ({"add", "neg"}, "mul", "mul"), bind=bind)
    index = index_by_first_op([("p", add_mul), ("p", neg_mul), ("q", either)])
    assert {op: [r.name for _, r in rules] for op, rules in index.items()} == {
        "add": ["r_add_mul", "r_either"], "neg": ["r_neg_mul", "r_either"]}
    tried: list[tuple[str, str]] = []
    real = sched.gather
    monkeypatch.setattr(sched, "gather", lambda nodes, i, pattern, *rest: (tried.append((nodes[i].op, pattern)),
                                                                          real(nodes, i, pattern, *rest))[1])
    mgr = manager_with(Rules("rules", add_mul, neg_mul, either))
    a, b, c = (od.input(n, (2, 3)) for n in "abc")
    od.compile(ops.mul(ops.sub(ops.add(a, b), c), c), TOY, plugins=mgr)  # add, sub, mul
    assert tried == [("add", add_mul.pattern), ("add", either.pattern)]  # nothing at sub or mul


# -- devices: the manager's queries -----------------------------------------------------------------


class Absent:
    @hookimpl
    def absent_devices(self):  # noqa: ANN202
        return [AbsentDevice(toy_device("toy9"), "no toy plugged in")]


def test_devices_by_name_kind_or_the_best_and_absent_ones() -> None:
    mgr = manager_with(ToyPlugin(), Absent())
    assert mgr.device("toy0") is TOY and mgr.device("toy") is TOY and mgr.device(TOY) is TOY
    assert mgr.device().name == "cpu" and mgr.cpu().name == "cpu"  # no GPU among them
    with pytest.raises(ValueError, match=r"unknown device 'tpu' \(known: toy0, cpu\)"):
        mgr.device("tpu")
    assert [(a.stand_in.name, a.why) for a in mgr.absent_devices()] == [("toy9", "no toy plugged in")]
    bare = PluginManager()
    bare.register(ToyPlugin(), "toy")
    with pytest.raises(ValueError, match="no 'cpu' device: is the cpu plugin installed"):
        bare.cpu()


def test_the_plan_cache_is_emptied_when_plugins_change() -> None:
    mgr = manager_with(ToyPlugin())
    first = od.compile(add_mul_graph()[1], TOY, plugins=mgr)
    assert od.compile(add_mul_graph()[1], TOY, plugins=mgr).steps is first.steps
    mgr.register(Rules("more"), "more")
    assert compiler.plan_cache(mgr).plans == {}
    assert od.compile(add_mul_graph()[1], TOY, plugins=mgr).steps is not first.steps


def test_staging_is_a_declared_capability_checked_by_isinstance() -> None:
    from opdispatch.backends.cuda.backend import CudaBackend

    assert issubclass(HostBackend, StagedTransfers) and issubclass(CudaBackend, StagedTransfers)
    assert isinstance(HostBackend(TOY), StagedTransfers)
    assert not isinstance(NoStaging(TOY), StagedTransfers)  # staging = None: not staged

    class NoMark(HostBackend):
        mark = None

    assert not isinstance(NoMark(TOY), StagedTransfers)
