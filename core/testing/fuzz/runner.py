"""The fuzz runner: cases go to a worker process over a pipe, so that no case can take the caller down.

One long-lived worker runs case after case (starting Python and the plugins once, not per case).
A worker that dies is a crash of the case it was running, one that does not answer within the
timeout is a hang (it is killed); either way the next case gets a fresh worker. On the CPU the
worker's address space is limited, so a case that allocates terabytes gets a MemoryError instead
of the machine's memory.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, Callable, Iterable, Iterator

import attrs

from .case import FAILING, FuzzCase, Outcome
from .draw import case_seeds
from .worker import load

DEFAULT_SOURCE = "opdispatch.testing.fuzz.draw:draw"
#: seconds per case; a GPU's first run of a kernel compiles it (NVRTC)
CPU_TIMEOUT, GPU_TIMEOUT = 20.0, 120.0
CPU_MEMORY_LIMIT = 4 << 30
#: seconds a worker may take to start (import, find the device, build the base cases)
STARTUP = 300.0


@attrs.frozen
class Result:
    case: FuzzCase
    outcome: Outcome
    detail: str = ""
    #: a valid case refused with a named error
    refused: bool = False
    #: the innermost line of opdispatch an error came through
    origin: str = ""

    def describe(self) -> str:
        at = f" (at {self.origin})" if self.origin else ""
        return f"{self.outcome.value.upper()} seed={self.case.seed} {self.case.description}: {self.detail}{at}"


def _exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        return f"killed by {signal.Signals(-rc).name}"
    return f"exit status {rc}"


@attrs.define
class _Worker:
    proc: subprocess.Popen
    log: IO[bytes]
    buf: bytes = b""

    def line(self, timeout: float) -> bytes | None:
        """The next line the worker writes; None after `timeout` seconds; EOFError when it is gone."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def tail(self, since: int) -> str:
        """What the worker wrote to stderr after byte `since`: the innermost frames of the last stack it
        dumped (faulthandler's, after a fatal signal or on SIGUSR1), else its last lines."""
        self.log.seek(since)
        lines = [line.strip() for line in self.log.read().decode(errors="replace").splitlines() if line.strip()]
        heads = [i for i, line in enumerate(lines) if line.endswith("(most recent call first):")]
        if heads:
            i = heads[-1]
            fatal = [line for line in lines[:i] if line.startswith("Fatal Python error")]
            frames = [line for line in lines[i + 1:] if line.startswith("File ")][:3]
            lines = fatal[-1:] + frames
        return " | ".join(lines[-6:])[-1500:]

    def size(self) -> int:
        return os.fstat(self.log.fileno()).st_size

    def stop(self, kill: bool = False) -> int | None:
        if kill and self.proc.poll() is None:
            self.proc.kill()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            rc = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        return rc


