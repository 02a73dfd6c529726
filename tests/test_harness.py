"""The conformance harness on the CPU: every op has cases, every default case passes
against itself end to end (compile + run for every op), and the harness catches a
plugin that computes wrong, one that leaves outputs unwritten, and reports what a
device does not run."""

from __future__ import annotations

import argparse
import io
import itertools
import warnings
from typing import Callable, Iterator

import numpy as np
import pytest

from opdispatch import ops
from opdispatch.errors import CaptureWarning
from opdispatch.hookspecs import Device, Kernel, PluginInfo, hookimpl
from opdispatch.ops import OPS
from opdispatch.ops.base import OpDef
from opdispatch.reference import load
from opdispatch.testing import cases, cli
from opdispatch.testing.cases import Case, Inputs
from opdispatch.testing.harness import Status, run_case, run_perf, support
from toy import ToyPlugin, manager_with, toy_device

pytest_plugins = ["pytester"]

DEFAULT = [c for group in cases.groups() for c in cases.cases(group)]


def _same_shape_add(shape: tuple[int, ...] = (4, 64)) -> Case:
    return Case("add", f"f32 {shape}", lambda inp: ops.add(inp.uniform(shape), inp.uniform(shape)))


def test_every_op_and_pattern_has_cases() -> None:
    missing = [group for group in cases.groups() if not cases.cases(group)]
    assert not missing, f"ops or fused patterns without conformance cases: {', '.join(missing)}"
    assert set(OPS) <= set(cases.groups())


@pytest.mark.parametrize("case", DEFAULT, ids=[c.name for c in DEFAULT])
def test_default_case_passes_on_cpu(case: Case) -> None:
    r = run_case(case, "cpu")
    assert r.status is Status.PASS, r.describe()
    assert r.nmse == 0.0 and r.plugin == ("view" if case.op in ("view", "reshape", "permute", "transpose") else "cpu:numpy")


def test_full_sweep_builds() -> None:
    rng = np.random.default_rng(0)
    for group in cases.groups():
        for case in cases.cases(group, full=True):
            outputs, feeds = case.build(rng)
            assert outputs and all(t.is_leaf for t in feeds), case.name


def test_sweep_selection() -> None:
    assert list(cases.sweep(["add", "rms_norm_mul"])) == ["add", "fused:rms_norm_mul"]
    assert all(g.startswith("fused:") for g in cases.sweep(["fused"]))
    with pytest.raises(KeyError, match="nope"):
        cases.sweep(["nope"])
    # Perf mode: large cases where a group has them, its test cases otherwise.
    perf = cases.sweep(["mul_mat", "neg"], perf=True)
    assert [c.label for c in perf["mul_mat"]] == [c.label for c in cases.perf_cases("mul_mat")]
    assert [c.label for c in perf["neg"]] == [c.label for c in cases.cases("neg")]


def test_inputs_layouts_are_views_with_the_asked_shape() -> None:
    inp = Inputs(np.random.default_rng(0))
    for layout in cases.LAYOUTS:
        t = inp.uniform((2, 3, 64), "q8_0" if layout != "T" else "f16", layout=layout)
        assert t.shape == (2, 3, 64)
        assert t.is_contiguous() == (layout == "contig")
    ids = inp.ids((5, 4), 6)
    assert all(len(set(row)) == 4 for row in inp.feeds[ids])
    with pytest.raises(ValueError, match="does not apply"):
        inp.uniform((4, 64), layout="perm")


def test_a_wrong_plugin_fails_with_its_name() -> None:
    dev = toy_device("toy_broken0", host_memory=True)
    mgr = manager_with(ToyPlugin("toy_broken", offset=1e-3, device=dev))
    r = run_case(_same_shape_add(), dev, plugins=mgr)
    assert r.status is Status.FAIL
    assert r.plugin == "toy_broken:toy_add" and "toy_broken" in r.describe()
    assert r.nmse > r.bound and "nmse" in r.error and str(r.seed) in r.describe()


def test_a_right_plugin_passes_and_a_declined_node_is_unsupported() -> None:
    dev = toy_device("toy_good0", host_memory=True)
    mgr = manager_with(ToyPlugin("toy_good", device=dev))
    ok = run_case(_same_shape_add(), dev, plugins=mgr)
    assert ok.status is Status.PASS and ok.nmse <= ok.bound, ok.describe()
    broadcast = Case("add", "bcast", lambda inp: ops.add(inp.uniform((4, 64)), inp.uniform((64,))))
    r = run_case(broadcast, dev, plugins=mgr)
    assert r.status is Status.UNSUPPORTED and r.plugin == "cpu:numpy"
    assert "runs on cpu" in r.error and "no broadcasting" in r.error
    assert support(cases.cases("mul_mat")[0], dev, plugins=mgr).status is Status.UNSUPPORTED
    assert support(_same_shape_add(), dev, plugins=mgr).status is Status.SUPPORTED
    # With a plugin under test, a node another plugin takes is unsupported too.
    assert run_case(_same_shape_add(), "cpu", plugins=mgr, plugin="toy_good").status is Status.UNSUPPORTED


