#!/usr/bin/env python3
"""Time commits side by side on one GPU in one call: each tree's benchmarks in alternating rounds, one table.

A kernel or plumbing change is shown not to regress by timing the old and the new commit in the same device
call (docs/benchmarks.md). The device machine's copy of the repository carries no current git history, so the
trees are exported here first, then carried:

    python3 scripts/ab_bench.py prepare old=HEAD~1 new=. [--extra benchmarks/bench_new.py] [--dir .ab]

Each NAME=REV is exported to DIR/NAME: REV a git revision (`git archive`), "." the working tree (tracked files
and the untracked ones git does not ignore, as they are now), REV:PATCH a revision with a patch file applied.
--extra copies files into every tree's benchmarks/ (a new benchmark timed on an old commit too). Then, on the
GPU machine (the device tool's `carry` naming DIR and .gpu-deps):

    python3 scripts/ab_bench.py run [--dir .ab] [-k EXPR] [--file benchmarks/test_bench_matmul.py]... [--rounds 2]

For each round, each tree in turn is installed (pip -e, no dependencies) and its --file benchmarks (one pytest run of
every --file given, default benchmarks/test_bench_matmul.py: one install a tree and round) run with -k;
the table gives every benchmark's time in each tree, the rounds joined by " / ", each tree's median against the
first tree's, and the fraction of the copy bandwidth where the benchmark records one. The repository the script
runs from is installed again at the end. OPDISPATCH_BENCH_COMPILE defaults to 0 (no torch.compile baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "trees.json"  # the prepared trees, in order: the first is the baseline


def _git(*args: str, cwd: Path = ROOT) -> bytes:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True).stdout


def export(rev: str, dest: Path, repo: Path = ROOT) -> str:
    """Tree `rev` of `repo` written to dest (made empty first); returns what it is (a commit, or the working tree)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    rev, _, patch = rev.partition(":")
    if rev == ".":
        files = _git("ls-files", "--cached", "--others", "--exclude-standard", "-z", cwd=repo).decode().split("\0")
        for name in filter(None, files):
            src = repo / name
            if src.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)
        what = "the working tree at " + _git("rev-parse", "--short", "HEAD", cwd=repo).decode().strip()
    else:
        with tempfile.TemporaryFile() as tar:
            tar.write(_git("archive", "--format=tar", rev, cwd=repo))
            tar.seek(0)
            with tarfile.open(fileobj=tar) as t:
                t.extractall(dest, filter="data")
        what = _git("rev-parse", "--short", rev, cwd=repo).decode().strip()
    if patch:
        # outside any repository (the ceiling stops git from finding the one dest lies in, as .ab does in this
        # one): inside it, `git apply` would skip every path outside dest, without an error
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.resolve().parent)}
        subprocess.run(["git", "apply", str(Path(patch).resolve())], cwd=dest, check=True, env=env)
        what += f" + {patch}"
    return what


def prepare(specs: list[str], out: Path, extra: list[str], repo: Path = ROOT) -> list[dict]:
    """Export each NAME=REV under out and write the manifest; returns its entries."""
    trees = []
    for spec in specs:
        name, sep, rev = spec.partition("=")
        if not sep or not name or not rev or "/" in name:
            raise SystemExit(f"tree {spec!r}: expected NAME=REV (REV a revision, '.', or REV:PATCH)")
        what = export(rev, out / name, repo)
        for f in extra:
            shutil.copy2(f, out / name / "benchmarks" / Path(f).name)
        trees.append({"name": name, "rev": rev, "what": what})
    (out / MANIFEST).write_text(json.dumps(trees, indent=1))
    return trees


