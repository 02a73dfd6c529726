"""`opdispatch test-ops`: the conformance sweep from the command line, after ggml's test-backend-ops.

    opdispatch test-ops [-o OP] [--device D] [--mode test|perf|support] [--full] [-p PLUGIN] [--no-fusion]

test: each case on the device against the CPU reference; perf: each case timed
for a second (large perf cases where a group has them, sized for a GPU);
support: which plugin takes each case on the device. A progress
line (rewritten with \\r on a terminal, one line per op otherwise), then a
summary table per op and fused pattern; groups without cases are listed as
"no cases". The exit status is 1 when any case fails, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable, TextIO

from ..hookspecs import Device
from ..manager import PluginManager, manager
from .cases import Case, sweep
from .harness import Result, Status, copy_bandwidth, format_rate, run_case, run_perf, support

MODES = ("test", "perf", "support")


def add_test_ops_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `test-ops` subcommand to the main CLI's subparsers; its handler is `test_ops_main`."""
    p = subparsers.add_parser(
        "test-ops", help="conformance sweep: every op on a device against the CPU reference",
        description="Compare every op (and fused pattern) on a device with the numpy reference by NMSE, time it, "
                    "or show which plugin takes it. Exit status 1 when a case fails.")
    p.add_argument("-o", "--op", action="append", default=[], metavar="OP",
                   help="op or fused pattern to test (repeatable or comma-separated; 'fused' for every pattern)")
    p.add_argument("--device", help="device under test (default: the first GPU, else cpu)")
    p.add_argument("--mode", choices=MODES, default="test", help="test (default), perf or support")
    p.add_argument("--full", action="store_true", help="the whole sweep (default: a quick subset)")
    p.add_argument("-p", "--plugin", help="plugin under test: asked first; nodes it does not take are unsupported")
    p.add_argument("--seed", type=int, help="seed of the random inputs (default: fresh each case)")
    p.add_argument("--no-fusion", dest="fusion", action="store_false", default=None,
                   help="plan the device's graphs without fusion (as OPDISPATCH_DISABLE_FUSION=1): the fused "
                        "patterns' cases then check the kernels run one by one")
    p.set_defaults(handler=test_ops_main)
    return p


class _Progress:
    """A progress line: rewritten in place on a terminal, one line per finished group otherwise."""

    def __init__(self, out: TextIO, total: int) -> None:
        self.out, self.total, self.done = out, total, 0
        self.tty = out.isatty()

    def _bar(self, text: str) -> None:
        width = 20
        filled = width * self.done // max(self.total, 1)
        self.out.write(f"\r\x1b[K[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {text}")
        self.out.flush()

    def case(self, group: str, i: int, n: int) -> None:
        if self.tty:
            self._bar(f"{group} {i}/{n}")

    def note(self, line: str) -> None:
        """A line kept above the progress line (a failure, a timing)."""
        self.out.write(("\r\x1b[K" if self.tty else "") + line + "\n")

    def group(self, group: str, summary: str) -> None:
        self.done += 1
        if self.tty:
            self._bar(f"{group}: {summary}")
        else:
            self.out.write(f"[{self.done}/{self.total}] {group}: {summary}\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\r\x1b[K")


#: per mode: what a case that went well is called, and the summary's last column
_DONE = {"test": "passed", "perf": "timed", "support": "supported"}
_LAST = {"test": "worst nmse/bound", "perf": "best rate", "support": "plugins"}


def _counts(mode: str, results: list[Result]) -> tuple[int, int, int]:
    """(went well, failed, unsupported)."""
    done = Status.SUPPORTED if mode == "support" else Status.PASS
    return tuple(sum(r.status is s for r in results) for s in (done, Status.FAIL, Status.UNSUPPORTED))


def _last_column(mode: str, results: list[Result]) -> str:
    if mode == "test":  # the largest nmse/bound: a case passes below 1
        if any(r.status is Status.FAIL and math.isnan(r.nmse) for r in results):
            return "error"
        ratios = [r.nmse / r.bound for r in results if not math.isnan(r.nmse)]
        return f"{max(ratios):.2g}" if ratios else "-"
    if mode == "perf":
        timed = [r for r in results if r.runs]
        return format_rate(max(timed, key=lambda r: r.rate)) if timed else "-"
    return ",".join(sorted({r.plugin for r in results if r.status is Status.SUPPORTED})) or "-"


