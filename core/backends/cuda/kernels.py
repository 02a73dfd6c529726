"""NVRTC modules and pre-bound kernel launches: how a plugin runs CUDA C++.

A plugin keeps its kernels in `kernels/*.cu`, including "common.cuh" and "quant.cuh" (this
folder and the .cu file's own are on the include path). Its specs are `KernelSpec`s (source,
template instance, grid, block, a `KernelArgs` record: args.py) and `spec.launch(stream)`
compiles the instance once and returns a launch that is one cuLaunchKernel call, its
arguments converted once at bind: the measured launch costs (docs/design.md) leave no room
for per-call conversion.

A .cu file whose first line is `// opdispatch-arch: sm_90a` (ARCH_MARK) is compiled for that target
instead of the device's plain one: Hopper's wgmma needs it, and such code runs on compute capability 9.0
only (the plugin's support predicate says so).

A kernel whose body begins with `od::grid_enter();` (common.cuh) launches with programmatic
dependent launch (Hopper, cuLaunchKernelEx): it may start before the kernel ahead of it has
finished, and that first statement waits for it before anything touches memory (a
programmatic edge inside a CUDA graph). One that begins with `od::grid_enter_later();` loads
only constant data (weights) before it calls od::grid_enter() itself. OPDISPATCH_PDL=0 at bind
time turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Sequence

import attrs
import numpy as np

from ...hookspecs import Launch
from ...ops.elementwise import GLU_KINDS
from .args import KernelArgs

#: Shared headers (common.cuh, activations.cuh, quant.cuh); on the include path of every module.
INCLUDE_DIR = Path(__file__).resolve().parent

#: The C type each numpy scalar type is passed as.
_CTYPES: dict[np.dtype, type] = {
    np.dtype(np.bool_): ctypes.c_bool,
    np.dtype(np.int8): ctypes.c_int8,
    np.dtype(np.uint8): ctypes.c_uint8,
    np.dtype(np.int16): ctypes.c_int16,
    np.dtype(np.uint16): ctypes.c_uint16,
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float,
    np.dtype(np.float64): ctypes.c_double,
}

#: The GLU_* kind code (activations.cuh) of each glu kind: its place in GLU_KINDS.
GLU_CODES: dict[str, int] = {kind: i for i, kind in enumerate(GLU_KINDS)}

#: Dynamic shared memory a kernel may use without opting in (cudaFuncSetAttribute).
_SMEM_DEFAULT_LIMIT = 48 * 1024

_modules: dict[tuple, Any] = {}

#: The first line of a .cu file that needs an architecture-specific target, then the target (sm_90a).
ARCH_MARK = "// opdispatch-arch: "


def source_arch(cu_path: str | Path) -> str | None:
    """The target a .cu file's first line names (ARCH_MARK), or None: the device's own."""
    with open(cu_path, encoding="utf-8") as f:
        first = f.readline().strip()
    return first[len(ARCH_MARK):].strip() if first.startswith(ARCH_MARK) else None


@functools.lru_cache(maxsize=None)
def _headers_digest(folder: Path) -> str:
    """Hash of the headers a module can include: CuPy's disk cache keys on the
    source text only, so the source carries this to see header edits."""
    h = hashlib.sha256()
    for path in sorted({*INCLUDE_DIR.glob("*.cuh"), *folder.glob("*.cuh")}):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def load_module(cu_path: str | Path, name_expressions: Sequence[str] = (), options: Sequence[str] = ()) -> Any:
    """The `cupy.RawModule` of a .cu file, compiled by NVRTC with -std=c++17.

    `name_expressions` are the template instances to compile (each then a
    valid `get_function` argument); a file marked with ARCH_MARK is compiled
    for the target it names. Cached in memory per (source and header
    hash, names, options) and on disk by CuPy; the module compiles here, on
    the current device, so that errors name the file.
    """
    import cupy

    path = Path(cu_path).resolve()
    code = f"// opdispatch headers {_headers_digest(path.parent)}\n" + path.read_text()
    arch = source_arch(path)
    opts = ("-std=c++17", f"-I{INCLUDE_DIR}", f"-I{path.parent}", *options,
            *((f"--gpu-architecture={arch}",) if arch else ()))
    names = tuple(name_expressions)
    key = (hashlib.sha256(code.encode()).hexdigest(), names, opts)
    module = _modules.get(key)
    if module is None:
        module = cupy.RawModule(code=code, options=opts, name_expressions=names or None)
        try:
            module.compile()
        except Exception as exc:  # noqa: BLE001 - CuPy's CompileException carries the log
            raise RuntimeError(f"compiling {path} failed: {type(exc).__name__}: {exc}") from exc
        _modules[key] = module
    return module


def pack_args(args: Sequence[Any]) -> tuple[Any, tuple[Any, ...], tuple[Hashable, ...]]:
    """(void* array for cuLaunchKernel, the C values it points at, a hashable
    description of the values) from numpy scalars."""
    values = []
    for i, a in enumerate(args):
        ctype = _CTYPES.get(a.dtype) if isinstance(a, np.generic) else None
        if ctype is None:
            raise TypeError(
                f"kernel argument {i} ({a!r}, {type(a).__name__}): pass a numpy scalar of the parameter's exact C "
                "type (np.uint64 for pointers, np.int32 for int, np.int64 for long long, np.float32 for float)"
            )
        values.append(ctype(a.item()))
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    described = tuple((a.dtype.char, a.item()) for a in args)
    return params, tuple(values), described


def _dims(what: str, dims: int | Sequence[int], limits: tuple[int, int, int]) -> tuple[int, int, int]:
    d = (int(dims),) if isinstance(dims, (int, np.integer)) else tuple(int(x) for x in dims)
    if not 1 <= len(d) <= 3 or any(x < 0 or x > hi for x, hi in zip(d, limits)):
        raise ValueError(f"{what} {tuple(d)} is out of CUDA's range {limits}")
    return (d + (1, 1))[:3]  # type: ignore[return-value]


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig, the first argument of cuLaunchKernelEx."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.lru_cache(maxsize=None)
def _launch_kernel_ex() -> Any:
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


#: a kernel's name and a body that begins with od::grid_enter() or od::grid_enter_later()
#: (launch bounds removed first)
_PDL_HEAD = re.compile(r"__global__[^{;]*?(\w+)\s*\([^{;]*\)\s*\{\s*od::grid_enter(?:_later)?\(\);")


@functools.lru_cache(maxsize=None)
def pdl_kernels(source: Path) -> frozenset[str]:
    """The kernels of a .cu file whose body begins with od::grid_enter() (or grid_enter_later():
    the kernel waits itself, after loading constant data): those launch with programmatic
    dependent launch (see the module docstring)."""
    text = re.sub(r"__launch_bounds__\s*\([^)]*\)", "", Path(source).read_text())
    return frozenset(m.group(1) for m in _PDL_HEAD.finditer(text))


#: the start of a kernel head (comments and launch bounds removed first); its parameter list follows
_KERNEL_NAME = re.compile(r"__global__\s+void\s+(\w+)\s*\(")
#: a one-parameter macro (`#define OD_LAYOUT_PARAMS(p) unsigned p##d0, ...`), as kernels declare
#: repeated parameter groups, or one without parameters (`#define ROPE_PARAMS int d, ...`)
_MACRO = re.compile(r"^#define\s+(\w+)(?:\((\w+)\)|(?=\s))((?:[^\n]*\\\n)*[^\n]*)", re.M)


def _strip(text: str) -> str:
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"__launch_bounds__\s*\([^)]*\)", "", text)


@functools.lru_cache(maxsize=None)
def _macros(folder: Path) -> dict[str, tuple[str | None, str]]:
    """The one-parameter and parameterless macros of the headers a module in `folder` can include:
    name -> (parameter or None, body)."""
    found = {}
    for path in sorted({*INCLUDE_DIR.glob("*.cuh"), *folder.glob("*.cuh"), *folder.glob("*.cu")}):
        for m in _MACRO.finditer(_strip(path.read_text())):
            found[m.group(1)] = (m.group(2), m.group(3).replace("\\\n", " "))
    return found


def _expand(params: str, macros: dict[str, tuple[str | None, str]]) -> str:
    """`params` with each macro replaced by its body (a one-parameter call's token pasting by ##)."""
    def one(m: re.Match) -> str:
        param, body = macros[m.group(1)]
        return re.sub(rf"\b{param}\s*##|##\s*{param}\b", m.group(2).strip(), body)

    plain = "|".join(re.escape(n) for n, (p, _) in macros.items() if p is None)
    params = re.sub(rf"\b({plain})\b", lambda m: macros[m.group(1)][1], params) if plain else params
    calls = "|".join(re.escape(n) for n, (p, _) in macros.items() if p is not None)
    return re.sub(rf"\b({calls})\s*\(([^()]*)\)", one, params) if calls else params


@functools.lru_cache(maxsize=None)
def _kernel_heads(source: Path) -> dict[str, tuple[tuple[str, str], ...]]:
    """(C type, name) of each parameter, in order, of every `__global__` kernel of a .cu file, macros of
    parameter groups expanded; an array parameter's type is its element's plus "*"."""
    text = _strip(Path(source).read_text())
    macros = _macros(Path(source).parent)
    found = {}
    for m in _KERNEL_NAME.finditer(text):
        depth, end = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        params = _expand(text[m.end():end - 1], macros)
        heads = []
        for p in (p.strip() for p in params.split(",") if p.strip()):
            ctype, name, array = re.fullmatch(r"(.*?)\s*\b(\w+)\s*(\[[^\]]*\])?", p, re.S).groups()
            ctype = re.sub(r"\b(const|__restrict__|volatile)\b", " ", ctype)
            heads.append((re.sub(r"\s+", " ", ctype).replace(" *", "*").strip() + ("*" if array else ""), name))
        found[m.group(1)] = tuple(heads)
    return found


def kernel_params(source: Path) -> dict[str, tuple[str, ...]]:
    """The parameter names, in order, of every `__global__` kernel of a .cu file (what each
    kernel's `KernelArgs` record lists), macros of parameter groups expanded."""
    return {kernel: tuple(name for _, name in heads) for kernel, heads in _kernel_heads(Path(source)).items()}


#: the numpy scalar type a kernel argument of each C scalar type is passed as (args.py's fields); any pointer
#: is an np.uint64 address
C_SCALARS: dict[str, type[np.generic]] = {"int": np.int32, "unsigned": np.uint32, "unsigned int": np.uint32,
                                          "long long": np.int64, "unsigned long long": np.uint64,
                                          "float": np.float32, "double": np.float64, "bool": np.bool_}


def kernel_param_types(source: Path) -> dict[str, tuple[type[np.generic], ...]]:
    """The numpy scalar types of every `__global__` kernel's parameters in a .cu file, in order (what its
    KernelSpec's argument values must be). Raises ValueError on a parameter of another scalar type."""
    def scalar(kernel: str, ctype: str, name: str) -> type[np.generic]:
        if ctype.endswith("*"):
            return np.uint64
        if ctype not in C_SCALARS:
            raise ValueError(f"{source}: {kernel}'s parameter {name} is a {ctype}, none of {sorted(C_SCALARS)}")
        return C_SCALARS[ctype]

    return {kernel: tuple(scalar(kernel, ctype, name) for ctype, name in heads)
            for kernel, heads in _kernel_heads(Path(source)).items()}


def pdl_enabled(device_id: int) -> bool:
    """Programmatic dependent launch on this device: compute capability 9.0 or later, and not
    turned off by OPDISPATCH_PDL=0 (read at bind time, so a process can compare both)."""
    import cupy

    return os.environ.get("OPDISPATCH_PDL", "1") != "0" and int(cupy.cuda.Device(device_id).compute_capability) >= 90


def _pdl_go(fn_ptr: int, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int, stream_ptr: int,
            params: Any) -> tuple[Callable[[], None], tuple[Any, ...]]:
    """A zero-argument cuLaunchKernelEx of `fn_ptr` with the programmatic-serialization attribute,
    and the C structures it points at (to keep alive)."""
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value = (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed = 1
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem, stream_ptr,
                        ctypes.pointer(attr), 1)
    launch, cfg_ptr, params_ptr = _launch_kernel_ex(), ctypes.addressof(cfg), ctypes.addressof(params)

    def go() -> None:
        rc = launch(cfg_ptr, fn_ptr, params_ptr, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {rc}")

    return go, (attr, cfg)


def EMPTY() -> None:  # noqa: N802 - a constant, used by identity
    """The launch of an empty grid: nothing to do (executors drop it)."""


@attrs.define(eq=False, repr=False)
class KernelLaunch:
    """One kernel launch with everything fixed: calling it is one cuLaunchKernel."""

    name: str
    signature: tuple[Hashable, ...]  # kernel, grid, block, smem, argument values, PDL: graph re-capture key
    _go: Callable[[], None]
    _keep: tuple[Any, ...]  # the C argument values and their pointer array, alive as long as the launch

    def __call__(self) -> None:
        self._go()

    def __repr__(self) -> str:
        return f"<KernelLaunch {self.name} grid={self.signature[1]} block={self.signature[2]}>"


def opt_in_smem(fn: Any, smem: int) -> None:
    """Let every launch of `fn` take `smem` bytes of dynamic shared memory (above the 48 KiB default).

    The limit is the function's, shared by every launch bound to it, so it only ever grows: lowering it
    for a launch with less (one instance serving nodes of several sizes) would make the launches bound
    before, with more, fail (CUDA_ERROR_INVALID_VALUE).
    """
    if smem > _SMEM_DEFAULT_LIMIT and smem > fn.max_dynamic_shared_size_bytes:
        fn.max_dynamic_shared_size_bytes = smem


def launcher(fn: Any, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[Any],
             smem: int = 0, *, stream: Any, pdl: bool = False) -> Launch:
    """A zero-argument launch of `fn` (from `load_module(...).get_function`) on `stream`,
    with programmatic dependent launch if `pdl` (the kernel begins with od::grid_enter()) and
    the device has it.

    An empty grid (a zero dimension) gives a launch that does nothing. More
    than 48 KiB of dynamic shared memory is opted into here.
    """
    import cupy
    from cupy.cuda import driver

    g = _dims("grid", grid, (2**31 - 1, 65535, 65535))
    if 0 in g:
        return EMPTY
    b = _dims("block", block, (1024, 1024, 64))
    if 0 in b:
        raise ValueError(f"block {b} has a zero dimension")
    params, values, described = pack_args(args)
    with cupy.cuda.Device(stream.device_id):
        opt_in_smem(fn, smem)
        ptr = int(fn.kernel.ptr)
        pdl = pdl and pdl_enabled(stream.device_id)
    name = getattr(fn, "name", "kernel")
    if pdl:
        go, structs = _pdl_go(ptr, g, b, int(smem), int(stream.ptr), params)
    else:
        go = functools.partial(driver.launchKernel, ptr, *g, *b, int(smem), int(stream.ptr), ctypes.addressof(params),
                               0)
        structs = ()
    return KernelLaunch(name, (ptr, g, b, int(smem), described, pdl), go, (params, values, *structs))


@attrs.frozen
class KernelSpec:
    """One launch of kernel instance `kernel` of `source`: what a plugin's bind computes.

    Kept as data so that plugins can test grids and arguments without a GPU.
    NVRTC compiles only the instance launched (a module of one name, cached in
    memory and on disk): a plan pays for the kernels it uses.
    """

    source: Path
    kernel: str
    grid: int | tuple[int, ...]
    block: int | tuple[int, ...]
    args: KernelArgs | tuple[Any, ...]
    smem: int = 0

    @property
    def arg_values(self) -> tuple[Any, ...]:
        """The arguments as numpy scalars in C order."""
        return self.args.values() if isinstance(self.args, KernelArgs) else tuple(self.args)

    @property
    def pdl(self) -> bool:
        """Whether the kernel begins with od::grid_enter(), and so launches with PDL."""
        return self.kernel.split("<")[0].strip() in pdl_kernels(Path(self.source).resolve())

    def launch(self, stream: Any) -> Launch:
        fn = load_module(self.source, (self.kernel,)).get_function(self.kernel)
        return launcher(fn, self.grid, self.block, self.arg_values, self.smem, stream=stream, pdl=self.pdl)


@attrs.define(eq=False)
class LaunchChain:
    """Several pre-bound launches run in order as one node's launch (a conversion
    and its GEMM, a split-KV pass and its combine), with the scratch buffers
    they use kept alive as long as the launch."""

    launches: tuple[Launch, ...]
    keep: tuple[Any, ...] = ()
    signature: tuple[Hashable, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.signature = tuple(getattr(fn, "signature", id(fn)) for fn in self.launches)

    def __call__(self) -> None:
        for fn in self.launches:
            fn()


def chain(launches: Iterable[Launch], keep: Sequence[Any] = ()) -> Launch:
    """One launch for `launches`, empty ones dropped: EMPTY, the only one, or a LaunchChain."""
    kept = [fn for fn in launches if fn is not EMPTY]
    if not kept:
        return EMPTY
    if len(kept) == 1 and not keep:
        return kept[0]
    return LaunchChain(tuple(kept), tuple(keep))


def launch_specs(stream: Any, specs: Iterable[KernelSpec], keep: Sequence[Any] = ()) -> Launch:
    """One launch running `specs` in order on `stream`, keeping `keep` (scratch buffers) alive with it."""
    return chain((s.launch(stream) for s in specs), keep)
