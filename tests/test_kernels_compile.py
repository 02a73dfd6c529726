"""Every plugin kernel source compiles for sm_90 with nvcc, every launched template instance included.

NVRTC compiles a template instance only when asked by name, so each plugin
declares, per .cu file, the name expressions it launches: a KERNEL_SOURCES
{path: names} in its package or in a module of it. For each file the test
writes a wrapper that includes it and takes the address of every instance,
forcing nvcc (and ptxas) to build them all, as NVRTC would on the GPU (but
for NVVM's optimizer: NVVM_OPT). Runs
without a GPU; skips only when nvcc is absent. One test per file, each in
its own folder, so the files compile in parallel under xdist; a file's
instances are cut into one wrapper per CPU, compiled side by side, so that
the files with the most instances (mmvq_stream.cu, mmq.cu) take a fraction
of their time in a single-process run (CI's).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from opdispatch.backends.cuda.kernels import source_arch

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
__global__ void probe(const od::f16* h, const od::bf16* b, od::f16* ho, od::bf16* bo, float* out,
                      unsigned char* raw, OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    const int i = threadIdx.x;
    float v = od::load(h + i) + od::load(b + i) + od::load(reinterpret_cast<const float*>(out) + i);
    v += od::index_ok(i - 1, 32, err_word, err_tag, i) ? 0.0f : 1.0f;
    v += od::to_f32(h[i]) + od::to_f32(b[i]) + od::to_f32(i) + od::to_f32(v);
    float lo, hi, blo, bhi;
    od::unpack_f16x2(od::ld32_2(raw + 2 * i), lo, hi);
    od::unpack_bf16x2(od::ld16(raw) | 0u, blo, bhi);
    v += lo + hi + blo + bhi + od::fmax_nan(v, lo);
    od::store(ho + i, v);
    od::store(bo + i, v);
    const float2 s = od::block_sum<BLOCK>(float2{v, v * v});
    int total;
    const int scan = od::block_scan<BLOCK>(i, total) + total;
    const unsigned long long n = od::warp_sum(static_cast<unsigned long long>(i));
    od::store(out + i, od::block_sum<BLOCK>(s.x) + s.y + od::warp_max(v) + od::block_max<BLOCK>(v) + scan + n);
    od::st16(raw + 2 * i, od::f32_to_f16(v));
    od::st32_2(raw + 4 * i + 2, od::same_v<od::f16, od::bf16> ? 0u : 1u);
    __shared__ alignas(16) unsigned char stage[16 * BLOCK];
    od::cp_async16(od::smem_addr(stage + 16 * i), raw + 16 * i);
    od::cp_async16_zfill(od::smem_addr(stage + 16 * i), raw + 16 * i, i % 17);
    od::cp_async_commit();
    od::cp_async_wait<0>();
    for (od::Walk w(i, BLOCK, 3 + i % 5); w.row < 7; w.next()) {
        out[w.row] += static_cast<float>(w.col);
    }
    if (od::last_block(reinterpret_cast<int*>(raw), gridDim.x)) {
        out[i] += stage[16 * i];
    }
}

void* const instances[] = {(void*)&probe<32>, (void*)&probe<1024>};
"""

# Uses every accessor of quant.cuh for every format: kernels instantiate only the ones they use.
QUANT_PROBE = r"""
#include "quant.cuh"

template <class Q>
__global__ void probe(const unsigned char* row, unsigned char* dst, float* out, int* codes) {
    const int i = threadIdx.x;
    const unsigned char* blk = row + i * Q::BYTES;
    float y[32], f[8], c[8], d, m;
    od::quant::decode_block<Q>(blk, y);
    const float2 p = od::quant::decode_pair<Q>(blk, i % 16);
    od::quant::Raw8<Q> r;
    od::quant::fetch8<Q>(row, 8 * i, r);
    od::quant::decode8<Q>(r, 8 * i, f);
    od::quant::load_unit<Q>(row, i, c, d, m);
    unsigned w[(Q::BYTES + 1) / 4 + 1];
    for (int k = 0; k < (Q::BYTES + 1) / 4 + 1; ++k) {
        w[k] = reinterpret_cast<const unsigned*>(row)[i + k];
    }
    int q[8];
    float d2, m2;
    od::quant::decode_words<Q>(w, 16, q, d2, m2);
    float v = od::quant::decode<Q>(blk, i % 32) + p.x + p.y + d + m + d2 + m2;
    for (int k = 0; k < 8; ++k) {
        v += y[k] + y[31 - k] + f[k] + c[k] + q[k];
    }
    out[i] = v;
    const float x[4] = {v, y[0], y[1], y[2]};
    od::quant::encode8<Q>(x, i % 8, dst + (i / 8) * Q::BYTES, i < 16);
    float qd, qid;
    od::quant::q8_1::scale(fabsf(v), qd, qid);
    codes[i] = od::quant::q8_1::code(y[3], qid) + static_cast<int>(qd);
}

void* const instances[] = {(void*)&probe<od::quant::q4_0>, (void*)&probe<od::quant::q4_1>,
                           (void*)&probe<od::quant::q5_0>, (void*)&probe<od::quant::q5_1>,
                           (void*)&probe<od::quant::q8_0>};
"""


#: NVVM's optimizer off: the front end (templates, types, static_asserts) and ptxas (the PTX, inline asm) see every
#: instance as at full optimization, and the optimizer, which NVRTC runs on the GPU (the GPU tests), took most of the
#: time (mmvq_stream.cu's 244 instances in one process: 190 s, 71 s without it)
NVVM_OPT = ["-Xcicc", "-O0"]


def nvcc(source: Path, workdir: Path, kernels_dir: Path, arch: str | None = None) -> None:
    """Compile as load_module does: the shared headers and the kernel's own folder on the include path, for `arch`
    (the kernel file's kernels.source_arch: sm_90a) or sm_90 (NVVM's optimizer off: NVVM_OPT), device code only
    (-cubin: the front end, NVVM and ptxas, as NVRTC; no host compiler pass, which NVRTC never runs)."""
    target = [f"-gencode=arch=compute_{arch[3:]},code={arch}"] if arch else ["-arch=sm_90"]
    cmd = [NVCC, *target, "-std=c++17", *NVVM_OPT, f"-I{INCLUDE}", f"-I{kernels_dir}", "-cubin", str(source),
           "-o", str(workdir / "out.cubin")]
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
    parts = max(1, min(os.cpu_count() or 1, len(names) // 16))  # a header's parse per part: not for a few names

    def build(i: int) -> None:
        refs = "".join(f"    (void*)&{name},\n" for name in names[i::parts])
        folder = tmp_path / f"part{i}"
        folder.mkdir()
        wrapper = folder / f"instances_{cu.stem}.cu"
        wrapper.write_text(f'#include "{cu.resolve()}"\n\nvoid* const od_instances[] = {{\n{refs}    nullptr,\n}};\n')
        nvcc(wrapper, folder, cu.parent, source_arch(cu))

    with ThreadPoolExecutor(parts) as pool:
        list(pool.map(build, range(parts)))


@needs_nvcc
@pytest.mark.parametrize("probe", [COMMON_PROBE, QUANT_PROBE], ids=["common.cuh", "quant.cuh"])
def test_shared_header_compiles(probe: str, tmp_path: Path) -> None:
    source = tmp_path / "probe.cu"
    source.write_text(probe)
    nvcc(source, tmp_path, INCLUDE)
