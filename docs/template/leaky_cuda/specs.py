"""leaky_cuda's kernel instances, argument records and pure launch specs (tested without a GPU)."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np

from opdispatch.backends.cuda.args import KernelArgs, f32, i32, instance, ptr
from opdispatch.backends.cuda.kernels import KernelSpec

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
LEAKY_CU = KERNELS_DIR / "leaky.cu"
THREADS = 256
KERNEL = instance("leaky_f32", THREADS)
#: each .cu and the instances launched from it (compiled by NVRTC on the GPU, by nvcc in the tests)
KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {LEAKY_CU: (KERNEL,)}


@attrs.frozen
class LeakyArgs(KernelArgs):
    KERNELS = ("leaky_f32",)
    x: np.uint64 = ptr()
    y: np.uint64 = ptr()
    n: np.int32 = i32()
    scale: np.float32 = f32()
    slope: np.float32 = f32()


def leaky_spec(x: int, y: int, n: int, slope: float, scale: float = 1.0) -> KernelSpec:
    """y = leaky_relu(scale * x) over n floats at addresses x and y."""
    return KernelSpec(LEAKY_CU, KERNEL, -(-n // THREADS), THREADS,
                      LeakyArgs(x=x, y=y, n=n, scale=scale, slope=slope))
