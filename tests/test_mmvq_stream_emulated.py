"""cuda_matmul's mmvq_stream kernel run on the CPU: its real source, compiled by g++ against a host
emulation of the CUDA it uses (tests/cuda_emu/shim.h), on the launch specs the plugin binds.

No GPU is needed: every CUDA thread is a fiber (a block's threads take turns on one OS thread, in index order
between barriers: tests/cuda_emu/shim.h), __syncthreads / __syncwarp / the shuffles go through barriers, and cp.async copies land only at the wait_group that covers them ("lazy") or at
once ("eager"), so a stage read before its wait, a missing __syncwarp before a stage is refilled,
a wrong lane-to-chunk map, a wrong block decode or a row left unwritten shows as a wrong or NaN
result (shared memory and outputs start poisoned, 0xFF). The only edits to the source are the
inline PTX (f16 conversions, cp.async) swapped for host functions (tests/cuda_emu/hostcode.py).
Results are compared with the numpy reference by NMSE (docs/conformance.md's bounds: mul_mat's for the
weight format, twice it for a fused GLU) and, where b is a plain f32 input, with the reference run on
b rounded to q8_1 in numpy (quantize_q8_1's float32 math) by NMSE 1e-8: the kernel's only departure from the reference is that rounding (ggml's too),
so anything else shows (quant_k.cuh's formats too, their weights random valid blocks: their dot32
sums in another float order than the reference, well inside the bound). mul_mat_id's expert ids are
checked against an error word in the emulated memory (common.cuh's od::index_ok): zero after good ids,
the first bad id's tag, position and value after a bad one. On the H200 the same shapes run in
test_cuda_matmul.py.

Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.dtypes import from_float
from opdispatch.graph import Graph
from opdispatch.hookspecs import Device
from opdispatch.plugins.cuda_matmul import fusion, specs
from opdispatch.plugins.cuda_matmul.specs import mmv, stream
from opdispatch.tensor import Tensor
from opdispatch.testing.cases.base import bound
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import Arena, EMU, compile_emulator, gxx_major, q8_1_reference, write_headers
from helpers import biased, gate_up_glu, moe, residual, subscaled_blocks

NMSE_Q8_1 = 1e-8  # against the reference on b rounded to q8_1 as the kernel rounds it
VIEWS = ("view", "reshape", "permute", "transpose")
#: a small GPU, so that the grids have a few blocks and the warps several groups each
DEVICE = Device("cuda0", "cuda", "an emulated sm_90 GPU of 4 SMs",
                {"cc": (9, 0), "sm_count": 4, "smem_per_block_optin": 227 * 1024, "warp_size": 32})


pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")


def _mm(dt: str, m: int, k: int, n: int, tb: str = "f32", batch: tuple = (), bview: str | None = None,
        a_batch: tuple | None = None) -> Tensor:
    a = od.input("a", (*(batch if a_batch is None else a_batch), m, k), dt)
    if bview == "T":
        b = od.input("x", (*batch, k, n), tb).transpose()
    elif bview == "offset":
        x = od.input("x", (*batch, n, k + 1), tb)
        b = x.view((*batch, n, k), x.strides, x.dtype.block_bytes)
    else:
        b = od.input("x", (*batch, n, k), tb)
    return ops.mul_mat(a, b)


def _normed(dt: str, m: int, k: int, n: int, glu: bool = False) -> Tensor:
    """rms_norm(x) * w before a product (or a gate/up GLU pair): the fused rms_norm groups."""
    h = ops.mul(ops.rms_norm(od.input("x", (n, k)), 1e-5), od.input("nw", (k,)))
    if not glu:
        return ops.mul_mat(od.input("w", (m, k), dt), h)
    return ops.glu_split(ops.mul_mat(od.input("wg", (m, k), dt), h), ops.mul_mat(od.input("wu", (m, k), dt), h),
                         "swiglu")


DEFAULT = specs.STREAM
#: name: (graph, stream config, eager copies); each covers a part of the layout (stream.stream_layout)
CASES = {
    "q4_0 K256 one chunk a row (G 1, R 32)": (lambda: _mm("q4_0", 77, 256, 1), DEFAULT, False),
    "q8_0 K4096 two rows a stage (G 16)": (lambda: _mm("q8_0", 130, 4096, 2), DEFAULT, False),
    "q8_0 K8192 a warp a row (G 32, S 1)": (lambda: _mm("q8_0", 33, 8192, 1), DEFAULT, False),
    "q4_1 K4224 a partial second segment": (lambda: _mm("q4_1", 17, 4224, 1), DEFAULT, False),
    "q5_0 K14336 two segments, 2 stages": (lambda: _mm("q5_0", 21, 14336, 3), specs.StreamConfig(2, 2, 1), True),
    "q5_1 K64 N8, 4 stages 8 warps": (lambda: _mm("q5_1", 19, 64, 8), specs.StreamConfig(4, 8, 3), False),
    "q4_0 broadcast batches": (lambda: _mm("q4_0", 13, 256, 3, batch=(2, 3), a_batch=(1, 3)), DEFAULT, False),
    "q8_0 b f16 misaligned (scalar loads)": (lambda: _mm("q8_0", 29, 512, 3, tb="f16", bview="offset"), DEFAULT,
                                             False),
    "q4_1 b bf16 transposed": (lambda: _mm("q4_1", 29, 512, 3, tb="bf16", bview="T"), DEFAULT, True),
    "q5_0 bias": (lambda: biased("q5_0", 45, 512, 5), DEFAULT, False),
    "q4_0 residual N8 K4096": (lambda: residual("q4_0", 77, 4096, 8), DEFAULT, False),
    "q8_0 residual N3 padded rows over batches, K14336": (lambda: residual("q8_0", 21, 14336, 3, (2,), 5),
                                                          specs.StreamConfig(2, 2, 1), True),
    "glu q4_0 K4096 gate and up in a stage, bias":
        (lambda: gate_up_glu("q4_0", 77, 4096, 2, True, "swiglu_oai"), DEFAULT, False),
    "glu q8_0 K14336 gate then up segments, bias":
        (lambda: gate_up_glu("q8_0", 64, 14336, 1, True, "swiglu"), DEFAULT, False),
    "glu q5_1 K64 16 gate rows a stage": (lambda: gate_up_glu("q5_1", 41, 64, 3, False, "geglu"), DEFAULT, True),
    "mul_mat_id q4_0 3 of 8 experts": (lambda: moe("q4_0", 8, 45, 512, 1, 3, False, False), DEFAULT, False),
    "mul_mat_id q8_0 add_id, 2 stages 2 warps": (lambda: moe("q8_0", 4, 33, 4096, 1, 2, False, True),
                                                 specs.StreamConfig(2, 2, 1), False),
    "mul_mat_id glu q5_1 add_id": (lambda: moe("q5_1", 6, 19, 128, 1, 4, True, True), DEFAULT, True),
    "rms_norm q4_0 K2048 N1": (lambda: _normed("q4_0", 77, 2048, 1), DEFAULT, False),
    "rms_norm q8_0 K4096 N8, 2 warps": (lambda: _normed("q8_0", 33, 4096, 8), specs.StreamConfig(2, 2, 1), True),
    "rms_norm glu q4_0 K2048 N2": (lambda: _normed("q4_0", 45, 2048, 2, glu=True), DEFAULT, False),
}
#: rms_norm_mul_mat_share's launches (dt, m, k, n, config): its instances write the normed values, one column
SHARE_CASES = [("q4_0", 77, 2048, 1, DEFAULT), ("q8_0", 33, 4096, 1, specs.StreamConfig(2, 2, 1)),
               ("q6_K", 45, 2048, 1, DEFAULT)]
#: quant_k.cuh's formats: rows of one chunk (R 32 for the 1-block chunks), of several, long rows of two
#: segments (three, the third partial, for iq4_xs / mxfp4's half pieces), every epilogue, mul_mat_id; N from 1 to
#: 8 over the formats
#: (each format its own N of the several-chunk and bias cases, so that the instances stay few)
K_FORMATS = tuple(stream.STREAM_K_FORMATS)
K_LONG = {"iq4_xs": 33 * 512, "mxfp4": 33 * 512, "iq1_m": 33 * 512}  # else 14336: 56 pieces of 256 values
#: the cases the grid I-quants skip (their dot32_in still meets every layout; the emulation's time): what they
#: add is the kernel's, which the other formats' cases cover
GRID_SKIPS = ("rows of 7 chunks", "bias, N", "3 of 4 experts", "rms_norm")


def _k_cases(dt: str, i: int) -> dict:
    rv = stream.stream_geo(dt).row_values
    long_k = K_LONG.get(dt, 14336)
    two = specs.StreamConfig(2, 2, 1)
    return {
        f"{dt} rows of one chunk, N 1": (lambda: _mm(dt, 77, rv, 1), DEFAULT, i % 2 == 1),
        f"{dt} rows of 7 chunks, N {3 + i % 2}": (lambda: _mm(dt, 45, 7 * rv, 3 + i % 2), DEFAULT, False),
        f"{dt} K{long_k} two segments, N 8, 2 warps": (lambda: _mm(dt, 19, long_k, 8), two, True),
        f"{dt} bias, N {5 + i % 3}": (lambda: biased(dt, 45, 2 * rv, 5 + i % 3), DEFAULT, False),
        f"glu {dt} gate and up in a stage, bias": (lambda: gate_up_glu(dt, 37, rv, 2, True, "swiglu_oai"), DEFAULT,
                                                   False),
        f"glu {dt} K{long_k} gate then up segments": (lambda: gate_up_glu(dt, 21, long_k, 2, False, "geglu"), two,
                                                     i % 2 == 0),
        f"mul_mat_id {dt} 3 of 4 experts": (lambda: moe(dt, 4, 33, 2 * rv, 1, 3, False, False), DEFAULT, False),
        f"mul_mat_id glu {dt} add_id": (lambda: moe(dt, 6, 19, rv, 1, 2, True, True), DEFAULT, True),
        f"rms_norm {dt} rows of 4 chunks, N {1 + i % 3}": (lambda: _normed(dt, 29, 4 * rv, 1 + i % 3), DEFAULT,
                                                           i % 2 == 0),
    }


for _i, _dt in enumerate(K_FORMATS):
    CASES.update({k: v for k, v in _k_cases(_dt, _i).items()
                  if _dt not in specs.GRID_NAMES or not any(skip in k for skip in GRID_SKIPS)})
#: RAGGED: rows that are not whole chunks (one column): rows off 16-byte boundaries, a partial last piece; the
#: formats of specs.RAGGED_TYPES only (the legacy formats' such rows run on mmvq, which the emulation does not run)
CASES.update({
    "ragged mxfp4 K2880 (gpt-oss), half pieces": (lambda: _mm("mxfp4", 37, 2880, 1), DEFAULT, False),
    "ragged iq4_nl K96 (R 32: one partial piece a row)": (lambda: _mm("iq4_nl", 40, 96, 1), DEFAULT, True),
    "ragged iq4_nl K2880 bias (rows 4 bytes off)": (lambda: biased("iq4_nl", 45, 2880, 1), DEFAULT, False),
    "ragged glu q6_K K3584 (one-block pieces), bias": (lambda: gate_up_glu("q6_K", 21, 3584, 1, True, "swiglu"),
                                                       DEFAULT, False),
    "ragged iq4_xs K768": (lambda: _mm("iq4_xs", 19, 768, 1), specs.StreamConfig(2, 2, 1), True),
    "ragged q2_K K768 residual": (lambda: residual("q2_K", 23, 768, 1), DEFAULT, False),
    "ragged q3_K K18688 three segments": (lambda: _mm("q3_K", 13, 18688, 1), specs.StreamConfig(2, 2, 1), False),
    "ragged mul_mat_id mxfp4 K2880 3 of 4 experts": (lambda: moe("mxfp4", 4, 33, 2880, 1, 3, False, False),
                                                      DEFAULT, False),
    "ragged rms_norm q6_K K3584": (lambda: _normed("q6_K", 29, 3584, 1), DEFAULT, False),
    # rows of an odd byte count (45 blocks of 17 bytes): every lead 0..15, shifts of 1 and 3 bytes
    "ragged mxfp4 K1440 odd row bytes": (lambda: _mm("mxfp4", 35, 1440, 1), DEFAULT, False),
    "ragged iq1_m K2816 (rows 8 bytes off, 2-block pieces)": (lambda: _mm("iq1_m", 27, 2816, 1), DEFAULT, False),
})
CASES.update({  # b f16 / bf16 (unfused mul_mat only: 8-column instances), if the formats exist
    f"{dt} b {tb} {view}": (lambda dt=dt, tb=tb, view=view: _mm(dt, 29, 2 * stream.stream_geo(dt).row_values, 3,
                                                                 tb=tb, bview=view), DEFAULT, False)
    for dt, tb, view in (("q6_K", "bf16", "T"), ("iq4_xs", "f16", "offset")) if dt in K_FORMATS})


def _transformed(build: Path) -> None:
    """The kernel and its headers, inline PTX swapped for shim.h's host functions (the shared
    headers' by hostcode.write_headers; the kernel and mm_common.cuh have none)."""
    write_headers(build)
    (build / "mm_common.cuh").write_text(specs.KERNELS_DIR.joinpath("mm_common.cuh").read_text())
    src = specs.MMVQ_STREAM_CU.read_text()
    shared = "extern __shared__ uint4 smem_u4[];"
    assert shared in src
    src = src.replace(shared, "uint4* smem_u4 = reinterpret_cast<uint4*>(emu_ctx->smem);")
    for name, text in (("mm_common.cuh", (build / "mm_common.cuh").read_text()), ("mmvq_stream.cu", src)):
        assert "asm" not in text, f"{name} has inline PTX the emulation does not replace"
    (build / "mmvq_stream.cu").write_text(src)


