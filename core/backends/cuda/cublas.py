"""cuBLAS under CUDA-graph capture: our own handle, reached through ctypes.

CuPy refuses cuBLAS calls while its stream captures ("calling cuBLAS API
during stream capture is currently unsupported"). DESIGN.md's measured way
around it: a cuBLAS handle of our own, created with `cublasCreate_v2` on the
libcublas CuPy loads, its stream (`cublasSetStream_v2`) and a preallocated
workspace (`cublasSetWorkspace_v2`, after the stream: setting a stream resets
the workspace to cuBLAS' own pool) set once before any capture; the GEMM calls
(`cublasGemmEx`, `cublasGemmStridedBatchedEx`, `cublasGemmBatchedEx`) then work
inside a capture and record their kernels into the graph. The pointer arrays of
batched calls are written to device memory at bind time.

One `Cublas` per backend (`for_backend`): its handle is bound to the backend's
stream, so its GEMMs are ordered with the plan's kernels. Every status code is
checked; a failure names the call and the status.

cuBLAS is column-major. Helpers here take cuBLAS' own arguments; the callers
(plugins/cuda_matmul) write down how their row-major operands map to them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any, Sequence

import attrs
import numpy as np

# cudaDataType_t (library_types.h)
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
#: our dtype names -> cudaDataType_t
DATA_TYPES = {"f32": CUDA_R_32F, "f16": CUDA_R_16F, "bf16": CUDA_R_16BF}
# cublasOperation_t
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
# cublasComputeType_t: float accumulation, no reduced-precision (TF32) shortcuts
CUBLAS_COMPUTE_32F = 68
# cublasGemmAlgo_t
CUBLAS_GEMM_DEFAULT = -1

#: the workspace each handle gets (NVIDIA recommends 32 MiB on Hopper)
WORKSPACE_BYTES = 32 * 2**20

_STATUS = {
    0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR", 15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}


class CublasError(RuntimeError):
    """A cuBLAS call returned an error status; the message names the call."""


def check(status: int, call: str) -> None:
    if status != 0:
        raise CublasError(f"{call} failed: {_STATUS.get(status, 'unknown status')} ({status})")


def _loaded_path() -> str | None:
    """The libcublas already mapped into this process (after CuPy's cuBLAS module loaded it)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                name = os.path.basename(path)
                if name.startswith("libcublas.so"):
                    return path
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """libcublas with the entry points used here typed. Prefers the copy CuPy loaded
    (`cupy.cuda.cublas`), then cuda-pathfinder, then the loader's search by soname."""
    tried = []
    try:  # makes CuPy load its libcublas, so that ours is the same copy
        import cupy.cuda.cublas  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure: search on
        tried.append(f"cupy.cuda.cublas: {exc}")
    candidates = [_loaded_path()]
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib  # type: ignore[import-not-found]

        candidates.append(load_nvidia_dynamic_lib("cublas").abs_path)
    except Exception as exc:  # noqa: BLE001
        tried.append(f"cuda.pathfinder: {exc}")
    candidates += [ctypes.util.find_library("cublas"), "libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    for path in candidates:
        if not path:
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            tried.append(f"{path}: {exc}")
            continue
        _declare(lib)
        return lib
    raise CublasError("cannot load libcublas: " + "; ".join(tried))


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_size_t
    sig = {
        "cublasCreate_v2": [vp],
        "cublasDestroy_v2": [vp],
        "cublasSetStream_v2": [vp, vp],
        "cublasSetWorkspace_v2": [vp, vp, sz],
        # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute, algo
        "cublasGemmEx": [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp, vp, i32, i32, i32, i32],
        # ... A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, compute, algo
        "cublasGemmStridedBatchedEx": [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, i64, vp, i32, i32, i64, vp, vp,
                                       i32, i32, i64, i32, i32, i32],
        # ... Aarray, Atype, lda, Barray, Btype, ldb, beta, Carray, Ctype, ldc, batchCount, compute, algo
        "cublasGemmBatchedEx": [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp, vp, i32, i32, i32, i32,
                                i32],
    }
    for name, args in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int


@attrs.define(eq=False, repr=False)
class GemmLaunch:
    """One pre-bound cuBLAS call: calling it is one ctypes call and a status check."""

    name: str
    signature: tuple[Any, ...]  # the call and its argument values: the graph re-capture key
    _fn: Any
    _args: tuple[Any, ...]
    _keep: tuple[Any, ...] = ()  # alpha/beta storage, pointer arrays: alive as long as the launch

    def __call__(self) -> None:
        status = self._fn(*self._args)
        if status != 0:
            check(status, self.name)

    def __repr__(self) -> str:
        return f"<GemmLaunch {self.name}>"


@attrs.define(eq=False)
class Cublas:
    """A cuBLAS handle on one backend's stream, with its own workspace."""

    backend: Any  # CudaBackend
    handle: ctypes.c_void_p = attrs.field(init=False)
    workspace: Any = attrs.field(init=False)  # CudaBuffer
    lib: ctypes.CDLL = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.lib = library()
        be = self.backend
        self.handle = ctypes.c_void_p()
        with be.cuda_device:
            check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate_v2")
            self.workspace = be.alloc(WORKSPACE_BYTES, "the cuBLAS workspace")
            # the stream first: cublasSetStream resets the workspace to cuBLAS' default pool
            check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(int(be.stream.ptr))), "cublasSetStream_v2")
            check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.ptr),
                                                 self.workspace.nbytes), "cublasSetWorkspace_v2")

    @staticmethod
    def _scalars(alpha: float, beta: float) -> tuple[ctypes.c_float, ctypes.c_float]:
        return ctypes.c_float(alpha), ctypes.c_float(beta)

    def gemm(self, transa: int, transb: int, m: int, n: int, k: int, a: int, a_type: int, lda: int, b: int,
             b_type: int, ldb: int, c: int, c_type: int, ldc: int, alpha: float = 1.0, beta: float = 0.0
             ) -> GemmLaunch:
        """C (m x n, column-major) = alpha * op(A) op(B) + beta * C, float accumulation."""
        al, be = self._scalars(alpha, beta)
        args = (self.handle, transa, transb, m, n, k, ctypes.addressof(al), a, a_type, lda, b, b_type, ldb,
                ctypes.addressof(be), c, c_type, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        return self._launch("cublasGemmEx", self.lib.cublasGemmEx, args, (al, be))

    def gemm_strided_batched(self, transa: int, transb: int, m: int, n: int, k: int, a: int, a_type: int, lda: int,
                             stride_a: int, b: int, b_type: int, ldb: int, stride_b: int, c: int, c_type: int,
                             ldc: int, stride_c: int, batch: int, alpha: float = 1.0, beta: float = 0.0
                             ) -> GemmLaunch:
        """`batch` GEMMs, operand i at base + i * stride (elements)."""
        al, be = self._scalars(alpha, beta)
        args = (self.handle, transa, transb, m, n, k, ctypes.addressof(al), a, a_type, lda, stride_a, b, b_type, ldb,
                stride_b, ctypes.addressof(be), c, c_type, ldc, stride_c, batch, CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT)
        return self._launch("cublasGemmStridedBatchedEx", self.lib.cublasGemmStridedBatchedEx, args, (al, be))

    def gemm_batched(self, transa: int, transb: int, m: int, n: int, k: int, a_ptrs: Sequence[int], a_type: int,
                     lda: int, b_ptrs: Sequence[int], b_type: int, ldb: int, c_ptrs: Sequence[int], c_type: int,
                     ldc: int, alpha: float = 1.0, beta: float = 0.0) -> GemmLaunch:
        """One GEMM per (a, b, c) address triple; the three pointer arrays are written to
        device memory now (bind time), so the call needs no host work later."""
        batch = len(a_ptrs)
        if not batch == len(b_ptrs) == len(c_ptrs):
            raise ValueError(f"cublasGemmBatchedEx: {len(a_ptrs)}, {len(b_ptrs)}, {len(c_ptrs)} pointers")
        table = np.array([*a_ptrs, *b_ptrs, *c_ptrs], dtype=np.uint64)
        buf = self.backend.alloc(table.nbytes, "cuBLAS batched pointer arrays")
        self.backend.write(buf, 0, table.view(np.uint8))
        base = buf.ptr
        al, be = self._scalars(alpha, beta)
        args = (self.handle, transa, transb, m, n, k, ctypes.addressof(al), base, a_type, lda, base + 8 * batch,
                b_type, ldb, ctypes.addressof(be), base + 16 * batch, c_type, ldc, batch, CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT)
        return self._launch("cublasGemmBatchedEx", self.lib.cublasGemmBatchedEx, args, (al, be, buf),
                            extra=tuple(table.tolist()))

    def _launch(self, name: str, fn: Any, args: tuple, keep: tuple, extra: tuple = ()) -> GemmLaunch:
        handle = args[0]
        values = tuple(a.value if isinstance(a, ctypes.c_void_p) else a for a in args[1:])
        scalars = tuple(k.value for k in keep if isinstance(k, ctypes.c_float))
        return GemmLaunch(name, (name, handle.value, values, scalars, extra), fn, args, keep)


_handles: dict[int, Cublas] = {}


def for_backend(backend: Any) -> Cublas:
    """The one Cublas of `backend` (a CudaBackend), made on first use."""
    key = id(backend)
    found = _handles.get(key)
    if found is None or found.backend is not backend:
        found = _handles[key] = Cublas(backend)
    return found
