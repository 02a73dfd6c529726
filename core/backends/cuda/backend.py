"""The CUDA backend (CuPy): device buffers, one non-blocking stream per GPU,
host<->device transfers ordered on it, and plan segments run by GraphRunner.

One backend per GPU (`backend_for`): every plan on a GPU shares its stream,
so their work is ordered, and the caches that hang off it (NVRTC modules,
later the cuBLAS handle). Transfers are synchronous for the caller: `write`
returns once the bytes are on the device, `read` sees all work queued before
it. Kernel failures are asynchronous; `synchronize` (and `read`) name the
segments that ran since the last wait. `upload` / `download` (with pinned
`staging` memory) are the asynchronous transfers Plan.run uses instead: see
the comment above them. `copy_from` copies between two GPUs (a plan split
over them): peer to peer where the GPUs allow it, else through pinned host
memory, ordered on both streams by events, the host never waiting. Kernels that read indices from data record the first
bad one in their plan's `error_word` (host-mapped memory: opdispatch.errorword).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Hashable

import attrs
import numpy as np

from ...errors import LaunchError, OutOfMemory
from ...errorword import ErrorWord, IndexTable, IndexUse
from ...hookspecs import Device, Launch
from ...tensor import Tensor
from ..base import bytes_text, host_free_memory
from .args import UNCHECKED, IndexCheck
from .graphs import GraphRunner, graphs_enabled, stream_capture
from .kernels import EMPTY
from .scratch import ScratchPool

_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled

_backends: dict[int, CudaBackend] = {}


def backend_for(device: Device) -> CudaBackend:
    """The one backend of `device` (its `backend_factory`)."""
    index = int(device.props["index"])
    backend = _backends.get(index)
    if backend is None:
        backend = _backends[index] = CudaBackend(device)
    return backend


@attrs.define(eq=False)
class CudaBuffer:
    """Device memory: a CuPy MemoryPointer, held as long as the buffer lives."""

    mem: Any
    nbytes: int
    what: str = ""

    @property
    def ptr(self) -> int:
        return int(self.mem.ptr)


@attrs.define(eq=False)
class CudaContext:
    """What a kernel's bind sees on a GPU: addresses, CuPy views, the stream to launch on, the
    plan's table of index checks, and what the plan's binds on this GPU share (`shared`: a bind may leave
    there what a later bind of the plan reuses, such as the scratch role its launch fills each run)."""

    device: Device
    backend: CudaBackend
    where: Callable[[Tensor], tuple[CudaBuffer, int]]
    checks: IndexTable
    shared: dict[Any, Any] = attrs.field(factory=dict)

    @property
    def stream(self) -> Any:
        return self.backend.stream

    def index_check(self, node: Tensor, index: Tensor, bound: int, what: str, instead: str) -> IndexCheck:
        """The IndexCheck of a launch of `node` whose kernel reads `index`'s values as indices into
        [0, bound) (args.Guard): the plan's error word on this GPU and the tag of this use, registered
        in the plan's table; UNCHECKED where OPDISPATCH_CHECK_INDICES=0."""
        if not self.checks.enabled:
            return UNCHECKED
        word = self.checks.word(self.device.name, self.backend.error_word)
        return IndexCheck(word.device_ptr, self.checks.register(IndexUse(node, index, bound, what, instead)))

    def ptr(self, t: Tensor) -> int:
        buf, offset = self.where(t)
        return buf.ptr + offset

    def array(self, t: Tensor) -> Any:
        import cupy

        buf, offset = self.where(t)
        shape, strides, dtype = t.array_layout()
        return cupy.ndarray(shape, dtype, buf.mem + offset, strides)


@attrs.define(eq=False)
class Segment:
    """A run of consecutive launches of a plan on one GPU, as `Plan` calls it."""

    backend: CudaBackend
    runner: GraphRunner
    signature: tuple[Hashable, ...]

    def __call__(self) -> None:
        be = self.backend
        with be.cuda_device:
            # A replay launches the graph on our stream explicitly; direct launches and captures may make
            # foreign launches (CuPy calls), which must go to our stream too.
            if not self.runner.replay_same(self.signature):
                with be.stream:
                    self.runner(self.signature)
        be.pending[self.runner.name] = None