def q8_1_rounded(x: np.ndarray) -> np.ndarray:
    """x (f32, last axis a multiple of 32) rounded as quantize_q8_1 does, per 32 values along the
    last axis: the q8_1 codes times their block's d (float32 math)."""
    codes, d = q8_1_reference(x)
    return (codes.astype(np.float32) * d[..., None]).reshape(x.shape)


def _nodes(y: Tensor) -> list[Tensor]:
    return [n for n in Graph.build(y).nodes if n.op not in VIEWS]


def _specs(y: Tensor, arena: Arena, cfg: specs.StreamConfig, share: bool = False) -> list[KernelSpec]:
    nodes = _nodes(y)
    if len(nodes) > 1:
        assert fusion.check(DEVICE, nodes, Graph.build(y)) is True
    prods, biases, glu = fusion.parts(nodes)
    kw = dict(a1=prods[1].srcs[0] if glu else None, bias0=biases[0], bias1=biases[1] if glu else None, glu=glu,
              device=DEVICE, stream=cfg)
    if prods[0].op == "mul_mat":
        return mmv.mmv_specs(prods[0], nodes[-1], arena.ptr, arena.scratch, norm=fusion.norm_of(nodes, share),
                             bias_col=fusion.bias_col(prods[0], biases[0]), **kw)
    return mmv.mmv_id_specs(prods[0], nodes[-1], arena.ptr, arena.scratch, arena.guard, **kw)


