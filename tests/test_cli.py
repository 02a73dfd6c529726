"""The `opdispatch` command: info, ops, run, and its errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from opdispatch import manager
from opdispatch.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info_lists_devices_and_plugins_in_order(capsys) -> None:
    code, out, _ = run_cli(capsys, "info")
    assert code == 0
    assert re.search(r"^  cpu +cpu ", out, re.M)
    listed = re.findall(r"^  \d+\. (\S+)", out, re.M)
    assert listed == [p.name for p in manager().order()]
    assert listed[-1] == "cpu"  # the reference is asked last
    assert "priority 0" in out and "entry point opdispatch.reference.plugin" in out
    if not any(d.kind == "cuda" for d in manager().devices()):
        assert "(no CUDA device: " in out


def test_ops_matrix_and_markdown(capsys, tmp_path: Path) -> None:
    path = tmp_path / "docs" / "ops.md"
    code, out, _ = run_cli(capsys, "ops", "--device", "cpu", "--markdown", str(path))
    assert code == 0
    assert re.search(r"^rms_norm +f32 +cpu:numpy$", out, re.M)
    assert re.search(r"^mul_mat +q8_0,f32 +cpu:numpy$", out, re.M)  # the weight dtype, then the activations
    assert not re.search(r"^(view|reshape|permute|transpose) ", out, re.M)  # views run no kernel
    text = path.read_text()
    assert "| op | dtype | cpu |" in text and "| rms_norm | f32 | cpu:numpy |" in text
    assert "- `rms_norm` (norm): RMS norm per row" in text


def test_ops_plans_for_a_gpu_description_without_one(capsys) -> None:
    code, out, _ = run_cli(capsys, "ops", "--device", "cuda0")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["op", "dtype", "cuda0"]
    # Every row names who runs it there, or says it falls back (or has no case).
    assert rows and all(re.search(r"\S+ +\S+ +\S", r) for r in rows)


def test_run_with_defaults_reports_plans_and_tokens_per_second(capsys) -> None:
    code, out, _ = run_cli(capsys, "run", "--device", "cpu")
    assert code == 0
    assert re.search(r"^prefill plan: \d+ nodes -> \d+ launches \(cpu \d+\); fusions: .+; copies: \d+; "
                     r"arena peak: cpu ", out, re.M)
    assert re.search(r"^decode plan: ", out, re.M)
    assert re.search(r"^prefill: 16 tokens in [\d.]+ ms = [\d.]+ tokens/s$", out, re.M)
    assert re.search(r"^decode: 31 tokens in [\d.]+ ms = [\d.]+ tokens/s", out, re.M)
    generated = re.search(r"generated: ([\d ]+)$", out, re.M)
    assert generated and len(generated.group(1).split()) == 32


def test_test_ops_is_the_conformance_harness(capsys) -> None:
    code, out, _ = run_cli(capsys, "test-ops", "-o", "rms_norm", "--device", "cpu")
    assert code == 0
    assert re.search(r"^rms_norm +\d+ +\d+ +0 ", out, re.M)


@pytest.mark.parametrize("argv", [("run", "--device", "tpu7"), ("ops", "--device", "tpu7"),
                                  ("test-ops", "--device", "tpu7")])
def test_unknown_device_is_a_usage_error(capsys, argv: tuple[str, ...]) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and not out
    assert re.fullmatch(r"opdispatch [\w-]+: error: unknown device 'tpu7' \(known: .*\bcpu\b.*\)\n", err)


def test_context_overflow_is_a_usage_error(capsys) -> None:
    code, _, err = run_cli(capsys, "run", "--tokens", "200")
    assert code == 2 and "fit the context of 128" in err


def test_python_dash_m_runs_the_same_command() -> None:
    done = subprocess.run([sys.executable, "-m", "opdispatch", "run", "--tokens", "3", "--prompt-len", "4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tokens/s" in done.stdout
