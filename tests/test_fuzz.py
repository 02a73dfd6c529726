"""The fuzz suite: thousands of random cases, valid and bad, on the CPU (and on cuda0 with a GPU), each in
a worker process; every case must match the reference or raise a named error. Then the runner itself
(a crash, a hang, an accepted bad case and an unnamed error are each seen and the run goes on), the
case generator (seeded, covering the catalogue, each mutation a valid call but for the one thing it
breaks) and the command line."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from opdispatch import ops
from opdispatch.errors import OpError
from opdispatch.ops import OPS
from opdispatch.testing.cases import Case
from opdispatch.testing.fuzz import FAILING, FAMILIES, Built, FuzzCase, Outcome, Runner, case_seeds, draw, run_fuzz
from opdispatch.testing.fuzz.__main__ import main
from opdispatch.testing.fuzz.catalogue import bases
from opdispatch.testing.fuzz.calls import Call
from opdispatch.testing.fuzz.draw import applicable
from opdispatch.testing.fuzz.execute import FUZZ_ORIGIN

CPU_CASES = 2000
GPU_CASES = 2000


@pytest.fixture(scope="module")
def run_seed() -> int:
    """One seed for the module's fuzz run, printed; OPDISPATCH_TEST_SEED replays it."""
    s = int(os.environ.get("OPDISPATCH_TEST_SEED", np.random.SeedSequence().entropy % 2**63))
    print(f"fuzz run seed {s}: replay with OPDISPATCH_TEST_SEED={s}")
    return s


@pytest.fixture(scope="module")
def cpu_report(run_seed: int):
    return run_fuzz("cpu", CPU_CASES, run_seed)


def _failed(report) -> str:
    counts = {o.value: report.count(o) for o in FAILING}
    return f"{counts}\n{report.format()}"


def test_fuzz_cpu(cpu_report) -> None:
    """No crash, hang, unnamed error, accepted bad input or mismatch on the CPU."""
    print(cpu_report.format())
    assert len(cpu_report.results) >= 1000
    failing = len(cpu_report.failures)
    assert failing == 0, _failed(cpu_report)


def test_fuzz_faults_lie_in_the_library(cpu_report) -> None:
    """The run covers every family and valid cases, and no error comes from the fuzzer's own code."""
    assert {r.case.kind for r in cpu_report.results} == set(FAMILIES)
    assert cpu_report.count(Outcome.MATCH) >= len(cpu_report.results) // 5
    ours = [r.describe() for r in cpu_report.results if r.origin.startswith(FUZZ_ORIGIN)]
    assert not ours, "\n".join(ours)
    assert all(r.detail for r in cpu_report.results if r.outcome is not Outcome.MATCH)


@pytest.mark.gpu
def test_fuzz_cuda0(run_seed: int) -> None:
    report = run_fuzz("cuda0", GPU_CASES, run_seed)
    print(report.format())
    failing = len(report.failures)
    assert failing == 0, _failed(report)


# -- the runner, on cases that misbehave on purpose ---------------------------------------------------------


def _add(rng: np.random.Generator) -> Built:
    case = Case("add", "probe", lambda inp: ops.add(inp.uniform((4, 8)), inp.uniform((4, 8))))
    outputs, feeds = case.build(rng)
    return Built(case, outputs, feeds)


def _segfault(rng: np.random.Generator) -> Built:
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    raise AssertionError("unreachable")


def _killed(rng: np.random.Generator) -> Built:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def _sleeps(rng: np.random.Generator) -> Built:
    time.sleep(600)
    raise AssertionError("unreachable")


def _unnamed(rng: np.random.Generator) -> Built:
    raise ValueError("something deep inside")


def _named(rng: np.random.Generator) -> Built:
    raise OpError("add: refused, as asked")


