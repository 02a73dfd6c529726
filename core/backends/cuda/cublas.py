"""cuBLAS under CUDA-graph capture: our own handle, reached through ctypes.

CuPy refuses cuBLAS calls while its stream captures ("calling cuBLAS API
during stream capture is currently unsupported"). The measured way (docs/design.md)
around it: a cuBLAS handle of our own, created with `cublasCreate_v2` on the
libcublas CuPy loads, its stream (`cublasSetStream_v2`) and a preallocated
workspace (`cublasSetWorkspace_v2`, after the stream: setting a stream resets
the workspace to cuBLAS' own pool) set once before any capture; the GEMM calls
(`cublasLtMatmul` on a cublasLt handle, `cublasGemmBatchedEx`) then work
inside a capture and record their kernels into the graph. The pointer arrays of
batched calls are written to device memory at bind time.

Single and strided-batched GEMMs go through cublasLt (`Cublas.matmul`): the
same kernels cublasGemmEx picks from, but the algorithm is chosen by timing
cuBLAS' best few heuristic candidates once per problem (at bind time, before
any capture; the choice is cached per problem and operand alignment).
cublasGemmEx runs the heuristic's first pick: our f16 GEMM with an f32 result
measured 0.92x torch's f16-result GEMM (bf16: 0.99x), so the pick is timed.

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
from typing import Any, Callable, Sequence

import attrs
import numpy as np

# cudaDataType_t (library_types.h)
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
#: our dtype names -> cudaDataType_t
DATA_TYPES = {"f32": CUDA_R_32F, "f16": CUDA_R_16F, "bf16": CUDA_R_16BF}
ELEMENT_BYTES = {CUDA_R_32F: 4, CUDA_R_16F: 2, CUDA_R_16BF: 2}
# cublasOperation_t
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
# cublasComputeType_t: float accumulation, no reduced-precision (TF32) shortcuts
CUBLAS_COMPUTE_32F = 68
# cublasGemmAlgo_t
CUBLAS_GEMM_DEFAULT = -1

#: the workspace each handle gets (NVIDIA recommends 32 MiB on Hopper)
WORKSPACE_BYTES = 32 * 2**20

# cublasLt attributes: matmul descriptor, matrix layout, preference
LT_DESC_TRANSA, LT_DESC_TRANSB = 3, 4
LT_LAYOUT_BATCH_COUNT, LT_LAYOUT_STRIDED_BATCH_OFFSET = 5, 6
LT_PREF_MAX_WORKSPACE_BYTES = 1
LT_PREF_MIN_ALIGNMENT_BYTES = (5, 6, 7, 8)  # of A, B, C, D (cublasLt assumes 256 unless told)
#: heuristic candidates timed per problem, and timed runs of each
LT_CANDIDATES, LT_RUNS = 8, 5


class LtAlgo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: opaque, 8 x uint64."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class LtHeuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", LtAlgo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]

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
    return _load_first("libcublas", candidates, _declare, tried)


def _load_first(what: str, candidates: Sequence[str | None], declare: Callable[[ctypes.CDLL], None],
                tried: list[str]) -> ctypes.CDLL:
    """The first of `candidates` (paths or sonames; None skipped) that loads, typed by `declare`."""
    for path in candidates:
        if not path:
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            tried.append(f"{path}: {exc}")
            continue
        declare(lib)
        return lib
    raise CublasError(f"cannot load {what}: " + "; ".join(tried))


@functools.lru_cache(maxsize=1)
def lt_library() -> ctypes.CDLL:
    """libcublasLt: beside the libcublas in use (which loads it), else by soname."""
    base = library()._name  # noqa: SLF001 - ctypes keeps the path it loaded
    folder = os.path.dirname(base)
    suffix = os.path.basename(base)[len("libcublas"):]  # ".so.13" and the like
    candidates = [os.path.join(folder, "libcublasLt" + suffix) if folder else None,
                  ctypes.util.find_library("cublasLt"), "libcublasLt.so.13", "libcublasLt.so.12"]
    return _load_first("libcublasLt", candidates, _declare_lt, [])


def _declare_lt(lib: ctypes.CDLL) -> None:
    vp, i32, u64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t
    sig = {
        "cublasLtCreate": [vp],
        "cublasLtMatmulDescCreate": [vp, i32, i32],  # desc*, compute type, scale type
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [vp, i32, u64, u64, ctypes.c_int64],  # layout*, type, rows, cols, ld
        "cublasLtMatrixLayoutSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulPreferenceCreate": [vp],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        # handle, desc, A, B, C, D layouts, preference, requested, results*, count*
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, vp, vp],
        # handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo*, workspace, size, stream
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
    }
    for name, args in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_size_t
    sig = {
        "cublasCreate_v2": [vp],
        "cublasDestroy_v2": [vp],
        "cublasSetStream_v2": [vp, vp],
        "cublasSetWorkspace_v2": [vp, vp, sz],
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
    lt: ctypes.c_void_p | None = attrs.field(init=False, default=None)  # cublasLt handle, made on first use
    #: (matmul descriptor, layouts, chosen algorithm) per problem: made and timed once
    lt_problems: dict[tuple, tuple] = attrs.field(init=False, factory=dict)

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

    def matmul(self, transa: int, transb: int, m: int, n: int, k: int, a: int, a_type: int, lda: int, b: int,
               b_type: int, ldb: int, c: int, c_type: int, ldc: int, strides: tuple[int, int, int] = (0, 0, 0),
               batch: int = 1, alpha: float = 1.0, beta: float = 0.0, c_in: int = 0) -> GemmLaunch:
        """C (m x n, column-major) = alpha * op(A) op(B) + beta * C through cublasLt, float accumulation;
        `batch` of them with operand i at base + i * strides (elements). A nonzero c_in is the C read (of C's
        layout), which the result then does not overwrite: cublasLt's C and D apart. The algorithm is the
        fastest of cuBLAS' heuristic candidates for this problem, timed on first use (see the module doc)."""
        lt = lt_library()
        if self.lt is None:
            self.lt = ctypes.c_void_p()
            check(lt.cublasLtCreate(ctypes.byref(self.lt)), "cublasLtCreate")
        types = (a_type, b_type, c_type)
        align = tuple(_alignment(ptr, stride * ELEMENT_BYTES[t] if batch > 1 else 0)
                      for ptr, stride, t in zip((a, b, c_in or c, c), (*strides, strides[2]), (*types, c_type)))
        key = (transa, transb, m, n, k, types, lda, ldb, ldc, strides, batch, align)
        problem = self.lt_problems.get(key)
        al, be = self._scalars(alpha, beta)
        if problem is None:
            desc = ctypes.c_void_p()
            check(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                  "cublasLtMatmulDescCreate")
            _set(lt.cublasLtMatmulDescSetAttribute, desc, LT_DESC_TRANSA, ctypes.c_int32(transa))
            _set(lt.cublasLtMatmulDescSetAttribute, desc, LT_DESC_TRANSB, ctypes.c_int32(transb))
            shapes = ((a_type, *((m, k) if transa == CUBLAS_OP_N else (k, m)), lda, strides[0]),
                      (b_type, *((k, n) if transb == CUBLAS_OP_N else (n, k)), ldb, strides[1]),
                      (c_type, m, n, ldc, strides[2]))
            layouts = tuple(self._layout(*shape, batch) for shape in shapes)
            pref = ctypes.c_void_p()
            check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
            _set(lt.cublasLtMatmulPreferenceSetAttribute, pref, LT_PREF_MAX_WORKSPACE_BYTES,
                 ctypes.c_uint64(WORKSPACE_BYTES))
            for attr, value in zip(LT_PREF_MIN_ALIGNMENT_BYTES, align):
                _set(lt.cublasLtMatmulPreferenceSetAttribute, pref, attr, ctypes.c_uint32(value))
            c_bytes = ((batch - 1) * strides[2] + ldc * n) * ELEMENT_BYTES[c_type]
            algo = self._fastest(desc, layouts, pref, a, b, c_bytes, al, be)
            problem = self.lt_problems[key] = (desc, layouts, algo)
        desc, (la, lb, lc), algo = problem
        args = (self.lt, desc, ctypes.addressof(al), a, la, b, lb, ctypes.addressof(be), c_in or c, lc, c, lc,
                ctypes.addressof(algo), self.workspace.ptr, WORKSPACE_BYTES, int(self.backend.stream.ptr))
        return self._launch("cublasLtMatmul", lt.cublasLtMatmul, args, (al, be, algo), extra=tuple(algo.data))

    def _layout(self, dtype: int, rows: int, cols: int, ld: int, stride: int, batch: int) -> ctypes.c_void_p:
        lt = lt_library()
        layout = ctypes.c_void_p()
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "cublasLtMatrixLayoutCreate")
        if batch > 1:
            _set(lt.cublasLtMatrixLayoutSetAttribute, layout, LT_LAYOUT_BATCH_COUNT, ctypes.c_int32(batch))
            _set(lt.cublasLtMatrixLayoutSetAttribute, layout, LT_LAYOUT_STRIDED_BATCH_OFFSET, ctypes.c_int64(stride))
        return layout

    def _fastest(self, desc: ctypes.c_void_p, layouts: tuple, pref: ctypes.c_void_p, a: int, b: int, c_bytes: int,
                 al: ctypes.c_float, be: ctypes.c_float) -> LtAlgo:
        """The quickest of up to LT_CANDIDATES heuristic algorithms, timed into a scratch C (the real
        one may hold live data at bind time); the first one untimed while the stream captures."""
        import cupy

        lt = lt_library()
        la, lb, lc = layouts
        found = (LtHeuristic * LT_CANDIDATES)()
        count = ctypes.c_int()
        check(lt.cublasLtMatmulAlgoGetHeuristic(self.lt, desc, la, lb, lc, lc, pref, LT_CANDIDATES, found,
                                                ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        algos = [LtAlgo.from_buffer_copy(r.algo) for r in found[:count.value]
                 if r.state == 0 and r.workspace_size <= WORKSPACE_BYTES]
        if not algos:
            raise CublasError("cublasLtMatmulAlgoGetHeuristic: no algorithm for this problem")
        stream = self.backend.stream
        if len(algos) == 1 or stream.is_capturing():
            return algos[0]
        scratch = self.backend.alloc(max(c_bytes, 1), "cublasLt algorithm timing output")
        best: tuple[float, LtAlgo] | None = None
        for algo in algos:
            args = (self.lt, desc, ctypes.byref(al), a, la, b, lb, ctypes.byref(be), scratch.ptr, lc, scratch.ptr, lc,
                    ctypes.byref(algo), self.workspace.ptr, WORKSPACE_BYTES, int(stream.ptr))
            if lt.cublasLtMatmul(*args) != 0:  # a candidate that cannot run here is skipped
                continue
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(LT_RUNS):
                lt.cublasLtMatmul(*args)
            end.record(stream)
            end.synchronize()
            ms = cupy.cuda.get_elapsed_time(start, end)
            if best is None or ms < best[0]:
                best = (ms, algo)
        if best is None:
            raise CublasError("cublasLtMatmul: no candidate algorithm ran")
        return best[1]

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


def _alignment(ptr: int, stride_bytes: int) -> int:
    """The largest power of two up to 256 dividing the address and the batch stride (0: none)."""
    x = ptr | stride_bytes | 256
    return x & -x


def _set(setter: Any, obj: ctypes.c_void_p, attr: int, value: Any) -> None:
    """A cublasLt attribute from a ctypes scalar."""
    check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), setter.__name__)


_handles: dict[int, Cublas] = {}


def for_backend(backend: Any) -> Cublas:
    """The one Cublas of `backend` (a CudaBackend), made on first use."""
    key = id(backend)
    found = _handles.get(key)
    if found is None or found.backend is not backend:
        found = _handles[key] = Cublas(backend)
    return found
