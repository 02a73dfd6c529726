"""Buffer, BindContext, Backend: where tensors live and how launches run on a device.

The records a backend plugin yields (`Device`, `Launch`) are the contract's
(hookspecs.py); these are the backend's side: what a kernel's bind sees and
what dispatch allocates, transfers and runs through. `StagedTransfers` is an
optional capability, declared so that binding checks it by isinstance.
"""

from __future__ import annotations

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

    def bind_context(self, where: Callable[[Tensor], tuple[Buffer, int]], checks: IndexTable) -> BindContext:
        """A context that resolves tensors to (buffer, byte offset) through `where`; device kernels that
        read indices register them in `checks`, the plan's table (opdispatch.errorword)."""

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


class StagingBackend(Backend, StagedTransfers, Protocol):
    """A backend with staged transfers: what a bind.Feeder drives."""
