"""Run conformance cases: on the device under test against the CPU reference, timed, or only planned.

`run_case` compiles a case for the device under test and for "cpu" with the
numpy reference plugin asked first, feeds both the same inputs and compares
every output by NMSE. Outputs must be proven written, not just close: the
arena is poisoned with NaN before each run, and the plans run with two sets of
inputs, so that a value the device left equal to its previous run where the
reference changed fails the case too (outputs written in place, into a state,
are not in the arena). The device's plan runs three times (the first inputs,
the second, the first again): on CUDA the first run launches directly, the
second captures the plan's CUDA graph and replays it, the third replays it
again, and a segment whose capture fails (`CaptureWarning`) fails the case.
A case whose node under test the device's plan
sends to another device, or to another plugin than the one under test, is
reported unsupported, as ggml's test-backend-ops does. The standard these checks
hold kernels to is docs/conformance.md.
"""

from __future__ import annotations

import enum
import math
import secrets
import time
import warnings
from typing import Iterable, Mapping, Sequence

import attrs
import numpy as np

from .. import ops
from ..compiler import compile
from ..dtypes import to_host_float
from ..errors import CaptureWarning
from ..graph import Graph
from ..hookspecs import Device
from ..manager import PluginManager, manager
from ..plan import Plan
from ..sched import Step
from ..tensor import Tensor
from .cases import Case
from .metrics import nmse

#: the plugin whose kernels are the oracle
REFERENCE_PLUGIN = "cpu"
#: one unit in the last place, relative, of each float result dtype (for telling rounding from stale values)
_EPS = {"f32": 2.0**-23, "f16": 2.0**-10, "bf16": 2.0**-7}