def _instance(y: Tensor, cfg: specs.StreamConfig, share: bool = False) -> str:
    nodes = _nodes(y)
    (first, *_), biases, glu = fusion.parts(nodes)
    epi = specs.EPI_GLU if glu is not None else (specs.EPI_BIAS if biases[0] is not None else specs.EPI_NONE)
    tb = first.srcs[1].dtype.name
    n = 1 if first.op == "mul_mat_id" else first.shape[-2]  # mul_mat_id: one column a (token, slot)
    dt = first.srcs[0].dtype.name
    return specs.stream_name(dt, tb, specs.nt_for(n, specs.quant_nts(dt)) if tb == "f32" else 8, epi, cfg.stages,
                             share, stream.ragged(dt, first.srcs[0].shape[-1]))


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("mmvq_stream_emu")
    _transformed(build)
    (build / "main.cpp").write_text((EMU / "main.cpp").read_text())
    names = sorted({_instance(make(), cfg) for make, cfg, _ in CASES.values()} |
                   {_instance(_normed(*case[:4]), case[4], share=True) for case in SHARE_CASES})
    (build / "instances.inc").write_text("".join(f'    {{"{n}", &{n}}},\n' for n in names))
    # -O0: the instances build in a third of -O1's time, more than the slower runs give back (93 -> 62 CPU s)
    return compile_emulator(build / "main.cpp", build / "emu", "-O0")


