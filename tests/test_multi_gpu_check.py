"""scripts/multi-gpu-check without GPUs: its command line, that each pytest run selects the tests it names, how a
run's log becomes its result, and the split benchmarks' table (scripts/bench_table.py)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_table import split_table  # noqa: E402


@pytest.fixture(scope="module")
def check():  # noqa: ANN201 - the script, imported as a module
    loader = importlib.machinery.SourceFileLoader("multi_gpu_check", str(ROOT / "scripts" / "multi-gpu-check"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def test_cli_parses(check, capsys) -> None:  # noqa: ANN001
    assert [r.name for r in check.parse_args([]).runs] == ["tests", "bench", "big", "cli-tensor", "cli-layer"]
    assert [r.name for r in check.parse_args(["big", "tests"]).runs] == ["tests", "big"]  # in RUNS' order
    with pytest.raises(SystemExit) as exc:
        check.parse_args(["big", "huge"])
    assert exc.value.code == 2
    assert "unknown run huge; the runs: tests, bench, big, cli-tensor, cli-layer" in capsys.readouterr().err


def test_list_prints_each_run_and_its_command(check, capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("OUT", "/out")
    assert check.main(["--list", "bench"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("bench: decode b1, one GPU against two")
    assert "python3 -m pytest -p no:cacheprovider -rfEsP benchmarks/test_bench_split.py " \
           "--benchmark-json=/out/split.json    (limit 180 s)" in out


def test_without_two_gpus_it_stops_before_installing(check, capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(check, "gpus", lambda: (1, ""))
    monkeypatch.setattr(check.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    assert check.main([]) == 2
    assert "needs two GPUs or more, found 1" in capsys.readouterr().err


@pytest.mark.parametrize("name, want, unwanted", [
    ("tests", {"test_layer_split.py::test_the_over_one_gpu_shape_split_over_two_gpus_gives_the_logits_and_tokens_of_"
               "one", "test_layer_split.py::test_two_gpus_give_the_greedy_tokens_of_one[1b]",
               "test_tensor_split.py::test_two_gpus_tensor_split_give_the_greedy_tokens_of_one[1b]"},
     "test_a_model_larger_than_one_gpu_runs_split_over_two"),
    ("big", {"test_layer_split.py::test_a_model_larger_than_one_gpu_runs_split_over_two"}, None),
    ("bench", {f"test_bench_split.py::test_split_decode_against_one_gpu[{c}]"
               for c in ("tensor-1b", "tensor-8b", "layer-1b", "layer-8b")}, None),
])
def test_each_pytest_run_selects_its_tests(check, name: str, want: set[str],  # noqa: ANN001
                                           unwanted: str | None) -> None:
    (run,) = [r for r in check.RUNS if r.name == name]
    argv = [a for a in run.command("/tmp") if not a.startswith(("--benchmark-json", "-rfEsP"))]
    done = subprocess.run([sys.executable, *argv[1:], "--collect-only", "-q"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ids = {line.split("/", 1)[1] for line in done.stdout.splitlines() if "::" in line}
    assert want <= ids, ids
    assert name != "big" or ids == want
    assert unwanted is None or not any(unwanted in i for i in ids)


def test_a_runs_log_gives_its_result(check) -> None:  # noqa: ANN001
    tests, cli = (next(r for r in check.RUNS if r.name == n) for n in ("tests", "cli-layer"))
    log = "....\nFAILED tests/x.py::y - assert\n==== 1 failed, 12 passed, 2 skipped in 80.1s ====\n"
    assert check.outcome(tests, 1, log) == "1 failed, 12 passed, 2 skipped in 80.1s (exit status 1)"
    assert check.outcome(tests, 0, "== 14 passed in 70.0s ==") == "14 passed in 70.0s"
    assert check.outcome(tests, 124, log) == "timed out"
    log = ("prefill: 16 tokens in 9.00 ms = 1777.8 tokens/s\n"
           "decode: 63 tokens in 60.10 ms = 1048.3 tokens/s (0.954 ms/token)\n")
    assert check.outcome(cli, 0, log) == "1048.3 tokens/s decode"
    assert check.outcome(cli, 2, "usage") == "no decode line (exit status 2)"


def test_the_split_table_says_whether_each_target_is_met() -> None:
    def bench(split: str, preset: str, one: float, two: float, target: float | None) -> dict:
        return {"extra_info": {"split": split, "preset": preset, "dtype": "bf16", "batch": 1, "one_gpu_tokens/s": one,
                               "two_gpu_tokens/s": two, "speedup": two / one, "target": target,
                               "met": None if target is None else two / one >= target, "logits_nmse": 2.5e-7,
                               "same_tokens": True}}

    rows = split_table([bench("tensor", "1b", 1000, 1400, 1.5), bench("tensor", "8b", 250, 420, 1.6),
                        bench("layer", "8b", 250, 240, None)]).splitlines()
    assert rows[0].startswith("| split | preset | dtype | batch | one GPU tokens/s | two GPUs tokens/s | speedup |")
    assert rows[2] == "| tensor | 1b | bf16 | 1 | 1000 | 1400 | 1.40 | >= 1.5x: NOT met | 2.5e-07 | True |"
    assert rows[3] == "| tensor | 8b | bf16 | 1 | 250 | 420 | 1.68 | >= 1.6x: met | 2.5e-07 | True |"
    assert re.fullmatch(r"\| layer \| 8b .* \| 0\.96 \| none \| .*", rows[4])
