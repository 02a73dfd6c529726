"""Running one fuzz case in this process (the worker's side): build, plan, run, compare with the CPU
reference, and say what came of it. A crash or a hang here is for the runner to see.

Each case starts with an empty plan cache, so that its outcome depends on its seed alone. A
bad-feed case runs three times: good feeds on a first graph, the bad feeds on a second graph of
the same structure (its plan is the first one's, from the cache), then good feeds again on that
plan, which must still give the reference's result: a bad input may not leave the plan unusable or
its next run wrong.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

from ... import ops, plugins
from ...compiler import compile, plan_cache
from ...errors import OpdispatchError
from ...graph import Graph
from ...manager import manager
from ...tensor import Tensor, input as new_input
from ..harness import REFERENCE_PLUGIN, _values
from ..metrics import nmse
from .case import Built, FuzzCase, Outcome
from .mutation import reachable

#: the source trees of opdispatch and its built-in plugins; origins are given from the folder above them
_TREES = (Path(__file__).resolve().parents[2], Path(plugins.__file__).resolve().parent)
#: where this package's own code lives: an error raised there is a fault of the fuzzer, not of the library
FUZZ_ORIGIN = str(Path(__file__).resolve().parent.relative_to(_TREES[0].parent))
#: what the first graph's tensors are renamed with, so an error naming them is seen for what it is
FIRST = "_g1"


@attrs.frozen
class Verdict:
    outcome: Outcome
    detail: str = ""
    #: a valid case refused with a named error (counted as named, reported apart)
    refused: bool = False
    #: the innermost line of the opdispatch source tree an error passed through ("" without an error)
    origin: str = ""


def origin(exc: BaseException) -> str:
    """'core/plan.py:283 in _host_bytes': the innermost frame of ours in exc's traceback."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        for tree in _TREES:
            if path.is_relative_to(tree):
                return f"{path.relative_to(tree.parent)}:{frame.lineno} in {frame.name}"
    return ""


def _raised(case: FuzzCase, exc: Exception, bad: bool, before: str = "") -> Verdict:
    """Named: an OpdispatchError naming the op or the tensor concerned, and no tensor of another graph."""
    text = f"{before}{type(exc).__name__}: {exc}"
    if FIRST in str(exc):
        return Verdict(Outcome.UNNAMED, text + " [names the graph the cached plan was made for]", origin=origin(exc))
    if isinstance(exc, OpdispatchError) and case.names_any(str(exc)):
        return Verdict(Outcome.NAMED, text, refused=not bad, origin=origin(exc))
    return Verdict(Outcome.UNNAMED, text, origin=origin(exc))


def _reference(graph: Graph, feeds: dict[Tensor, Any]) -> list[np.ndarray]:
    return compile(graph, "cpu", prefer=(REFERENCE_PLUGIN,), fusion=False).run(feeds)


def _compare(built: Built, outputs: Sequence[Tensor], ref: list[np.ndarray], got: list[np.ndarray]) -> str:
    """'' when every output is within the case's bound of the reference, else what differs."""
    for i, t in enumerate(outputs):
        r, o = _values(t, ref[i], built.case), _values(t, got[i], built.case)
        if r.shape != o.shape:
            return f"output {i} {t.describe()}: shape {o.shape}, reference {r.shape}"
        err = nmse(o, r)
        if not err <= built.case.bound:
            return f"output {i} {t.describe()}: nmse {err:.3g} > bound {built.case.bound:.3g}"
    return ""


def _described(outputs: Sequence[Tensor]) -> str:
    return ", ".join(t.describe() for t in outputs)


def execute(case: FuzzCase, device: str) -> Verdict:
    """Build and run `case` on `device`; the verdict on what it did.

    The plan cache is emptied first: a case's plans are its own, so that its seed alone replays it.
    """
    plan_cache(manager()).plans.clear()
    try:
        built = case.build(np.random.default_rng(case.seed))
    except Exception as exc:  # noqa: BLE001 - what a case raises is its outcome
        return _raised(case, exc, case.bad)
    if built.bad_feeds is None:
        return _run(case, built, device)
    return _run_bad_feeds(case, built, case.build(np.random.default_rng(case.seed)), device)


def _run(case: FuzzCase, built: Built, device: str) -> Verdict:
    try:
        graph = Graph.build(built.outputs)
        plan = compile(graph, device)
        plan.poison()  # an output left unwritten fails the comparison
        got = plan.run(built.feeds)
        if case.bad:
            return Verdict(Outcome.ACCEPTED, f"ran without error, giving {_described(graph.outputs)}")
        ref = _reference(graph, built.feeds)
    except Exception as exc:  # noqa: BLE001
        return _raised(case, exc, case.bad)
    problem = _compare(built, graph.outputs, ref, got)
    return Verdict(Outcome.MISMATCH, problem) if problem else Verdict(Outcome.MATCH)


def _run_bad_feeds(case: FuzzCase, first: Built, second: Built, device: str) -> Verdict:
    for t in reachable(first.outputs):
        t.name += FIRST
    try:
        g1 = Graph.build(first.outputs)
        plan = compile(g1, device)
        plan.poison()
        got = plan.run(first.feeds)
        ref = _reference(g1, first.feeds)
    except Exception as exc:  # noqa: BLE001
        return _raised(case, exc, False, "the good run before the bad feed: ")
    problem = _compare(first, g1.outputs, ref, got)
    if problem:
        return Verdict(Outcome.MISMATCH, f"the good run before the bad feed: {problem}")
    try:
        g2 = Graph.build(second.outputs)
        plan = compile(g2, device)
    except Exception as exc:  # noqa: BLE001
        return _raised(case, exc, False, "planning the second graph: ")
    try:
        plan.run(second.bad_feeds)
        verdict = Verdict(Outcome.ACCEPTED, f"the bad feed ran without error, giving {_described(g2.outputs)}")
    except Exception as exc:  # noqa: BLE001
        verdict = _raised(case, exc, True)
    try:
        plan.poison()
        got = plan.run(second.feeds)
    except Exception as exc:  # noqa: BLE001
        return Verdict(Outcome.MISMATCH, f"after the bad feed ({verdict.outcome.value}: {verdict.detail}), the next "
                                         f"good run raised {type(exc).__name__}: {exc}", origin=origin(exc))
    problem = _compare(second, g2.outputs, ref, got)
    if problem:
        return Verdict(Outcome.MISMATCH, f"after the bad feed, the next good run: {problem}")
    return verdict


def canary(device: str) -> bool:
    """Whether `device` still runs a small graph right (a case may leave a GPU context unusable)."""
    try:
        x = new_input("canary", (4, 8))
        (out,) = compile(ops.add(x, x), device).run({x: np.ones((4, 8), np.float32)})
        return bool(np.all(out == 2.0))
    except Exception:  # noqa: BLE001 - any failure means the device is not usable
        return False
