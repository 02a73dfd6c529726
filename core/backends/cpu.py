"""The host backend: numpy buffers; launches run in order on the calling thread.

Used by the CPU device and by any plugin device that computes in host memory.
An allocation larger than the host can give raises OutOfMemory before numpy
is asked: Linux overcommits, so np.zeros of too much succeeds and the process
is killed later, when the pages are written.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import attrs
import numpy as np

from ..errors import OutOfMemory
from ..errorword import IndexTable
from ..hookspecs import Device, Launch
from ..tensor import Tensor
from .base import Backend, bytes_text, host_free_memory, run_launches


@attrs.define(eq=False)
class HostBuffer:
    data: np.ndarray  # uint8
    what: str = ""

    @property
    def nbytes(self) -> int:
        return int(self.data.size)


@attrs.define(eq=False)
class HostContext:
    device: Device
    backend: HostBackend
    where: Callable[[Tensor], tuple[HostBuffer, int]]

    def array(self, t: Tensor) -> np.ndarray:
        buf, offset = self.where(t)
        return t.host_view(buf.data, offset)

    def ptr(self, t: Tensor) -> int:
        buf, offset = self.where(t)
        return int(buf.data.ctypes.data) + offset


@attrs.define(eq=False)
class HostBackend:
    device: Device

    def alloc(self, nbytes: int, what: str) -> HostBuffer:
        """Zeroed host memory; OutOfMemory naming `what`, the bytes asked and free, when the host lacks it."""
        free = host_free_memory()
        if free is not None and nbytes > free:
            raise OutOfMemory(_no_room(self.device.name, nbytes, what, free))
        try:
            return HostBuffer(np.zeros(max(int(nbytes), 1), np.uint8), what)
        except (MemoryError, ValueError) as exc:  # ValueError: beyond what numpy can index
            raise OutOfMemory(_no_room(self.device.name, nbytes, what, host_free_memory())) from exc

    def free_memory(self) -> tuple[str, int | None]:
        return "host", host_free_memory()

    def write(self, buf: HostBuffer, offset: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        buf.data[offset:offset + raw.size] = raw

    def read(self, buf: HostBuffer, offset: int, nbytes: int) -> np.ndarray:
        return buf.data[offset:offset + nbytes].copy()

    # Staged transfers (Plan.run's feeder): on the host they are plain copies, done at once.
    def staging(self, nbytes: int) -> np.ndarray:
        return self.alloc(nbytes, "staging").data

    def sub(self, buf: HostBuffer, offset: int, nbytes: int, what: str) -> HostBuffer:
        return HostBuffer(buf.data[offset:offset + nbytes], what)

    def upload(self, buf: HostBuffer, offset: int, host: np.ndarray, host_offset: int, nbytes: int) -> None:
        buf.data[offset:offset + nbytes] = host[host_offset:host_offset + nbytes]

    def download(self, host: np.ndarray, host_offset: int, buf: HostBuffer, offset: int, nbytes: int) -> None:
        host[host_offset:host_offset + nbytes] = buf.data[offset:offset + nbytes]

    def mark(self) -> Callable[[], None]:
        return lambda: None  # every transfer is done when queued

    def copy_from(self, dst: HostBuffer, dst_offset: int, src_backend: Backend, src: HostBuffer, src_offset: int,
                  nbytes: int) -> Callable[[], None] | None:
        """A numpy copy between two host devices' buffers (CopiesBetween); None from any other backend."""
        if not isinstance(src_backend, HostBackend):
            return None
        to, of = dst.data[dst_offset:dst_offset + nbytes], src.data[src_offset:src_offset + nbytes]
        if to.size != nbytes or of.size != nbytes:
            raise ValueError(f"{self.device.name}: copy of {nbytes} bytes from {src.what} at {src_offset} into "
                             f"{dst.what} at {dst_offset}: outside a buffer")
        return functools.partial(np.copyto, to, of)

    def fill(self, buf: HostBuffer, byte: int) -> None:
        buf.data.fill(byte)

    def bind_context(self, where: Callable[[Tensor], tuple[HostBuffer, int]], checks: IndexTable,
                     shared: dict[Any, Any]) -> HostContext:
        return HostContext(self.device, self, where)  # the reference kernels check indices themselves

    def executor(self, launches: list[tuple[str, Launch]]) -> Callable[[], None]:
        launches = list(launches)
        return lambda: run_launches(self.device.name, launches)

    def synchronize(self) -> None:
        pass


def _no_room(device: str, nbytes: int, what: str, free: int | None) -> str:
    have = f"{bytes_text(free)} of host memory free" if free is not None else "the free host memory is unknown"
    return f"{device}: cannot allocate {bytes_text(nbytes)} for {what}: {have}"