@attrs.define(eq=False)
class CudaBackend:
    """Allocation, transfers and execution on one GPU (see the module docstring)."""

    device: Device
    index: int = attrs.field(init=False)
    cuda_device: Any = attrs.field(init=False)  # cupy.cuda.Device
    stream: Any = attrs.field(init=False)  # cupy.cuda.Stream, non-blocking
    #: names of the segments run since the last synchronize (an ordered set)
    pending: dict[str, None] = attrs.field(init=False, factory=dict)
    #: scratch buffers shared by every launch on this GPU, by role
    scratch: ScratchPool = attrs.field(init=False)
    #: GPUs (by index) whose memory this one reads directly: peer access enabled, or found impossible (False)
    peers: dict[int, bool] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        import cupy

        self.index = int(self.device.props["index"])
        self.cuda_device = cupy.cuda.Device(self.index)
        with self.cuda_device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.scratch = ScratchPool(self.alloc, self.fill)

    # -- memory --------------------------------------------------------------------
    def alloc(self, nbytes: int, what: str) -> CudaBuffer:
        """Device memory from CuPy's pool, tied to our stream; out of memory raises OutOfMemory
        naming `what`, the bytes asked and free, and leaves the backend usable."""
        import cupy
        from cupy.cuda import runtime

        n = max(int(nbytes), 1)
        with self.cuda_device, self.stream:
            try:
                mem = cupy.cuda.alloc(n)
            except (MemoryError, OverflowError, runtime.CUDARuntimeError) as exc:
                if isinstance(exc, runtime.CUDARuntimeError) and getattr(exc, "status", None) != \
                        _CUDA_ERROR_MEMORY_ALLOCATION:
                    raise
                free, total = runtime.memGetInfo()
                raise OutOfMemory(
                    f"{self.device.name}: cannot allocate {bytes_text(nbytes)} for {what}: {bytes_text(free)} "
                    f"free of {bytes_text(total)}"
                ) from exc
        return CudaBuffer(mem, n, what)

    def free_memory(self) -> tuple[str, int | None]:
        """The GPU's free bytes, with those CuPy's pool holds free for reuse."""
        import cupy
        from cupy.cuda import runtime

        with self.cuda_device:
            return self.device.name, int(runtime.memGetInfo()[0]) + int(cupy.get_default_memory_pool().free_bytes())

    def write(self, buf: CudaBuffer, offset: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        _check_range(buf, offset, raw.size, "write")
        if raw.size:
            with self.cuda_device:
                (buf.mem + offset).copy_from_host_async(ctypes.c_void_p(raw.ctypes.data), raw.size, self.stream)
            self.synchronize()

    def read(self, buf: CudaBuffer, offset: int, nbytes: int) -> np.ndarray:
        _check_range(buf, offset, nbytes, "read")
        out = np.empty(nbytes, np.uint8)
        if nbytes:
            with self.cuda_device:
                (buf.mem + offset).copy_to_host_async(ctypes.c_void_p(out.ctypes.data), nbytes, self.stream)
            self.synchronize()
        return out

    # -- staged transfers (StagedTransfers: Plan.run's bind.Feeder) ---------------------
    # A decode step's host work must stay far below a millisecond: one H2D copy of all inputs
    # from pinned memory, the graph replay and the D2H copies of the outputs are all queued on
    # our one stream (so they run in that order on the GPU), and the caller waits once. Pinned
    # host memory makes the copies truly asynchronous (from pageable memory CUDA stages them
    # through a driver buffer and blocks); the caller keeps `host` unchanged until it synchronizes.
    def staging(self, nbytes: int) -> np.ndarray:
        """Pinned (page-locked) host memory as a uint8 array, from CuPy's pinned pool; OutOfMemory when the
        host cannot give it (page-locking too much starves, or kills, the process)."""
        import cupyx
        from cupy.cuda import runtime

        free = host_free_memory()
        if free is not None and nbytes > free:
            raise OutOfMemory(f"{self.device.name}: cannot allocate {bytes_text(nbytes)} of pinned staging "
                              f"memory: {bytes_text(free)} of host memory free")
        with self.cuda_device:
            try:
                return cupyx.empty_pinned((max(int(nbytes), 1),), np.uint8)
            except (MemoryError, runtime.CUDARuntimeError) as exc:
                if isinstance(exc, runtime.CUDARuntimeError) and getattr(exc, "status", None) != \
                        _CUDA_ERROR_MEMORY_ALLOCATION:
                    raise
                raise OutOfMemory(f"{self.device.name}: cannot allocate {bytes_text(nbytes)} of pinned staging "
                                  f"memory: {type(exc).__name__}: {exc}") from exc

    def sub(self, buf: CudaBuffer, offset: int, nbytes: int, what: str) -> CudaBuffer:
        """A sub-range of `buf` (its MemoryPointer keeps the whole allocation alive)."""
        _check_range(buf, offset, nbytes, "sub-buffer of")
        return CudaBuffer(buf.mem + offset, int(nbytes), what)

    def upload(self, buf: CudaBuffer, offset: int, host: np.ndarray, host_offset: int, nbytes: int) -> None:
        """Queue host -> device on the stream; not waited for."""
        _check_range(buf, offset, nbytes, "upload into")
        if not 0 <= host_offset <= host_offset + nbytes <= host.nbytes:
            raise ValueError(f"upload {nbytes} bytes from offset {host_offset}: outside the {host.nbytes}-byte host buffer")
        if nbytes:
            with self.cuda_device:
                (buf.mem + offset).copy_from_host_async(ctypes.c_void_p(host.ctypes.data + host_offset), nbytes,
                                                        self.stream)

    def download(self, host: np.ndarray, host_offset: int, buf: CudaBuffer, offset: int, nbytes: int) -> None:
        """Queue device -> host on the stream; the bytes are there once `synchronize` returns."""
        _check_range(buf, offset, nbytes, "download from")
        if not 0 <= host_offset <= host_offset + nbytes <= host.nbytes:
            raise ValueError(f"download {nbytes} bytes to offset {host_offset}: outside the {host.nbytes}-byte host "
                             "buffer")
        if nbytes:
            with self.cuda_device:
                (buf.mem + offset).copy_to_host_async(ctypes.c_void_p(host.ctypes.data + host_offset), nbytes,
                                                      self.stream)

    def error_word(self) -> ErrorWord:
        """A new error word (opdispatch.errorword): 4 u64 of pinned, host-mapped memory, zeroed, that
        kernels on this GPU write and the host reads without a copy."""
        import cupy
        from cupy.cuda import runtime

        with self.cuda_device:
            mem = cupy.cuda.PinnedMemory(32, runtime.hostAllocMapped | runtime.hostAllocPortable)
            device_ptr = int(runtime.pointerGetAttributes(mem.ptr).devicePointer)
        host = np.frombuffer((ctypes.c_uint64 * 4).from_address(int(mem.ptr)), np.uint64)
        host[:] = 0
        return ErrorWord(host, device_ptr, mem)

    def mark(self) -> Callable[[], None]:
        """An event recorded on the stream now; the returned function waits for it."""
        import cupy

        with self.cuda_device:
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record(self.stream)
        return event.synchronize

    def fill(self, buf: CudaBuffer, byte: int) -> None:
        with self.cuda_device:
            buf.mem.memset_async(int(byte), buf.nbytes, self.stream)
        self.synchronize()

    def copy(self, dst: CudaBuffer, dst_offset: int, src: CudaBuffer, src_offset: int, nbytes: int) -> None:
        """Device-to-device copy, queued on the stream (ordered with the launches, not waited for)."""
        _check_range(dst, dst_offset, nbytes, "copy into")
        _check_range(src, src_offset, nbytes, "copy from")
        if nbytes:
            with self.cuda_device:
                (dst.mem + dst_offset).copy_from_device_async(src.mem + src_offset, nbytes, self.stream)

    def copy_from(self, dst: CudaBuffer, dst_offset: int, src_backend: Any, src: CudaBuffer, src_offset: int,
                  nbytes: int) -> Callable[[], None] | None:
        """A copy from another GPU's buffer into ours (CopiesBetween), None from a backend that is not a GPU's.

        Each call queues, without the host waiting: on the source's stream an event (its work so far; where
        the GPUs have no peer access, first a copy into a pinned host buffer of this copy's own); on our
        stream a wait for it, then the copy (cudaMemcpyPeerAsync, or host -> device), then an event the
        source's stream waits for, so that its later work (the next run's launches) cannot overwrite
        `src`, or the host buffer, before we have read it."""
        if not isinstance(src_backend, CudaBackend) or src_backend is self:
            return None
        import cupy
        from cupy.cuda import runtime

        _check_range(dst, dst_offset, nbytes, "copy into")
        _check_range(src, src_offset, nbytes, "copy from")
        peer, there = self._peer_access(src_backend.index), src_backend
        with there.cuda_device:
            ready = cupy.cuda.Event(block=False, disable_timing=True)
        with self.cuda_device:
            done = cupy.cuda.Event(block=False, disable_timing=True)
        to, of = dst.ptr + dst_offset, src.ptr + src_offset
        # pinned for both GPUs' contexts (portable), so that both copies through it are asynchronous
        host = None if peer else cupy.cuda.PinnedMemory(max(nbytes, 1), runtime.hostAllocPortable)
        via = 0 if host is None else int(host.ptr)
        what = f"copy {src.what} {there.device.name}->{self.device.name}" + ("" if peer else " through the host")

        def copy() -> None:
            if not nbytes:
                return
            with there.cuda_device:
                if host is not None:
                    runtime.memcpyAsync(via, of, nbytes, runtime.memcpyDeviceToHost, there.stream.ptr)
                ready.record(there.stream)
            with self.cuda_device:
                self.stream.wait_event(ready)
                if host is None:
                    runtime.memcpyPeerAsync(to, self.index, of, there.index, nbytes, self.stream.ptr)
                else:
                    runtime.memcpyAsync(to, via, nbytes, runtime.memcpyHostToDevice, self.stream.ptr)
                done.record(self.stream)
            with there.cuda_device:
                there.stream.wait_event(done)
            self.pending[what] = None
            there.pending[what] = None

        return copy

    def _peer_access(self, peer: int) -> bool:
        """Whether this GPU reads GPU `peer`'s memory directly; enabled on first ask where possible."""
        if peer not in self.peers:
            from cupy.cuda import runtime

            ok = bool(runtime.deviceCanAccessPeer(self.index, peer))
            if ok:
                with self.cuda_device:
                    try:
                        runtime.deviceEnablePeerAccess(peer)
                    except runtime.CUDARuntimeError as exc:
                        if getattr(exc, "status", None) != _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                            raise
            self.peers[peer] = ok
        return self.peers[peer]

    # -- execution -------------------------------------------------------------------
    def bind_context(self, where: Callable[[Tensor], tuple[CudaBuffer, int]],
                     checks: IndexTable | None = None, shared: dict[Any, Any] | None = None) -> CudaContext:
        """A context resolving tensors through `where`, registering index uses in `checks` and sharing
        `shared` with the plan's other binds on this GPU (the plan's; a bind outside a plan, as tests make,
        gets its own)."""
        return CudaContext(self.device, self, where, checks if checks is not None else IndexTable(),
                           shared if shared is not None else {})

    def executor(self, launches: list[tuple[str, Launch]]) -> Segment:
        """A Segment running `launches` through a GraphRunner (captured unless
        OPDISPATCH_DISABLE_CUDA_GRAPHS=1). Launches are fixed at bind time, so
        the signature is computed once: our KernelLaunch's own, else identity."""
        kept = [(what, launch) for what, launch in launches if launch is not EMPTY]
        if not launches:
            name = f"{self.device.name} segment (empty)"
        elif len(launches) == 1:
            name = f"{self.device.name} segment [{launches[0][0]}]"
        else:
            name = f"{self.device.name} segment [{launches[0][0]} .. {launches[-1][0]}] ({len(launches)} launches)"
        capture = stream_capture(self.stream) if graphs_enabled() and kept else None
        signature = tuple(getattr(launch, "signature", id(launch)) for _, launch in kept)
        return Segment(self, GraphRunner(name, kept, capture, self.device.name), signature)

    def synchronize(self) -> None:
        """Wait for the stream; a failure there names the segments run since the last wait."""
        try:
            with self.cuda_device:
                self.stream.synchronize()
        except Exception as exc:
            ran = "; ".join(self.pending) or "no plan segment"
            self.pending.clear()
            raise LaunchError(
                f"{self.device.name}: device work failed: {type(exc).__name__}: {exc}. Since the last synchronize "
                f"these ran: {ran}. To name the launch, rerun with OPDISPATCH_DISABLE_CUDA_GRAPHS=1 "
                "CUDA_LAUNCH_BLOCKING=1"
            ) from exc
        self.pending.clear()


def _check_range(buf: CudaBuffer, offset: int, nbytes: int, what: str) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > buf.nbytes:
        raise ValueError(f"{what} {nbytes} bytes at offset {offset}: outside the {buf.nbytes}-byte buffer for {buf.what}")
