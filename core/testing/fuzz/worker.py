"""The fuzz worker: a long-lived process that runs the cases its runner sends, one JSON line each way.

    python -m opdispatch.testing.fuzz.worker --device D --source MODULE:FUNCTION [--memory-limit BYTES]

It answers {"ready": true} once it can run cases on D (else {"error": ...}), then one verdict per
{"seed": N}. The protocol keeps the process's original stdout; anything else written there goes to
stderr. When a case leaves the device unable to run a small graph, the answer says so and the
worker exits, to be started afresh: the next case must not inherit a broken device.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import resource
import signal
import sys
import warnings
from typing import Any, Callable, Sequence

from ...manager import manager
from .case import FuzzCase, Outcome
from .execute import canary, execute


def load(source: str) -> Callable[[int], FuzzCase]:
    """The case source 'module:function' (a function of a seed, as `draw`)."""
    module, _, name = source.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m opdispatch.testing.fuzz.worker")
    p.add_argument("--device", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--memory-limit", type=int, default=0, help="address-space limit in bytes (0: none)")
    args = p.parse_args(argv)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # C-level prints too
    sys.stdout = sys.stderr
    faulthandler.enable()  # a crash leaves its stack in stderr, which the runner shows
    faulthandler.register(signal.SIGUSR1)  # so does a hang: the runner signals before it kills
    warnings.simplefilter("ignore")
    if args.memory_limit:
        # an allocation past this raises MemoryError instead of the kernel's OOM killer taking the machine's memory
        resource.setrlimit(resource.RLIMIT_AS, (args.memory_limit, args.memory_limit))

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")

    try:
        manager().device(args.device)
        draw = load(args.source)
    except Exception as exc:  # noqa: BLE001 - reported to the runner, which raises it
        send({"error": f"{type(exc).__name__}: {exc}"})
        return 2
    send({"ready": True})
    for line in sys.stdin:
        v = execute(draw(json.loads(line)["seed"]), args.device)
        usable = v.outcome in (Outcome.MATCH, Outcome.NAMED) or canary(args.device)
        send({"outcome": v.outcome.value, "detail": v.detail, "refused": v.refused, "origin": v.origin,
              "usable": usable})
        if not usable:
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