def _summary_line(mode: str, results: list[Result]) -> str:
    done, failed, unsupported = _counts(mode, results)
    return f"{len(results)} cases, {done} {_DONE[mode]}, {failed} failed, {unsupported} unsupported"


def _table(mode: str, by_group: dict[str, list[Result]]) -> str:
    def row(name: str, results: list[Result], last: str) -> tuple[str, ...]:
        return (name, str(len(results)), *map(str, _counts(mode, results)), last)

    rows = [row(g, rs, _last_column(mode, rs)) if rs else (g, "0", "-", "-", "-", "no cases")
            for g, rs in by_group.items()]
    every = [r for rs in by_group.values() for r in rs]
    total = row("total", every, f"{sum(not rs for rs in by_group.values())} without cases")
    head = ("op", "cases", _DONE[mode], "failed", "unsupported", _LAST[mode])
    widths = [max(len(r[i]) for r in (head, *rows, total)) for i in range(len(head))]
    rule = "  ".join("-" * w for w in widths)

    def fmt(r: tuple[str, ...]) -> str:
        return "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths)))

    return "\n".join([fmt(head), rule, *map(fmt, rows), rule, fmt(total)])


def test_ops_main(args: argparse.Namespace, plugins: PluginManager | None = None, out: TextIO | None = None) -> int:
    """Run the sweep that `args` asks for; print progress, failures and a summary. Exit status."""
    out = out or sys.stdout
    mgr = plugins or manager()
    selected = [name for item in args.op for name in item.split(",") if name]
    try:
        device = mgr.device(args.device)
        by_case = sweep(selected, args.full, perf=args.mode == "perf")
    except (KeyError, ValueError) as exc:
        print(f"opdispatch test-ops: error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if args.plugin and args.plugin not in mgr.plugins:
        print(f"opdispatch test-ops: error: unknown plugin '{args.plugin}' (known: {', '.join(mgr.plugins)})",
              file=sys.stderr)
        return 2
    ceiling = copy_bandwidth(device, mgr) if args.mode == "perf" else None
    run = _runner(args, device, mgr)
    n_cases = sum(map(len, by_case.values()))
    print(f"test-ops {args.mode} on {device.name} ({device.description or device.kind}): {n_cases} cases in "
          f"{len(by_case)} groups{' (full sweep)' if args.full else ''}"
          + (", fusion off" if args.fusion is False else "")
          + (f", plugin under test {args.plugin}" if args.plugin else "")
          + (f"; copy ceiling {ceiling / 1e9:.1f} GB/s" if ceiling else ""), file=out)
    progress = _Progress(out, len(by_case))
    results: dict[str, list[Result]] = {}
    for group, group_cases in by_case.items():
        results[group] = []
        for i, case in enumerate(group_cases):
            progress.case(group, i, len(group_cases))
            r = run(case)
            results[group].append(r)
            if r.status is Status.FAIL or args.mode != "test":
                progress.note(_line(args.mode, r, ceiling))
        progress.group(group, _summary_line(args.mode, results[group]) if group_cases else "no cases")
    progress.close()
    print(_table(args.mode, results), file=out)
    failed = [r for rs in results.values() for r in rs if r.status is Status.FAIL]
    if failed:
        print(f"\n{len(failed)} failed:", file=out)
        for r in failed:
            print(f"  {r.describe()}", file=out)
    return 1 if failed else 0


def _runner(args: argparse.Namespace, device: Device, mgr: PluginManager) -> Callable[[Case], Result]:
    fusion = args.fusion
    if args.mode == "perf":
        return lambda case: run_perf(case, device, mgr, plugin=args.plugin, fusion=fusion)
    if args.mode == "support":
        return lambda case: support(case, device, mgr, plugin=args.plugin, fusion=fusion)
    return lambda case: run_case(case, device, mgr, plugin=args.plugin, seed=args.seed, fusion=fusion)


def _line(mode: str, r: Result, ceiling: float | None) -> str:
    if mode == "perf" and r.runs and ceiling and not r.case.flops:
        return f"{r.describe()} ({100 * r.rate / ceiling:.0f}% of copy)"
    return r.describe()
