"""`python -m opdispatch.testing.fuzz`: a fuzz run from the command line.

    python -m opdispatch.testing.fuzz [--device D] [--cases N] [--seed S] [--timeout T] [--replay SEED ...]

Prints the outcome counts (overall and per kind of case), then each failing case with its seed and
description, then the valid cases refused with a named error. `--replay` runs the given case seeds
(as printed) instead of a run's. Exit status 1 when a case crashed, hung, raised an unnamed error,
was accepted while bad, or mismatched.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from typing import Sequence

from .runner import run_fuzz


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m opdispatch.testing.fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="device under test (default cpu)")
    p.add_argument("--cases", type=int, default=1000, help="cases to run (default 1000)")
    p.add_argument("--seed", type=int, help="seed of the run (default: fresh, printed)")
    p.add_argument("--timeout", type=float, help="seconds per case before it counts as a hang")
    p.add_argument("--replay", type=int, action="append", metavar="SEED", help="run this case seed (repeatable)")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else secrets.randbits(32)
    extra = {"timeout": args.timeout} if args.timeout else {}
    step = max(args.cases // 10, 1)

    def progress(i: int) -> None:
        if i % step == 0:
            print(f"... {i} cases", file=sys.stderr, flush=True)

    report = run_fuzz(args.device, args.cases, seed, seeds=args.replay, progress=progress, **extra)
    print(report.format())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