#: seed -> (kind, bad, build) of the runner's probe cases
PROBES = {0: ("valid", False, _add), 1: ("segfault", True, _segfault), 2: ("sleeps", True, _sleeps),
          3: ("accepted", True, _add), 4: ("unnamed", True, _unnamed), 5: ("named", True, _named),
          6: ("killed", True, _killed), 7: ("refused", False, _named)}


def probe(seed: int) -> FuzzCase:
    """The case source of the runner tests (the worker imports it by name)."""
    kind, bad, build = PROBES[seed]
    return FuzzCase(seed, "add", kind, bad, f"probe {kind}", (), build)


def test_runner_sees_each_outcome_and_goes_on() -> None:
    seeds = [0, 1, 0, 2, 0, 3, 4, 5, 6, 7, 0]
    with Runner("cpu", source=f"{__name__}:probe", timeout=3.0) as runner:
        results = list(runner.run(seeds))
    assert [r.outcome for r in results] == [
        Outcome.MATCH, Outcome.CRASH, Outcome.MATCH, Outcome.HANG, Outcome.MATCH, Outcome.ACCEPTED, Outcome.UNNAMED,
        Outcome.NAMED, Outcome.CRASH, Outcome.NAMED, Outcome.MATCH]
    assert "SIGSEGV" in results[1].detail and "Segmentation fault" in results[1].detail
    assert "SIGKILL" in results[8].detail
    assert "within 3 s" in results[3].detail
    assert "ValueError: something deep inside" in results[6].detail
    assert [r.refused for r in results[7:10]] == [False, False, True]


def test_runner_refuses_a_device_it_cannot_run() -> None:
    with pytest.raises(RuntimeError, match="nodevice"):
        run_fuzz("nodevice", 1, 0)


# -- the generator --------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**63 - 1))
def test_draw_is_a_function_of_the_seed(seed: int) -> None:
    a, b = draw(seed), draw(seed)
    assert (a.op, a.kind, a.bad, a.description, a.names) == (b.op, b.kind, b.bad, b.description, b.names)
    assert a.kind in FAMILIES and a.bad == (a.kind not in ("valid", "valid-param"))
    assert a.op in OPS


def test_case_seeds_extend_a_run() -> None:
    assert case_seeds(3, 10) == case_seeds(3, 20)[:10]
    assert len(set(case_seeds(3, 1000))) == 1000


def test_every_op_is_fuzzed_valid_and_bad() -> None:
    every = bases()
    by_kind = {k: {every[i].call.op for i in applicable(k)} for k in FAMILIES}
    assert by_kind["valid"] >= set(OPS)
    bad = set().union(*(ops_ for k, ops_ in by_kind.items() if k not in ("valid", "valid-param")))
    assert bad >= set(OPS)
    assert by_kind["index"] == {"get_rows", "set_rows", "add_id", "mul_mat_id"}


def test_calls_rebuild_their_node() -> None:
    for base in bases():
        outputs, _ = base.case.build(np.random.default_rng(1))
        node = outputs[0]
        again = Call.of(node).invoke()
        assert (again.op, again.shape, again.dtype, again.params, again.srcs) == (
            node.op, node.shape, node.dtype, node.params, node.srcs), base.case.name


def test_names_are_whole_words() -> None:
    case = probe(0)
    assert case.names_any("add: shapes differ ['add.12' (3,) f32]")
    assert not case.names_any("add_id: ids out of range") and not case.names_any("add1: b must hold one element")
    assert not case.names_any("padded rows")


def test_cli_prints_counts_and_replays_a_case(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["--cases", "40", "--seed", "11"])
    out = capsys.readouterr().out
    assert out.startswith("fuzz on cpu: 40 cases (seed 11)")
    report = run_fuzz("cpu", 40, 11)
    assert status == (1 if report.failures else 0)
    first = report.results[0]
    (again,) = run_fuzz("cpu", seeds=[first.case.seed]).results
    assert (again.outcome, again.case.description) == (first.outcome, first.case.description)
    for r in report.failures:
        assert f"seed={r.case.seed} {r.case.description}" in out
