"""Every plugin kernel source compiles for sm_90 with nvcc, every launched template instance included.

NVRTC compiles a template instance only when asked by name, so each plugin
declares, per .cu file, the name expressions it launches: a KERNEL_SOURCES
{path: names} in its package or in a module of it. For each file the test
writes a wrapper that includes it and takes the address of every instance,
forcing nvcc (and ptxas) to build them all, as NVRTC would on the GPU. Runs
without a GPU; skips only when nvcc is absent. One test per file, each in
its own folder, so the files compile in parallel under xdist.
"""

from __future__ import annotations

import importlib
import pkgutil
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ROOT / "plugins"
INCLUDE = ROOT / "core" / "backends" / "cuda"
SOURCES = sorted(PLUGINS.glob("*/kernels/*.cu"))
NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: CUDA sources cannot be compiled here")

# Uses every helper of common.cuh, so that ptxas checks their code too.
COMMON_PROBE = r"""
#include "common.cuh"

template <int BLOCK>
__global__ void probe(const od::f16* h, const od::bf16* b, od::f16* ho, od::bf16* bo, float* out) {
    const int i = threadIdx.x;
    float v = od::load(h + i) + od::load(b + i) + od::load(reinterpret_cast<const float*>(out) + i);
    od::store(ho + i, v);
    od::store(bo + i, v);
    const float2 s = od::block_sum<BLOCK>(float2{v, v * v});
    od::store(out + i, od::block_sum<BLOCK>(s.x) + s.y + od::warp_max(v));
}

void* const instances[] = {(void*)&probe<32>, (void*)&probe<1024>};
"""


def nvcc(source: Path, workdir: Path, kernels_dir: Path) -> None:
    """Compile as load_module does: the shared headers and the kernel's own folder on the include path."""
    cmd = [NVCC, "-arch=sm_90", "-std=c++17", f"-I{INCLUDE}", f"-I{kernels_dir}", "-c", str(source),
           "-o", str(workdir / "out.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"


def instances(cu: Path) -> tuple[str, ...]:
    """The name expressions the plugin owning `cu` declares for it, in a KERNEL_SOURCES of its package
    or of any module in it."""
    package = importlib.import_module(f"opdispatch.plugins.{cu.parent.parent.name}")
    modules = [package] + [importlib.import_module(f"{package.__name__}.{m.name}")
                           for m in pkgutil.iter_modules(package.__path__)]
    declared = {Path(p).resolve(): tuple(names)
                for module in modules for p, names in getattr(module, "KERNEL_SOURCES", {}).items()}
    assert cu.resolve() in declared, (
        f"{cu.relative_to(ROOT)} is in no KERNEL_SOURCES of {package.__name__}: declare the template instances "
        "the plugin launches from it (an empty tuple if none)"
    )
    return declared[cu.resolve()]


def test_sources_found() -> None:
    """Guards the glob: the built-in norm kernels at least."""
    assert PLUGINS / "cuda_norm" / "kernels" / "norm.cu" in SOURCES


@needs_nvcc
@pytest.mark.parametrize("cu", SOURCES, ids=[str(p.relative_to(PLUGINS)) for p in SOURCES])
def test_compiles_with_every_instance(cu: Path, tmp_path: Path) -> None:
    names = instances(cu)
    refs = "".join(f"    (void*)&{name},\n" for name in names)
    wrapper = tmp_path / f"instances_{cu.stem}.cu"
    wrapper.write_text(f'#include "{cu.resolve()}"\n\nvoid* const od_instances[] = {{\n{refs}    nullptr,\n}};\n')
    nvcc(wrapper, tmp_path, cu.parent)


@needs_nvcc
def test_common_header_compiles(tmp_path: Path) -> None:
    probe = tmp_path / "probe.cu"
    probe.write_text(COMMON_PROBE)
    nvcc(probe, tmp_path, INCLUDE)
