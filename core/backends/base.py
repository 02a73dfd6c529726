"""Buffer, BindContext, Backend: where tensors live and how launches run on a device.

The records a backend plugin yields (`Device`, `Launch`) are the contract's
(hookspecs.py); these are the backend's side: what a kernel's bind sees and
what dispatch allocates, transfers and runs through. `StagedTransfers`,
`ReportsFreeMemory` and `CopiesBetween` are optional capabilities, declared so that binding checks
them by isinstance. `host_free_memory` is what the host can still give.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from ..errors import LaunchError
from ..errorword import IndexTable
from ..hookspecs import Device, Launch
from ..tensor import Tensor


def run_launches(device: str, launches: list[tuple[str, Launch]]) -> None:
    """Call every launch in order; a failure is re-raised as LaunchError naming it."""
    i = 0
    try:
        for i, (_, launch) in enumerate(launches):
            launch()
    except Exception as exc:
        raise LaunchError(f"{device}: {launches[i][0]} failed: {type(exc).__name__}: {exc}") from exc


class Buffer(Protocol):
    """A block of device memory."""

    nbytes: int


class BindContext(Protocol):
    """What a kernel's `bind` sees: where each tensor of the plan lives on the device.

    Device backends add what their launches need (the CUDA context: `stream`).
    """

    device: Device
    backend: Backend

    def array(self, t: Tensor) -> Any:
        """`t` as an array of the backend (numpy view on host devices, a CuPy view on CUDA)."""

    def ptr(self, t: Tensor) -> int:
        """`t`'s first byte as an address (device backends)."""


class Backend(Protocol):
    """Allocation, transfers and execution on one device."""

    device: Device

    def alloc(self, nbytes: int, what: str) -> Buffer:
        """Device memory of `nbytes`; `what` names the use for error messages."""

    def write(self, buf: Buffer, offset: int, data: np.ndarray) -> None:
        """Copy host bytes (a uint8 array) into `buf` at `offset`."""

    def read(self, buf: Buffer, offset: int, nbytes: int) -> np.ndarray:
        """Copy `nbytes` from `buf` at `offset` to a new host uint8 array."""

    def fill(self, buf: Buffer, byte: int) -> None:
        """Set every byte of `buf` (tests poison outputs with it)."""

    def bind_context(self, where: Callable[[Tensor], tuple[Buffer, int]], checks: IndexTable,
                     shared: dict[Any, Any]) -> BindContext:
        """A context that resolves tensors to (buffer, byte offset) through `where`; device kernels that
        read indices register them in `checks`, the plan's table (opdispatch.errorword). `shared` is what the
        plan's binds on this device share, in the order the plan runs them: a bind may leave there what a later
        one reuses (the scratch role an earlier launch of the same run filled, for one)."""

    def executor(self, launches: list[tuple[str, Launch]]) -> Callable[[], None]:
        """Something that runs the launches in order (CUDA: captured and replayed).

        Each launch comes with a description of what it runs ("rms_norm 'x'
        (4, 64) f32 by cuda_norm") for the LaunchError raised when it fails.
        """

    def synchronize(self) -> None: ...


@runtime_checkable
class StagedTransfers(Protocol):
    """The optional transfers of a backend that stages them: with all five, Plan.run
    uploads a plan's inputs in one copy and waits once per run (bind.Feeder); a
    backend without them gets write/read, one synchronous transfer each."""

    def staging(self, nbytes: int) -> np.ndarray:
        """A host uint8 buffer that upload/download may use asynchronously (CUDA: pinned)."""

    def sub(self, buf: Buffer, offset: int, nbytes: int, what: str) -> Buffer:
        """Bytes offset..offset+nbytes of `buf` as a buffer of their own (sharing its memory)."""

    def upload(self, buf: Buffer, offset: int, host: np.ndarray, host_offset: int, nbytes: int) -> None:
        """Queue a copy host -> buf, ordered before launches queued after it; `host` stays
        unchanged until the next synchronize."""

    def download(self, host: np.ndarray, host_offset: int, buf: Buffer, offset: int, nbytes: int) -> None:
        """Queue a copy buf -> host, ordered after launches queued before it; the bytes are
        there once synchronize returns."""

    def mark(self) -> Callable[[], None]:
        """A point in the work queued so far: the returned function waits (on the host) until
        the device has reached it (Plan.submit: the device has taken an upload)."""


@runtime_checkable
class CopiesBetween(Protocol):
    """The optional device-to-device copy of a backend: a plan split over devices copies values between them
    each run (core/sched.py); without it (or when it answers None) a copy goes through the host, read then
    written, waiting for both devices."""

    def copy_from(self, dst: Buffer, dst_offset: int, src_backend: Backend, src: Buffer, src_offset: int,
                  nbytes: int) -> Callable[[], None] | None:
        """A pre-bound copy of `nbytes` from `src` (a buffer of `src_backend`) into `dst` (ours), or None if
        this backend cannot copy from `src_backend` (another kind of device). Called at bind time; each call
        of the result queues the copy after the work queued so far on both devices, and before the work
        queued on either after it (a later launch on the source may overwrite `src`)."""


class StagingBackend(Backend, StagedTransfers, Protocol):
    """A backend with staged transfers: what a bind.Feeder drives."""


@runtime_checkable
class ReportsFreeMemory(Protocol):
    """The optional memory report of a backend: binding checks a plan's allocations against it before it
    makes any, so that a plan too large raises OutOfMemory instead of failing halfway (or, for host memory
    the kernel overcommits, getting the process killed when the pages are touched)."""

    def free_memory(self) -> tuple[str, int | None]:
        """(the memory `alloc` draws from: "host" for host RAM, else the device's name; the bytes free there,
        None if unknown)."""


def bytes_text(n: int) -> str:
    """'N bytes (x.xx GiB)': memory errors give both, the exact count and one a reader takes in."""
    return f"{n} bytes ({n / 2**30:.2f} GiB)"


#: a cgroup memory limit at or above this is "no limit" (cgroup v1 writes one near 2**63)
_NO_LIMIT = 1 << 60


def host_free_memory() -> int | None:
    """Bytes of RAM the host can still give this process, or None if unknown.

    /proc/meminfo's MemAvailable, lowered to the headroom under the memory limit of the process's cgroup
    (a container's limit: past it the kernel kills the process, whatever the host has free); reclaimable
    page cache (inactive_file) counts as free there. Without /proc, the free pages of os.sysconf.
    """
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    for limit, usage, stat in (("memory.max", "memory.current", "memory.stat"),  # cgroup v2
                               ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat")):
        headroom = _cgroup_headroom(Path("/sys/fs/cgroup"), limit, usage, stat)
        if headroom is not None:
            free = min(free, headroom)
    return free


def _cgroup_headroom(root: Path, limit: str, usage: str, stat: str) -> int | None:
    try:
        text = (root / limit).read_text().strip()
        if text == "max" or int(text) >= _NO_LIMIT:
            return None
        used = int((root / usage).read_text())
        for line in (root / stat).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):
                used -= int(value)
                break
        return max(int(text) - used, 0)
    except (OSError, ValueError):
        return None
