"""The scheduler's CPU fallback and offload rule; the memory plan."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.alloc import overlapping
from opdispatch.backends.cuda import plugin as cuda_plugin
from opdispatch.backends.cuda.devices import H200
from opdispatch.backends.cuda.plugin import batch_size
from opdispatch.hookspecs import PluginInfo, hookimpl
from opdispatch.ops import OPS
from opdispatch.plugins import cuda_misc
from toy import TOY, ToyPlugin, manager_with, toy_device


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.uniform(-1, 1, shape).astype(np.float32)


# -- scheduler ----------------------------------------------------------------------
def test_chain_across_devices_copies_values_and_gives_reference_results() -> None:
    rng = np.random.default_rng()
    mgr = manager_with(ToyPlugin())
    a, b = od.input("a", (6, 4)), od.input("b", (6, 4))
    s = ops.add(a, b)
    t = ops.tanh(s)
    y = ops.mul(t, b)  # add on toy, tanh on cpu, mul on toy
    plan = od.compile(y, TOY, plugins=mgr)
    devices = [s.device.name for s in plan.steps if s.kind == "kernel"]
    assert devices == ["toy0", "cpu", "toy0"]
    copies = [(c.out, c.kernel) for c in plan.steps if c.kind == "copy"]
    assert copies == [(s, "toy0->cpu"), (t, "cpu->toy0")]
    fa, fb = rand(rng, 6, 4), rand(rng, 6, 4)
    np.testing.assert_allclose(plan.run({a: fa, b: fb})[0], np.tanh(fa + fb) * fb, rtol=1e-6, atol=1e-7)


def test_host_memory_devices_share_buffers_without_copies() -> None:
    rng = np.random.default_rng()
    dev = toy_device("toyh", host_memory=True)
    mgr = manager_with(ToyPlugin(device=dev))
    a, b = od.input("a", (6, 4)), od.input("b", (6, 4))
    y = ops.mul(ops.tanh(ops.add(a, b)), b)
    plan = od.compile(y, dev, plugins=mgr)
    assert not [s for s in plan.steps if s.kind == "copy"]
    fa, fb = rand(rng, 6, 4), rand(rng, 6, 4)
    np.testing.assert_allclose(plan.run({a: fa, b: fb})[0], np.tanh(fa + fb) * fb, rtol=1e-6, atol=1e-7)


class OffloadFrom:
    """Offloads a toy-device node reading host weights from `rows` rows on (a rule like the CUDA plugin's)."""

    def __init__(self, rows: int, name: str = "offload", priority: int = 300) -> None:
        self.rows, self.name, self.priority, self.asked = rows, name, priority, 0

    @hookimpl
    def plugin_info(self) -> PluginInfo:
        return PluginInfo(self.name, priority=self.priority)

    @hookimpl
    def offload_op(self, device, node):  # noqa: ANN001, ANN202
        self.asked += 1
        if device.kind == "toy":
            return node.shape[-2] >= self.rows or f"{node.shape[-2]} rows, fewer than {self.rows}"
        return None


@pytest.mark.parametrize("rows, offloaded", [(31, False), (32, True)])
def test_offload_answer_moves_host_weights_and_results_agree(rows: int, offloaded: bool) -> None:
    rng = np.random.default_rng()
    mgr = manager_with(OffloadFrom(32), ToyPlugin())
    w = od.param("w", rand(rng, rows, 8))
    x = od.input("x", (rows, 8))
    y = ops.add(x, w)
    plan = od.compile(y, TOY, plugins=mgr, host_params=[w])
    (step,) = [s for s in plan.steps if s.kind == "kernel"]
    assert step.device.name == ("toy0" if offloaded else "cpu")
    if offloaded:
        assert step.note == "offloaded"
        assert any(s.kind == "copy" and s.note == "bind" for s in plan.steps)  # weights copied once
    else:
        assert step.note == "weights on host, 31 rows, fewer than 32"
    fx = rand(rng, rows, 8)
    np.testing.assert_allclose(plan.run({x: fx})[0], fx + w.data.view(np.float32).reshape(rows, 8), rtol=1e-6)


def test_without_an_offload_answer_host_weights_stay_on_the_host() -> None:
    w = od.param("w", np.ones((64, 8), np.float32))
    x = od.input("x", (64, 8))
    plan = od.compile(ops.add(x, w), TOY, plugins=manager_with(ToyPlugin()), host_params=[w])
    (step,) = [s for s in plan.steps if s.kind == "kernel"]
    assert step.device.name == "cpu" and step.note == "weights on host, no plugin offloads it"


@pytest.mark.parametrize("rows, offloaded", [(31, False), (32, True)])
def test_cuda_plugin_offloads_host_weights_from_a_batch_of_32(rows: int, offloaded: bool) -> None:
    """ggml's rule, the CUDA backend plugin's offload_op, planned on an H200's description."""
    w = od.param("w", np.ones((rows, 8), np.float32))
    x = od.input("x", (rows, 8))
    plan = od.compile(ops.add(x, w), H200, host_params=[w])
    (step,) = [s for s in plan.steps if s.kind == "kernel"]
    assert step.device.name == ("cuda0" if offloaded else "cpu")
    assert step.note == ("offloaded" if offloaded else "weights on host, batch 31 below offload threshold")


def test_offload_env_threshold_and_plugin_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng()
    w = od.param("w", rand(rng, 4, 8))
    x = od.input("x", (4, 8))
    y = ops.add(x, w)
    monkeypatch.setenv("OPDISPATCH_OFFLOAD_MIN_BATCH", "4")
    plan = od.compile(y, H200, host_params=[w])
    assert [s.device.name for s in plan.steps if s.kind == "kernel"] == ["cuda0"]

    class NeverOffload:
        @hookimpl
        def plugin_info(self) -> PluginInfo:
            return PluginInfo("never", priority=300)

        @hookimpl
        def offload_op(self, device, node):  # noqa: ANN001, ANN202
            return False

    mgr = manager_with(NeverOffload(), cuda_plugin, cuda_misc)  # asked before the CUDA plugin's rule
    plan = od.compile(y, H200, plugins=mgr, host_params=[w])
    (step,) = [s for s in plan.steps if s.kind == "kernel"]
    assert step.device.name == "cpu" and step.note == "weights on host, never keeps it on the host"


def test_offload_op_is_firstresult_the_first_opinion_decides_and_later_plugins_are_not_asked() -> None:
    first, second = OffloadFrom(1, "first", 300), OffloadFrom(1000, "second", 250)
    mgr = manager_with(first, second, ToyPlugin())
    assert mgr.pm.hook.offload_op.spec.opts["firstresult"] is True
    w = od.param("w", np.ones((8, 8), np.float32))
    x = od.input("x", (8, 8))
    plan = od.compile(ops.add(x, w), TOY, plugins=mgr, host_params=[w])
    assert [s.device.name for s in plan.steps if s.kind == "kernel"] == ["toy0"]  # first's yes, not second's no
    assert (first.asked, second.asked) == (1, 0)
    answer, who = mgr.first_result(mgr.order(prefer=["second"]), "offload_op", device=TOY, node=plan.graph.nodes[0])
    assert (answer, who.name) == ("8 rows, fewer than 1000", "second")
    with pytest.raises(TypeError, match="supports_op is not declared firstresult"):
        mgr.first_result(mgr.order(), "supports_op", device=TOY, node=plan.graph.nodes[0])


def test_batch_size_follows_ggml() -> None:
    x = od.input("x", (2, 40, 8))
    assert batch_size(ops.neg(x)) == 40
    table = od.input("t", (100, 8))
    assert batch_size(ops.get_rows(table, od.input("i", (40,), "i32"))) == 0


def test_in_place_write_away_from_home_is_written_back() -> None:
    """set_rows into a state runs on the CPU (toy declines it): the state's home is toy."""
    rng = np.random.default_rng()
    mgr = manager_with(ToyPlugin())
    cache = od.state("cache", (8, 4))
    src = od.input("src", (2, 4))
    idx = od.input("idx", (2,), "i64")
    upd = ops.set_rows(cache, src, idx)
    y = ops.add(upd, od.input("z", (8, 4)))
    plan = od.compile(y, TOY, plugins=mgr)
    assert any(s.note == "write-back" for s in plan.steps)
    fz = rand(rng, 8, 4)
    s1 = rand(rng, 2, 4)
    out = plan.run({src: s1, idx: np.array([1, 5]), z_of(plan): fz})[0]
    want = np.zeros((8, 4), np.float32)
    want[[1, 5]] = s1
    np.testing.assert_allclose(out, want + fz, rtol=1e-6)
    s2 = rand(rng, 2, 4)
    plan.run({src: s2, idx: np.array([0, 1]), z_of(plan): fz})  # the state persists across runs
    want[[0, 1]] = s2
    np.testing.assert_allclose(plan.read(cache), want, rtol=1e-6)


def z_of(plan: od.Plan) -> od.Tensor:
    return next(t for t in plan.graph.inputs if t.name == "z")


# -- memory plan ----------------------------------------------------------------------
def decoder_like(layers: int, rng: np.random.Generator, tokens: int = 8, hidden: int = 64):  # noqa: ANN201
    """A stack of pre-norm blocks: norm, projections, activation, residual adds."""
    x = od.input("x", (tokens, hidden))
    h = x
    for i in range(layers):
        w1 = od.param(f"w1.{i}", rand(rng, 4 * hidden, hidden))
        w2 = od.param(f"w2.{i}", rand(rng, hidden, 4 * hidden))
        g = od.param(f"g.{i}", rand(rng, hidden))
        n = ops.mul(ops.rms_norm(h, 1e-6), g)
        u = ops.silu(ops.mul_mat(w1, n))
        h = ops.add(h, ops.scale(ops.mul_mat(w2, u), 0.1))
    return x, h


def test_memory_plan_peak_is_far_below_the_sum_and_results_are_right() -> None:
    rng = np.random.default_rng()
    x, y = decoder_like(16, rng)
    plan = od.compile(y, "cpu")
    mem = plan.memory["cpu"]
    assert mem.peak * 10 < mem.total(), (mem.peak, mem.total())
    assert not overlapping(mem.slots)
    assert any(len(s.keys) > 1 for s in mem.slots), "no in-place reuse happened"
    fx = rand(rng, 8, 64)
    h = fx.astype(np.float64)
    for i in range(16):
        names = {t.name: t.data.view(np.float32) for t in plan.graph.params}
        w1, w2, g = (names[f"w1.{i}"].reshape(256, 64), names[f"w2.{i}"].reshape(64, 256), names[f"g.{i}"])
        n = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g
        u = n @ w1.T
        u = u / (1 + np.exp(-u))
        h = h + 0.1 * (u @ w2.T)
    out = plan.run({x: fx})[0]
    assert np.sum((out - h) ** 2) / np.sum(h ** 2) < 1e-7


def test_outputs_and_intermediate_outputs_are_not_overwritten() -> None:
    rng = np.random.default_rng()
    a = od.input("a", (16, 16))
    s1 = ops.neg(a)
    s2 = ops.exp(s1)  # may reuse s1's bytes only if s1 is not an output
    s3 = ops.tanh(s2)
    plan = od.compile([s3, s1], "cpu")
    fa = rand(rng, 16, 16)
    o3, o1 = plan.run({a: fa})
    np.testing.assert_allclose(o1, -fa, rtol=1e-6)
    np.testing.assert_allclose(o3, np.tanh(np.exp(-fa)), rtol=1e-6)


def test_no_in_place_reuse_when_another_source_views_the_same_bytes() -> None:
    rng = np.random.default_rng()
    a = od.input("a", (8, 8))
    s = ops.neg(a)
    y = ops.add(s, ops.transpose(s))  # writing y over s would race with reading s transposed
    plan = od.compile(y, "cpu")
    assert all(len(slot.keys) == 1 for slot in plan.memory["cpu"].slots)
    fa = rand(rng, 8, 8)
    np.testing.assert_allclose(plan.run({a: fa})[0], -fa - fa.T, rtol=1e-6)


def test_in_place_reuse_is_read_off_the_op_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    assert OPS["exp"].reuses_src0 and OPS["rms_norm"].reuses_src0 and OPS["add"].reuses_src0
    assert not OPS["glu"].reuses_src0 and not OPS["add_id"].reuses_src0 and not OPS["soft_max"].reuses_src0
    a = od.input("a", (16, 16))
    y = ops.exp(ops.neg(a))  # exp reads neg's result for the last time: it may write over it
    plan = od.compile(y, "cpu", plugins=manager_with())
    assert [len(slot.keys) for slot in plan.memory["cpu"].slots] == [2]
    monkeypatch.setitem(OPS, "exp", attrs.evolve(OPS["exp"], reuses_src0=False))
    plan = od.compile(y, "cpu", plugins=manager_with())  # a fresh manager: a plan cache of its own
    assert [len(slot.keys) for slot in plan.memory["cpu"].slots] == [1, 1]
    fa = np.random.default_rng().uniform(-1, 1, (16, 16)).astype(np.float32)
    np.testing.assert_allclose(plan.run({a: fa})[0], np.exp(-fa), rtol=1e-6)