class Status(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    UNSUPPORTED = "unsupported"
    SUPPORTED = "supported"  # support mode: planned on the device, not run


@attrs.frozen
class Result:
    """What one case did on one device; `plugin` says who ran its node ("plugin:kernel")."""

    case: Case
    status: Status
    device: str
    plugin: str = ""
    nmse: float = math.nan
    error: str = ""
    seed: int = 0
    #: perf mode: seconds per run and runs timed
    seconds: float = math.nan
    runs: int = 0
    nbytes: int = 0

    @property
    def bound(self) -> float:
        return self.case.bound

    @property
    def rate(self) -> float:
        """Perf mode: FLOP/s for compute-bound cases, else bytes/s."""
        return (self.case.flops or self.nbytes) / self.seconds

    def describe(self) -> str:
        """One line: status, case, who ran it, the numbers, and why it failed or was not supported."""
        head = f"{self.status.value.upper()} {self.case.name} on {self.device}"
        if self.plugin:
            head += f" by {self.plugin}"
        if self.runs:
            head += f": {self.seconds * 1e6:.1f} us/run, {format_rate(self)}"
        elif not math.isnan(self.nmse):
            head += f": nmse {self.nmse:.3g} (bound {self.bound:.3g})"
        if self.error:
            head += f": {self.error}"
        return head + (f" [seed {self.seed}]" if self.status is Status.FAIL and self.seed else "")


def format_rate(r: Result) -> str:
    return f"{r.rate / 1e12:.2f} TFLOP/s" if r.case.flops else f"{r.rate / 1e9:.2f} GB/s"


@attrs.frozen
class _Placed:
    """A case built and planned on the device under test."""

    graph: Graph
    feeds: dict[Tensor, np.ndarray]
    plan: Plan
    device: Device
    who: str  # plugin:kernel that runs the node under test
    why_not: str  # non-empty when the device (or the plugin under test) does not run it


def _step_of(plan: Plan) -> Step:
    """The step that computes the plan's first output (its kernel, fused group or view)."""
    target = plan.graph.outputs[0]
    return next(s for s in plan.steps if s.kind != "copy" and any(n is target for n in s.nodes))


def _place(case: Case, device: str | Device | None, mgr: PluginManager, prefer: Sequence[str],
           exclude: Iterable[str], fusion: bool | None, plugin: str | None, rng: np.random.Generator) -> _Placed:
    outputs, feeds = case.build(rng)
    graph = Graph.build(outputs)
    dev = mgr.device(device)
    order = (plugin, *(p for p in prefer if p != plugin)) if plugin else tuple(prefer)
    plan = compile(graph, dev, prefer=order, exclude=exclude, fusion=fusion, plugins=mgr)
    step = _step_of(plan)
    who = {"view": "view", "fused": f"{step.plugin}[fused {step.kernel}]"}.get(step.kind, f"{step.plugin}:{step.kernel}")
    declined = "; ".join(f"{p}: {r}" for p, r in step.declined if r)
    why_not = ""
    if step.device.name != dev.name:
        why_not = f"runs on {step.device.name}" + (f" ({declined or step.note})" if declined or step.note else "")
    elif plugin and step.kind != "view" and step.plugin != plugin:
        mine = dict(step.declined).get(plugin, "")
        why_not = f"{plugin} declined" + (f" ({mine})" if mine else "")
    return _Placed(graph, feeds, plan, dev, who, why_not)


def _failed(case: Case, device: str | Device | None, placed: _Placed | None, exc: Exception, seed: int = 0) -> Result:
    """A case that raised: a failure to report, naming the exception."""
    return Result(case, Status.FAIL, placed.device.name if placed else str(device), placed.who if placed else "",
                  error=f"{type(exc).__name__}: {exc}", seed=seed)


def _seeded(seed: int | None) -> tuple[int, np.random.Generator]:
    seed = secrets.randbits(32) if seed is None else seed
    return seed, np.random.default_rng(seed)


def run_case(case: Case, device: str | Device | None = None, plugins: PluginManager | None = None,
             prefer: Sequence[str] = (), exclude: Iterable[str] = (), fusion: bool | None = None,
             plugin: str | None = None, seed: int | None = None) -> Result:
    """Run `case` on `device` and on the CPU reference with the same fresh inputs; compare.

    `plugin` names the plugin under test: it is asked first, and a node it
    does not take is unsupported. `fusion` None: on unless OPDISPATCH_DISABLE_FUSION=1. `plugins` is the manager (default: every
    installed plugin); it must hold the "cpu" reference plugin. `seed`
    (reported on failure) reproduces the inputs.
    """
    mgr = plugins or manager()
    seed, rng = _seeded(seed)
    placed = None
    try:
        placed = _place(case, device, mgr, prefer, exclude, fusion, plugin, rng)
        if placed.why_not:
            return Result(case, Status.UNSUPPORTED, placed.device.name, placed.who, error=placed.why_not, seed=seed)
        # Same structure, new values: the second run's feeds, by input position.
        second = dict(zip(placed.feeds, case.build(rng)[1].values()))
        ref = compile(placed.graph, "cpu", prefer=(REFERENCE_PLUGIN,), fusion=False, plugins=mgr)
        refs = [ref.run(f) for f in (placed.feeds, second)]
        outs, captures = _device_runs(placed.plan, (placed.feeds, second, placed.feeds))
    except Exception as exc:  # noqa: BLE001 - a case that raises is a failure to report, not a crash
        return _failed(case, device, placed, exc, seed)
    worst, problems = _compare(case, placed.graph.outputs, refs, outs)
    problems += captures
    status = Status.PASS if worst <= case.bound and not problems else Status.FAIL
    if not worst <= case.bound:
        problems.insert(0, f"nmse {worst:.3g} > bound {case.bound:.3g}")
    return Result(case, status, placed.device.name, placed.who, worst, "; ".join(problems), seed)


def _device_runs(plan: Plan, feeds: Sequence[Mapping[Tensor, np.ndarray]]
                 ) -> tuple[list[list[np.ndarray]], list[str]]:
    """(the outputs of a run of `plan` on each of `feeds`, its arena poisoned first; the CUDA graph captures that
    failed meanwhile). Other warnings the runs raise are raised again."""
    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CaptureWarning)
        for f in feeds:
            plan.poison()  # NaN in every arena byte: an unwritten output fails the NMSE
            outs.append(plan.run(f))
    for w in caught:
        if not issubclass(w.category, CaptureWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return outs, [str(w.message) for w in caught if issubclass(w.category, CaptureWarning)]


def _values(t: Tensor, arr: np.ndarray, case: Case) -> np.ndarray:
    """An output as float64 values (block formats dequantized), in the case's comparable form."""
    v = np.asarray(to_host_float(t.dtype, arr) if t.dtype.is_quant else arr, np.float64)
    return case.canon(v) if case.canon else v


def _compare(case: Case, outputs: Sequence[Tensor], refs: list[list[np.ndarray]],
             outs: list[list[np.ndarray]]) -> tuple[float, list[str]]:
    """(worst NMSE over outputs and runs, problems found: values not written). Run j of `outs` ran on the
    inputs of `refs[j % 2]`."""
    worst = 0.0
    problems = []
    for i, t in enumerate(outputs):
        r1, r2 = (_values(t, run[i], case) for run in refs)
        got = [_values(t, run[i], case) for run in outs]
        o1, o2 = got[:2]
        poisoned = []
        for j, o in enumerate(got):
            r = (r1, r2)[j % 2]
            worst = max(worst, nmse(o, r))
            poisoned.append(int((np.isnan(o) & ~np.isnan(r)).sum()))
        if any(poisoned):  # the first run that left some
            j = next(j for j, p in enumerate(poisoned) if p)
            problems.append(f"output {i}: {poisoned[j]} of {o1.size} values not written (still poisoned NaN) "
                            f"in run {j + 1}")
        # Unwritten: equal to the previous run's value where the reference changed, and not
        # the right value. Slack of a few ulps of the value and one of the output's scale:
        # f16/bf16 rounding may meet by chance, and GPUs flush subnormal results to zero.
        finite = r2[np.isfinite(r2)]
        scale = float(np.sqrt(np.mean(finite * finite))) if finite.size else 0.0
        tol = _EPS.get(t.dtype.name, 0.0) * (2 * np.abs(r2) + scale)
        with np.errstate(invalid="ignore"):
            stale = (o1 == o2) & (r1 != r2) & ~(np.abs(o2 - r2) <= tol)
        if stale.any():
            problems.append(f"output {i}: {int(stale.sum())} of {stale.size} values not written "
                            "(they kept the previous run's)")
    return worst, problems


def support(case: Case, device: str | Device | None = None, plugins: PluginManager | None = None,
            prefer: Sequence[str] = (), exclude: Iterable[str] = (), fusion: bool | None = None,
            plugin: str | None = None) -> Result:
    """Plan `case` on `device` without running it: who takes its node (SUPPORTED), or why not."""
    mgr = plugins or manager()
    try:
        placed = _place(case, device, mgr, prefer, exclude, fusion, plugin, np.random.default_rng(0))
    except Exception as exc:  # noqa: BLE001
        return _failed(case, device, None, exc)
    status = Status.UNSUPPORTED if placed.why_not else Status.SUPPORTED
    return Result(case, status, placed.device.name, placed.who, error=placed.why_not)


def run_perf(case: Case, device: str | Device | None = None, plugins: PluginManager | None = None,
             prefer: Sequence[str] = (), exclude: Iterable[str] = (), fusion: bool | None = None,
             plugin: str | None = None, min_time: float = 1.0) -> Result:
    """Time `case` on `device`: launches repeated until `min_time` seconds have passed.

    Only the plan's launches are timed (no input writes, no output reads).
    Work is the case's FLOPs, else its bytes (default: its inputs plus its outputs).
    """
    mgr = plugins or manager()
    seed, rng = _seeded(None)
    placed = None
    try:
        placed = _place(case, device, mgr, prefer, exclude, fusion, plugin, rng)
        if placed.why_not:
            return Result(case, Status.UNSUPPORTED, placed.device.name, placed.who, error=placed.why_not)
        placed.plan.run(placed.feeds)  # binds, compiles kernels, captures graphs
        launch, wait = placed.plan.launch, placed.plan.synchronize
        runs, batch, start = 0, 1, time.perf_counter()
        while True:
            for _ in range(batch):
                launch()
            wait()
            runs += batch
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
            batch *= 2
    except Exception as exc:  # noqa: BLE001
        return _failed(case, device, placed, exc, seed)
    return Result(case, Status.PASS, placed.device.name, placed.who, seconds=elapsed / runs, runs=runs,
                  nbytes=case.nbytes or _io_bytes(placed.graph))


def _io_bytes(graph: Graph) -> int:
    """Bytes of the inputs read plus the outputs written; a buffer written in place counts once."""
    written = {t.base for t in graph.outputs}
    return sum(t.nbytes for t in graph.leafs if t not in written) + sum(t.nbytes for t in graph.outputs)


def copy_bandwidth(device: str | Device | None = None, plugins: PluginManager | None = None,
                   min_time: float = 1.0) -> float | None:
    """The device's measured copy bandwidth (bytes/s, read + write) with its own dup kernel: perf's ceiling.

    None when the device has no dup kernel.
    """
    probe = Case("dup", "f32 2^25", lambda inp: ops.dup(inp.uniform((1 << 25,))))
    r = run_perf(probe, device, plugins, min_time=min_time)
    return r.rate if r.status is Status.PASS else None