@attrs.define
class Runner:
    """Runs fuzz cases of `source` (a function of a seed, 'module:function') on `device`, one worker at a time."""

    device: str = "cpu"
    source: str = DEFAULT_SOURCE
    timeout: float = attrs.field(default=attrs.Factory(
        lambda self: CPU_TIMEOUT if self.device == "cpu" else GPU_TIMEOUT, takes_self=True))
    #: the worker's address-space limit in bytes (None: none; CUDA maps more than it allocates)
    memory_limit: int | None = attrs.field(default=attrs.Factory(
        lambda self: CPU_MEMORY_LIMIT if self.device == "cpu" else None, takes_self=True))
    _worker: _Worker | None = attrs.field(init=False, default=None)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop(kill=True)
            self._worker = None

    def _start(self) -> _Worker:
        env = dict(os.environ)
        # The worker imports what this process can (a test module as a case source, too).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, "1")  # one case at a time: threads only contend
        cmd = [sys.executable, "-m", "opdispatch.testing.fuzz.worker", "--device", self.device,
               "--source", self.source, "--memory-limit", str(self.memory_limit or 0)]
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        w = _Worker(proc, log)
        try:
            line = w.line(STARTUP)
        except EOFError:
            line = None
        if line is None:
            tail = w.tail(0)
            w.stop(kill=True)
            raise RuntimeError(f"the fuzz worker on {self.device} did not start: {tail}")
        answer = json.loads(line)
        if "error" in answer:
            w.stop(kill=True)
            raise RuntimeError(f"the fuzz worker cannot run cases on {self.device}: {answer['error']}")
        return w

    def run(self, seeds: Iterable[int]) -> Iterator[Result]:
        """The result of each case, in order."""
        draw = load(self.source)
        for seed in seeds:
            case = draw(seed)
            if self._worker is None:
                self._worker = self._start()
            yield self._one(case)

    def _one(self, case: FuzzCase) -> Result:
        w = self._worker
        mark = w.size()
        try:
            w.proc.stdin.write(f'{{"seed": {case.seed}}}\n'.encode())
            w.proc.stdin.flush()
            line = w.line(self.timeout)
        except (EOFError, OSError):
            tail = w.tail(mark)
            self._worker = None
            return Result(case, Outcome.CRASH, f"the worker died ({_exit(w.stop())}): {tail}")
        if line is None:
            w.proc.send_signal(signal.SIGUSR1)  # the worker dumps its stack: where the case hangs
            time.sleep(0.5)
            tail = w.tail(mark)
            self._worker = None
            w.stop(kill=True)
            return Result(case, Outcome.HANG, f"no answer within {self.timeout:g} s (killed): {tail}")
        answer = json.loads(line)
        if not answer["usable"]:
            self._worker = None
            w.stop()
            answer["detail"] += " [the device failed a small graph after this case: worker restarted]"
        return Result(case, Outcome(answer["outcome"]), answer["detail"], answer["refused"], answer["origin"])


@attrs.frozen
class Report:
    device: str
    results: tuple[Result, ...]
    seed: int | None = None
    seconds: float = 0.0

    def count(self, outcome: Outcome) -> int:
        return sum(r.outcome is outcome for r in self.results)

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if r.outcome in FAILING]

    @property
    def refused(self) -> list[Result]:
        return [r for r in self.results if r.refused]

    def summary(self) -> str:
        seed = f" (seed {self.seed})" if self.seed is not None else ""
        counts = []
        for o in Outcome:
            counts.append(f"{o.value} {self.count(o)}" + (f" (valid but refused {len(self.refused)})"
                                                          if o is Outcome.NAMED else ""))
        return f"fuzz on {self.device}: {len(self.results)} cases{seed} in {self.seconds:.1f} s: " + ", ".join(counts)

    def table(self) -> str:
        """Outcome counts per kind of case."""
        kinds = sorted({r.case.kind for r in self.results})
        head = f"{'kind':14s}" + "".join(f"{o.value:>9s}" for o in Outcome)
        rows = [head]
        for k in kinds:
            mine = [r for r in self.results if r.case.kind == k]
            rows.append(f"{k:14s}" + "".join(f"{sum(r.outcome is o for r in mine):9d}" for o in Outcome))
        return "\n".join(rows)

    def format(self) -> str:
        lines = [self.summary(), self.table()]
        lines += [r.describe() for r in self.failures]
        lines += [f"valid but refused: {r.describe()}" for r in self.refused]
        return "\n".join(lines)


def run_fuzz(device: str = "cpu", cases: int = 1000, seed: int | None = None, seeds: Iterable[int] | None = None,
             progress: Callable[[int], None] | None = None, **runner: Any) -> Report:
    """Run `cases` cases drawn from `seed` (or the case seeds `seeds`) on `device`; `runner` sets Runner's fields."""
    todo = list(seeds) if seeds is not None else case_seeds(seed if seed is not None else 0, cases)
    start = time.monotonic()
    results = []
    with Runner(device, **runner) as r:
        for i, result in enumerate(r.run(todo), 1):
            results.append(result)
            if progress:
                progress(i)
    return Report(device, tuple(results), seed if seeds is None else None, time.monotonic() - start)