def compare(results: dict[str, list[dict]]) -> str:
    """A markdown table from each tree's pytest-benchmark JSON documents (one a round), trees in the order given:
    a benchmark's us (extra_info's, else the mean) a tree, rounds joined by ' / ', each tree's median over the
    first's, and % of the copy bandwidth (extra_info's copy_fraction) where recorded."""
    names = list(results)
    seen: dict[str, dict[str, list[dict]]] = {}
    for tree, docs in results.items():
        for doc in docs:
            for b in doc.get("benchmarks", []):
                seen.setdefault(b["name"], {}).setdefault(tree, []).append(b)

    def us(b: dict) -> float:
        e = b.get("extra_info", {})
        return float(e["us"]) if "us" in e else 1e6 * float(b["stats"]["mean"])

    head = ["benchmark", *(f"{t} us" for t in names), *(f"{t} / {names[0]}" for t in names[1:]),
            *(f"{t} % copy" for t in names)]
    rows = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for bench, per in seen.items():
        times = {t: [us(b) for b in per.get(t, [])] for t in names}
        cells = [" / ".join(f"{x:.1f}" for x in times[t]) or "-" for t in names]
        base = times[names[0]]
        cells += [f"{statistics.median(times[t]) / statistics.median(base):.3f}" if times[t] and base else "-" for t in names[1:]]
        cells += [" / ".join(f"{100 * b['extra_info']['copy_fraction']:.0f}%" for b in per.get(t, [])
                             if "copy_fraction" in b.get("extra_info", {})) or "-" for t in names]
        rows.append(f"| {bench} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _install(tree: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(tree)],
                   check=True, capture_output=True)


def run(out: Path, files: list[str], expr: str, rounds: int, timeout: float) -> str:
    """The rounds on this machine's GPU (see the module docstring); returns the table."""
    trees = json.loads((out / MANIFEST).read_text())
    # a session of its own: an xdist worker's variables (this script run from a test) would disable the benchmarks
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))}
    env["OPDISPATCH_BENCH_COMPILE"] = os.environ.get("OPDISPATCH_BENCH_COMPILE", "0")
    if (ROOT / ".gpu-deps").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / ".gpu-deps"), env.get("PYTHONPATH")]))
    results: dict[str, list[dict]] = {t["name"]: [] for t in trees}
    try:
        for r in range(rounds):
            for t in trees:
                tree = (out / t["name"]).resolve()
                _install(tree)
                js = tree / f".ab-{r}.json"
                cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", f"--benchmark-json={js}"]
                done = subprocess.run([*cmd, *(["-k", expr] if expr else [])], cwd=tree, env=env, capture_output=True,
                                      text=True, timeout=timeout)
                if not js.exists():
                    raise SystemExit(f"{t['name']} round {r}: no results\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
                results[t["name"]].append(json.loads(js.read_text()))
                js.unlink()
                last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]  # pytest's summary line
                print(f"round {r + 1}/{rounds} {t['name']}: {last}", flush=True)
    finally:
        _install(ROOT)
    trees_line = "; ".join(f"{t['name']} = {t['what']}" for t in trees)
    return f"trees: {trees_line}\n\n{compare(results)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="export the trees (here)")
    p.add_argument("trees", nargs="+", metavar="NAME=REV")
    p.add_argument("--extra", action="append", default=[], help="a file copied into every tree's benchmarks/")
    p.add_argument("--dir", default=".ab")
    r = sub.add_parser("run", help="time the prepared trees (on the GPU machine)")
    r.add_argument("--dir", default=".ab")
    r.add_argument("--file", dest="files", action="append", help="benchmark files (repeatable; default "
                   "benchmarks/test_bench_matmul.py)")
    r.add_argument("-k", dest="expr", default="")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--timeout", type=float, default=300, help="seconds a tree's round may take")
    a = ap.parse_args()
    out = Path(a.dir)
    if a.cmd == "prepare":
        for t in prepare(a.trees, out, a.extra):
            print(f"{out / t['name']}: {t['what']}")
    else:
        print(run(out, a.files or ["benchmarks/test_bench_matmul.py"], a.expr, a.rounds, a.timeout))


if __name__ == "__main__":
    main()
