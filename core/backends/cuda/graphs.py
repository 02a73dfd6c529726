"""Running a segment of launches: directly, or captured once into a CUDA graph and replayed.

docs/design.md gives ~9 us to launch a kernel from Python and ~0.9 us per
kernel replayed from a CUDA graph, so a segment is captured and replayed.
The rule is ggml's: every run comes with a signature describing all its
launches (kernels, grids, addresses, shapes, params); a changed signature
re-captures, and after 4 consecutive re-captures capture is dropped for
good (the segment changes too often for a graph to pay) and the launches
run directly. OPDISPATCH_DISABLE_CUDA_GRAPHS=1 turns capture off.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Any, Callable, Hashable, Sequence

import attrs

from ...hookspecs import Launch
from ...errors import CaptureWarning, LaunchError
from ..base import run_launches

#: Consecutive re-captures after which capture is turned off (ggml's number).
MAX_CONSECUTIVE_RECAPTURES = 4

#: capture(issue) runs `issue` (which issues every launch) under capture and
#: returns the replay of what it captured.
Capture = Callable[[Callable[[], None]], Callable[[], None]]


def graphs_enabled() -> bool:
    return os.environ.get("OPDISPATCH_DISABLE_CUDA_GRAPHS", "") in ("", "0")


def stream_capture(stream: Any) -> Capture:
    """Capture on a CuPy stream (cudaStreamBeginCapture, relaxed mode): the replay is a graph launch on it."""

    def capture(issue: Callable[[], None]) -> Callable[[], None]:
        stream.begin_capture()
        try:
            issue()
        except BaseException:
            with contextlib.suppress(Exception):  # leave capture mode; the first error is the one to report
                stream.end_capture()
            raise
        graph = stream.end_capture()
        return functools.partial(graph.launch, stream)

    return capture


@attrs.define(eq=False)
class GraphRunner:
    """Runs `launches` in order: the first run directly (a warm-up: lazy
    initialisation stays out of the capture, and a failing launch is named),
    later runs as a replay of a graph captured for the run's signature.

    `capture` None launches directly every time. A capture that fails turns
    capture off for this runner, with a warning, and the run goes direct.
    """

    name: str
    launches: Sequence[tuple[str, Launch]]
    capture: Capture | None = None
    device: str = ""
    #: the signature of the last run, and the replay captured for it
    signature: Hashable = attrs.field(default=None, init=False)
    replay: Callable[[], None] | None = attrs.field(default=None, init=False)
    runs: int = attrs.field(default=0, init=False)
    captures: int = attrs.field(default=0, init=False)
    #: consecutive runs that re-captured because the signature changed
    recaptures: int = attrs.field(default=0, init=False)
    #: why capture is off for good ("" while it is on)
    disabled: str = attrs.field(default="", init=False)

    def replay_same(self, signature: Hashable) -> bool:
        """The hot path of a replayed step: if a graph was captured for this very signature object (a
        Segment passes the same tuple every run), replay it and say True; else False (call the runner)."""
        if self.replay is None or signature is not self.signature or self.disabled:
            return False
        self.recaptures = 0
        self._replay()
        self.runs += 1
        return True

    def __call__(self, signature: Hashable) -> None:
        if self.capture is None or self.disabled or self.runs == 0:
            self.launch_all()
        elif self.replay is not None and (signature is self.signature or signature == self.signature):
            self.recaptures = 0
            self._replay()
        else:
            if self.replay is not None:
                self.recaptures += 1
            self._capture_and_replay()
            if not self.disabled and self.recaptures >= MAX_CONSECUTIVE_RECAPTURES:
                self.disabled = f"the signature changed on {self.recaptures} consecutive runs"
                self.replay = None
        self.signature = signature
        self.runs += 1

    def launch_all(self) -> None:
        """Every launch, in order, now; a failure names the launch."""
        run_launches(self.device, self.launches)

    def _capture_and_replay(self) -> None:
        try:
            replay = self.capture(self.launch_all)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - not capturable: run it directly from now on
            self.disabled = f"capture failed: {type(exc).__name__}: {exc}"
            self.replay = None
            warnings.warn(f"opdispatch: {self.device}: CUDA graph capture of {self.name} failed, launching "
                          f"directly from now on: {type(exc).__name__}: {exc}", CaptureWarning, stacklevel=4)
            self.launch_all()
            return
        self.captures += 1
        self.replay = replay
        self._replay()

    def _replay(self) -> None:
        try:
            self.replay()  # type: ignore[misc]
        except Exception as exc:
            raise LaunchError(f"{self.device}: CUDA graph replay of {self.name} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