class NegPlugin:
    """neg on a toy device, computed by `body(out, x, node, run)` on its run-th launch (from 1)."""

    def __init__(self, name: str, device: Device, body: Callable[..., None]) -> None:
        self.name, self.device, self.body = name, device, body

    @hookimpl
    def plugin_info(self) -> PluginInfo:
        return PluginInfo(self.name, "1.0", 200)

    @hookimpl
    def devices(self) -> list[Device]:
        return [self.device]

    @hookimpl
    def kernels(self, device: Device) -> Iterator[Kernel]:
        if device.kind == "toy":
            yield Kernel("neg", self._bind, name=f"{self.name}_neg")

    def _bind(self, ctx, node):  # noqa: ANN001, ANN202 - a test kernel
        out, x = ctx.array(node), ctx.array(node.srcs[0])
        runs = itertools.count(1)
        return lambda: self.body(out.reshape(-1), -load(x, node.srcs[0]).reshape(-1), next(runs))


def _neg_case() -> Case:
    return Case("neg", "f32 3x5", lambda inp: ops.neg(inp.uniform((3, 5))))


def _run_neg(name: str, body: Callable[..., None]) -> object:
    dev = toy_device(f"{name}0", host_memory=True)
    return run_case(_neg_case(), dev, plugins=manager_with(NegPlugin(name, dev, body)), plugin=name)


def test_unwritten_output_values_are_caught() -> None:
    def forgets_the_last(out: np.ndarray, want: np.ndarray, run: int) -> None:
        out[:-1] = want[:-1]

    r = _run_neg("toy_lazy", forgets_the_last)
    assert r.status is Status.FAIL and r.plugin == "toy_lazy:toy_lazy_neg"
    assert "output 0: 1 of 15 values not written (still poisoned NaN) in run 1" in r.error


def test_a_third_run_is_checked() -> None:
    """Right on its first two runs, wrong after (as state a CUDA graph replay leaves behind would make it):
    the plan's third run (a replay of the graph its second captured) fails the case."""
    def wrong_from_the_third(out: np.ndarray, want: np.ndarray, run: int) -> None:
        out[:] = want + (run >= 3)

    r = _run_neg("toy_replay", wrong_from_the_third)
    assert r.status is Status.FAIL and r.nmse > r.bound, r.describe()
    assert _run_neg("toy_right", lambda out, want, run: out.__setitem__(slice(None), want)).status is Status.PASS


def test_a_failed_graph_capture_fails_the_case() -> None:
    """A segment that could not be captured runs by direct launches (right results): the sweep, which must check
    the kernels inside CUDA graphs, fails it, naming the capture's error."""
    def uncapturable(out: np.ndarray, want: np.ndarray, run: int) -> None:
        out[:] = want
        if run == 2:
            warnings.warn("opdispatch: toy0: CUDA graph capture of segment failed: no", CaptureWarning, stacklevel=1)

    r = _run_neg("toy_nocapture", uncapturable)
    assert r.status is Status.FAIL and r.nmse == 0.0
    assert "CUDA graph capture of segment failed: no" in r.error


def test_perf_mode_times_launches() -> None:
    r = run_perf(cases.cases("mul_mat")[0], "cpu", min_time=0.02)
    assert r.status is Status.PASS and r.runs >= 1 and r.seconds > 0
    assert r.rate > 0 and "TFLOP/s" in r.describe()
    r = run_perf(_same_shape_add(), "cpu", min_time=0.02)
    assert r.nbytes == 3 * 4 * 64 * 4 and "GB/s" in r.describe()
    # A copy into a buffer in place reads the source and writes the buffer once.
    into = Case("cpy", "f32->f16", lambda inp: ops.cpy(inp.uniform((4, 64)), inp.uniform((4, 64), "f16")))
    assert run_perf(into, "cpu", min_time=0.02).nbytes == 4 * 64 * (4 + 2)


def _cli(*argv: str, **kwargs: object) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    cli.add_test_ops_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    code = cli.test_ops_main(parser.parse_args(["test-ops", *argv]), out=out, **kwargs)
    return code, out.getvalue()


def test_cli_summary_and_exit_status(monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = _cli("-o", "add,rms_norm", "--device", "cpu")
    assert code == 0
    assert "[1/2] add: 5 cases, 5 passed, 0 failed, 0 unsupported" in out
    assert "worst nmse/bound" in out and "total" in out

    monkeypatch.setitem(OPS, "fake_op", OpDef("fake_op", ops.neg, "unary"))
    code, out = _cli("-o", "fake_op", "--device", "cpu", "--mode", "support")
    assert code == 0 and "fake_op: no cases" in out and "1 without cases" in out

    dev = toy_device("toy_cli0", host_memory=True)
    code, out = _cli("-o", "add", "--device", "toy_cli0", "-p", "toy_cli",
                     plugins=manager_with(ToyPlugin("toy_cli", offset=1e-3, device=dev)))
    assert code == 1 and "FAIL add[" in out and "by toy_cli:toy_add" in out
    assert "unsupported" in out


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("-o", "no_such_op")[0] == 2
    assert _cli("--device", "nowhere")[0] == 2
    assert _cli("-p", "nobody", "-o", "add")[0] == 2
    assert "unknown plugin 'nobody'" in capsys.readouterr().err


def test_pytest_plugin_parametrizes_cases(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_conformance(opdispatch_case):\n    opdispatch_case.check()\n")
    result = pytester.runpytest("-p", "opdispatch.testing.pytest_plugin", "--opdispatch-device", "cpu",
                                "--opdispatch-op", "add,fused:multi_add", "-q")
    result.assert_outcomes(passed=len(cases.cases("add")) + len(cases.cases("fused:multi_add")))
