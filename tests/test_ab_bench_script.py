"""scripts/ab_bench.py without a GPU: the trees it exports (a revision, the working tree, a revision with a patch,
extra benchmark files) from a scratch git repository, and the side-by-side table from pytest-benchmark documents."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import load_script

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


@pytest.fixture(scope="module")
def ab():  # noqa: ANN201 - the script, imported as a module
    return load_script("ab_bench")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository whose HEAD holds a.txt = 'one' and benchmarks/b.py; then a.txt edited, an untracked c.txt and
    an ignored d.log in its working tree."""
    r = tmp_path / "repo"
    (r / "benchmarks").mkdir(parents=True)
    (r / "a.txt").write_text("one\n")
    (r / "benchmarks" / "b.py").write_text("x = 1\n")
    (r / ".gitignore").write_text("*.log\n")
    _git(r, "init", "-q")
    _git(r, "add", ".")
    _git(r, "commit", "-q", "-m", "first")
    (r / "a.txt").write_text("two\n")
    (r / "c.txt").write_text("new\n")
    (r / "d.log").write_text("ignored\n")
    return r


def test_prepare_exports_revision_working_tree_and_patch(ab, repo: Path, tmp_path: Path) -> None:  # noqa: ANN001
    patch = tmp_path / "p.patch"
    patch.write_text(subprocess.run(["git", "diff"], cwd=repo, capture_output=True, text=True, check=True).stdout)
    extra = tmp_path / "bench_extra.py"
    extra.write_text("y = 2\n")
    out = tmp_path / "ab"
    trees = ab.prepare(["old=HEAD", "new=.", f"patched=HEAD:{patch}"], out, [str(extra)], repo)
    assert [t["name"] for t in trees] == ["old", "new", "patched"]
    assert json.loads((out / ab.MANIFEST).read_text()) == trees
    assert (out / "old" / "a.txt").read_text() == "one\n" and not (out / "old" / "c.txt").exists()
    assert (out / "new" / "a.txt").read_text() == "two\n" and (out / "new" / "c.txt").read_text() == "new\n"
    assert not (out / "new" / "d.log").exists() and not (out / "new" / ".git").exists()
    assert (out / "patched" / "a.txt").read_text() == "two\n" and not (out / "patched" / "c.txt").exists()
    for name in ("old", "new", "patched"):
        assert (out / name / "benchmarks" / "bench_extra.py").read_text() == "y = 2\n"
        assert (out / name / "benchmarks" / "b.py").read_text() == "x = 1\n"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
    assert trees[0]["what"] == head.strip() and trees[1]["what"] == f"the working tree at {head.strip()}"
    assert trees[2]["what"] == f"{head.strip()} + {patch}"
    ab.prepare(["old=HEAD"], out, [], repo)  # again: the tree is rewritten, the manifest names only it
    assert not (out / "old" / "benchmarks" / "bench_extra.py").exists()
    assert [t["name"] for t in json.loads((out / ab.MANIFEST).read_text())] == ["old"]


def test_prepare_applies_a_patch_inside_the_repository(ab, repo: Path, tmp_path: Path) -> None:  # noqa: ANN001
    """The trees' folder inside the repository, as the default .ab: the patch still changes the exported tree (git
    apply run in a subfolder of a repository skips the paths outside it without an error)."""
    patch = tmp_path / "p.patch"
    patch.write_text(subprocess.run(["git", "diff"], cwd=repo, capture_output=True, text=True, check=True).stdout)
    assert patch.read_text()
    ab.prepare([f"patched=HEAD:{patch}"], repo / ".ab", [], repo)
    assert (repo / ".ab" / "patched" / "a.txt").read_text() == "two\n"


@pytest.mark.parametrize("spec", ["old", "=HEAD", "old=", "a/b=HEAD"])
def test_prepare_refuses_a_bad_tree(ab, repo: Path, tmp_path: Path, spec: str) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit, match="NAME=REV"):
        ab.prepare([spec], tmp_path / "ab", [], repo)


def _doc(*benches: tuple) -> dict:
    """A pytest-benchmark document: (name, us or None, copy fraction or None, mean seconds)."""
    out = []
    for name, us, frac, mean in benches:
        extra = {**({"us": us} if us is not None else {}), **({"copy_fraction": frac} if frac is not None else {})}
        out.append({"name": name, "extra_info": extra, "stats": {"mean": mean}})
    return {"benchmarks": out}


def test_compare_puts_the_trees_side_by_side(ab, rng) -> None:  # noqa: ANN001
    a1, a2, b1, b2 = (float(x) for x in rng.uniform(5, 20, 4))
    results = {
        "old": [_doc(("mv", a1, 0.5, 1.0), ("gemm", None, None, 2e-5)), _doc(("mv", a2, 0.25, 1.0))],
        "new": [_doc(("mv", b1, 0.75, 1.0), ("only_new", 3.0, None, 1.0)), _doc(("mv", b2, 1.0, 1.0))],
    }
    lines = ab.compare(results).splitlines()
    assert lines[0] == "| benchmark | old us | new us | new / old | old % copy | new % copy |"
    rows = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ")[1:] for line in lines[2:]}
    assert list(rows) == ["mv", "gemm", "only_new"]
    ratio = ((b1 + b2) / 2) / ((a1 + a2) / 2)  # medians of two rounds
    assert rows["mv"] == [f"{a1:.1f} / {a2:.1f}", f"{b1:.1f} / {b2:.1f}", f"{ratio:.3f}", "50% / 25%", "75% / 100%"]
    assert rows["gemm"] == ["20.0", "-", "-", "-", "-"]  # no extra_info us: the mean
    assert rows["only_new"] == ["-", "3.0", "-", "-", "-"]


def test_run_times_each_tree_in_rounds(ab, repo: Path, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The rounds' loop on the CPU: two trees whose one benchmark records a different `us`, installs skipped; the
    table names both trees and gives each tree's times in both rounds."""
    bench = ("def test_{name}(benchmark):\n    benchmark.extra_info['us'] = {us}\n"
             "    benchmark.pedantic(lambda: None, rounds=1, iterations=1)\n")  # one call: not calibrated for a second
    (repo / "benchmarks" / "test_step.py").write_text(bench.format(name="step", us=10.0))
    (repo / "benchmarks" / "test_other.py").write_text(bench.format(name="other_step", us=4.0))
    _git(repo, "add", "benchmarks/test_step.py", "benchmarks/test_other.py")
    _git(repo, "commit", "-q", "-m", "bench")
    (repo / "benchmarks" / "test_step.py").write_text(bench.format(name="step", us=7.5))
    out = tmp_path / "ab"
    ab.prepare(["old=HEAD", "new=."], out, [], repo)
    installed = []
    monkeypatch.setattr(ab, "_install", installed.append)
    table = ab.run(out, ["benchmarks/test_step.py", "benchmarks/test_other.py"], "step", 2, 120)
    assert installed == [(out / "old").resolve(), (out / "new").resolve()] * 2 + [ab.ROOT]  # both files in one run
    assert table.splitlines()[0].startswith("trees: old = ") and "; new = the working tree at " in table
    row = next(line for line in table.splitlines() if line.startswith("| test_step"))
    assert row == "| test_step | 10.0 / 10.0 | 7.5 / 7.5 | 0.750 | - | - |"
    row = next(line for line in table.splitlines() if line.startswith("| test_other_step"))
    assert row == "| test_other_step | 4.0 / 4.0 | 4.0 / 4.0 | 1.000 | - | - |"
    assert not list(out.glob("*/.ab-*.json"))  # each round's document removed once read