def _feeds(y: Tensor, rng: np.random.Generator) -> dict[Tensor, np.ndarray]:
    """Random inputs: floats in [-1, 1), mul_mat_id's ids valid expert numbers; quant_k.cuh's formats as
    random valid blocks (raw bytes, scales about 0.01; opdispatch's quantizers are slow at these sizes)."""
    graph = Graph.build(y)
    n_exp = next((n.srcs[0].shape[0] for n in graph.nodes if n.op == "mul_mat_id"), 0)
    feeds = {}
    for t in graph.inputs:
        if t.dtype.is_int:
            feeds[t] = rng.integers(0, n_exp, t.shape).astype(np.int32)
        elif t.dtype.name in stream.STREAM_K_FORMATS:
            qk, nbytes = t.dtype.block_size, t.dtype.block_bytes
            raw = subscaled_blocks(rng, t.dtype.name, t.size // qk, e_range=(105, 120), scale=0.001)
            feeds[t] = raw.reshape(*t.shape[:-1], t.shape[-1] // qk * nbytes)
        else:
            feeds[t] = rng.uniform(-1, 1, t.shape).astype(np.float32)
    return feeds


def _bound(y: Tensor) -> float:
    """The NMSE bound of `y`'s product against the plain reference (docs/conformance.md): mul_mat's for its weight
    format (wider for q2_K, q4_K, q5_K), twice it for a fused GLU (two products, each off by b's rounding)."""
    (first, *_), _, glu = fusion.parts(_nodes(y))
    return bound("mul_mat", weight=first.srcs[0].dtype.name) * (2 if glu is not None else 1)


def _emulate(y: Tensor, feeds: dict, cfg: specs.StreamConfig, eager: bool, emulator: Path, tmp_path: Path
             ) -> tuple[np.ndarray, str, np.ndarray]:
    """The output of the one mmvq_stream launch the plugin binds for `y` (its memory poisoned first), run
    by the emulator, a description of the launch and the error word after it."""
    read, launch, word = _run(y, feeds, cfg, eager, emulator, tmp_path)
    return read(_nodes(y)[-1]), launch, word


def _run(y: Tensor, feeds: dict, cfg: specs.StreamConfig, eager: bool, emulator: Path, tmp_path: Path,
         share: bool = False) -> tuple[Callable[[Tensor], np.ndarray], str, np.ndarray]:
    """`_emulate`'s launch (`share`: with a fused norm, writing the normed values too), giving a reader of any
    node's memory after it instead of the output."""
    graph = Graph.build(y)
    arena = Arena(sum(t.base.nbytes + 256 for t in (*graph.leafs, *graph.nodes)) + 4096)
    for leaf in graph.leafs:
        if leaf in feeds:
            raw = leaf.dtype.is_int or feeds[leaf].dtype == np.uint8  # ids, or blocks as bytes
            arena.place(leaf, feeds[leaf] if raw else from_float(leaf.dtype.name, feeds[leaf]))
        else:
            arena.place(leaf, leaf.data)
    for n in graph.nodes:
        arena.place(n, None)  # poisoned: NaN floats
    (spec,) = _specs(y, arena, cfg, share)
    assert spec.kernel == _instance(y, cfg, share)
    mem_file = tmp_path / "mem.bin"
    arena.mem.tofile(mem_file)
    grid = tuple(spec.grid) + (1,) * (3 - len(spec.grid))
    cmd = [str(emulator), str(mem_file), spec.kernel, *map(str, grid), str(spec.block), str(spec.smem), str(int(eager)),
           *(str(a.item()) for a in spec.arg_values)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    mem = np.fromfile(mem_file, np.uint8)

    def read(node: Tensor) -> np.ndarray:
        at = arena.ptr(node)
        return mem[at:at + node.nbytes].view(np.float32).reshape(node.shape)

    return read, f"{spec.kernel} grid {spec.grid} block {spec.block} smem {spec.smem}", np.array(arena.word(mem))


@pytest.mark.parametrize("case", list(CASES))
def test_mmvq_stream_emulated(case: str, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    make, cfg, eager = CASES[case]
    y = make()
    feeds = _feeds(y, rng)
    got, launch, word = _emulate(y, feeds, cfg, eager, emulator, tmp_path)
    (ref,) = od.compile(y, "cpu").run(feeds)
    what = f"{case}: {launch}"
    assert not word.any(), f"{what}: error word {word} set by valid ids"
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (unwritten, or read before landing)"
    assert nmse(got, ref) <= _bound(y), f"{what}: NMSE {nmse(got, ref):.3g}"
    nodes = _nodes(y)
    b = fusion.parts(nodes)[0][0].srcs[1]
    if b in feeds and b.dtype.name == "f32":  # b a plain f32 input: the kernel's rounding of it, exactly
        (model,) = od.compile(y, "cpu").run({**feeds, b: q8_1_rounded(feeds[b])})
        assert nmse(got, model) <= NMSE_Q8_1, f"{what}: NMSE {nmse(got, model):.3g} against b rounded to q8_1"
    norm = fusion.norm_of(nodes)
    if norm is not None and nodes[-1].op == "mul_mat":  # the kernel's math: x * w rounded to q8_1, then the scale
        x = feeds[norm.x]
        scale = 1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + norm.eps)
        a = nodes[-1].srcs[0]
        (raw,) = od.compile(ops.mul_mat(a, norm.x), "cpu").run({a: feeds[a], norm.x: q8_1_rounded(x * feeds[norm.w])})
        model = raw * scale
        assert nmse(got, model) <= NMSE_Q8_1, f"{what}: NMSE {nmse(got, model):.3g} against x * w rounded to q8_1"


@pytest.mark.parametrize(("dt", "m", "k", "n", "cfg"), SHARE_CASES)
def test_norm_share_writes_the_normed_values(dt: str, m: int, k: int, n: int, cfg: specs.StreamConfig,
                                             emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    """rms_norm_mul_mat_share's launch (the rms_norm cases' instances): the product as without sharing, and
    every normed value rms_norm(x) * w written to the mul node's memory (poisoned first) by the blocks between
    them, to float rounding."""
    y = _normed(dt, m, k, n)
    feeds = _feeds(y, rng)
    read, launch, _ = _run(y, feeds, cfg, False, emulator, tmp_path, share=True)
    mul = _nodes(y)[1]
    (ref, normed) = od.compile([y, mul], "cpu").run(feeds)
    got = read(mul)
    assert np.isfinite(got).all(), f"{launch}: normed values left unwritten"
    assert nmse(got, normed) <= 1e-12, f"{launch}: normed values NMSE {nmse(got, normed):.3g}"
    assert nmse(read(y), ref) <= _bound(y), f"{launch}: product NMSE {nmse(read(y), ref):.3g}"


@pytest.mark.parametrize(("dt", "bad", "slot"), [
    ("q4_0", [5, 8, 2], 1), ("q4_0", [-1, 3, 2], 0), ("q4_0", [5, 0, -2**31], 2),
    # the new formats (4 experts): one bad id (4 or -7) in slot i % 3 of 3
    *((dt, [(4 if i % 2 else -7) if s == i % 3 else 3 - s for s in range(3)], i % 3) for i, dt in enumerate(K_FORMATS)),
])
def test_mul_mat_id_expert_out_of_range_writes_nan(dt: str, bad: list[int], slot: int, emulator: Path,
                                                   tmp_path: Path, rng) -> None:  # noqa: ANN001
    """An id outside [0, E) gives its slot NaN rows (the CPU reference raises) and sets the error word to
    (tag + 1, its position, its value); the other slots are right."""
    n_exp = 8 if dt == "q4_0" else 4
    y = moe(dt, n_exp, 45, 512, 1, 3, False, False) if dt == "q4_0" else moe(
        dt, n_exp, 33, 2 * stream.stream_geo(dt).row_values, 1, 3, False, False)  # instances CASES builds
    feeds = _feeds(y, rng)
    ids = next(t for t in feeds if t.dtype.is_int)
    feeds[ids] = np.array([bad], np.int32)
    got, launch, word = _emulate(y, feeds, DEFAULT, False, emulator, tmp_path)
    good = [e if i != slot else 0 for i, e in enumerate(bad)]
    (ref,) = od.compile(y, "cpu").run({**feeds, ids: np.array([good], np.int32)})
    assert np.isnan(got[0, slot]).all(), f"{launch}: slot {slot} (expert {bad[slot]} of {n_exp}) not NaN"
    others = [i for i in range(3) if i != slot]
    assert nmse(got[0, others], ref[0, others]) <= _bound(y), f"{launch}: the valid slots"
    assert list(word) == [Arena.TAG + 1, slot, bad[slot], 0]


def test_nan_in_b_gives_its_column_nan_rows(emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    """A NaN in one column of b reaches every row of that column's output (its q8_1 block's scale is
    NaN), not a code of 0; the other column is right."""
    y = _mm("q8_0", 130, 4096, 2)  # an instance CASES builds
    feeds = _feeds(y, rng)
    b = _nodes(y)[0].srcs[1]
    feeds[b][1, 1000] = np.nan
    got, launch, _ = _emulate(y, feeds, DEFAULT, False, emulator, tmp_path)
    (ref,) = od.compile(y, "cpu").run(feeds)
    assert np.isnan(ref[1]).all()
    assert np.isnan(got[1]).all(), f"{launch}: {np.isfinite(got[1]).sum()} finite outputs in b's NaN column"
    assert nmse(got[0], ref[0]) <= _bound(y), f"{launch}: the other column"


def test_cases_cover_the_layouts() -> None:
    """The cases above reach every kind of stage for every format: R 32 or R >= 2, and R 1 with 1 (the
    legacy formats) and several segments, with and without GLU, and more than one block; each new format
    with N from 1 to 8 in a column count of each compiled instance."""
    seen: dict[str, set] = {}
    for make, cfg, _ in CASES.values():
        nodes = _nodes(make())
        a = fusion.parts(nodes)[0][0].srcs[0]
        lay = stream.stream_layout(a.dtype.name, a.shape[-1], nodes[-1].op == "glu")
        seen.setdefault(a.dtype.name, set()).add((min(lay.R, 2), min(lay.S, 2), nodes[-1].op == "glu"))
    every = set().union(*seen.values())
    assert {(2, 1, False), (1, 1, False), (1, 2, False), (2, 1, True), (1, 2, True)} <= every, every
    for dt in K_FORMATS:
        assert {(2, 1, False), (1, 2, False), (2, 1, True), (1, 2, True)} <= seen[dt], (dt, seen[dt])
