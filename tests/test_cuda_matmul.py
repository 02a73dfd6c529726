"""The cuda_matmul plugin.

Without a GPU: which path (Kernel name) each shape and dtype takes on a
device description, the declines and their reasons, which fusions match and
which do not (and why); the mat-vec launch specs against mmv.cu's kernel
signatures; and the cuBLAS call specs (column-major arguments, batching,
folded broadcasts, conversions) executed by a numpy emulation of cuBLAS and of
the conversion kernels, against the numpy reference.

On a GPU: the mul_mat sweep (every weight dtype, n in 1..9, 16, 128, 512,
broadcast batch ratios, permuted / transposed / offset b, odd K), mul_mat_id,
out_prod, the fused patterns against the reference and against unfused runs,
poisoned outputs, and CUDA-graph replay == direct launches, each by NMSE
(docs/conformance.md: 5e-4 for the matrix products).

Random inputs come from a fresh seed each run, printed on failure; set
OPDISPATCH_TEST_SEED to replay one.
"""

from __future__ import annotations

import inspect
import itertools
import re
from typing import Callable

import attrs
import ml_dtypes
import numpy as np
import pytest

import opdispatch as od
import opdispatch.plugins.cuda_matmul as cm
from opdispatch import ops
from opdispatch.backends.cuda.devices import H200
from opdispatch.backends.cuda.kernels import INCLUDE_DIR, KernelSpec, kernel_param_types
from opdispatch.dtypes import DTYPES, dequantize, encodable, from_float
from opdispatch.ops.base import BLOCK_FORMATS
from opdispatch.ops.elementwise import GLU_KINDS
from opdispatch.quants.iq_grids import TABLES
from opdispatch.quants.samples import random_blocks
from opdispatch.errors import DeviceIndexError
from opdispatch.graph import Graph
from opdispatch.hookspecs import Device
from opdispatch.plugins.cuda_matmul import bind, fusion, specs, support
from opdispatch.plugins.cuda_matmul.specs import gemm, mmf, mmq, mmq_id, mmq_small, mmq_wgmma, mmv, stream
from opdispatch.plugins.cuda_matmul.specs.gemm import GemmSpec
from opdispatch.tensor import Tensor
from opdispatch.testing.harness import Status, run_case
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import q8_1_reference
from helpers import FAKE_WORD, FakeGuard, assert_graph_segments, edge_cases, gate_up_glu, moe, subscaled_blocks

gpu = pytest.mark.gpu

CPU = Device("cpu", "cpu")
NMSE_MAX = 5e-4  # docs/conformance.md: mul_mat, mul_mat_id, out_prod
FLOATS = ("f32", "f16", "bf16")
QUANTS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
MATMUL_OPS = ("mul_mat", "mul_mat_id", "out_prod")


def steps_of(plan: od.Plan, op: str) -> list:
    return [s for s in plan.steps if s.kind in ("kernel", "fused") and s.nodes[0].op == op]


def weight(name: str, shape: tuple, dtype: str, seed: int = 0) -> Tensor:
    return od.param(name, np.random.default_rng(seed).uniform(-1, 1, shape).astype(np.float32), dtype)


def zero_weight(name: str, shape: tuple, dtype: str) -> Tensor:
    """A weight of `dtype` and `shape` holding zero bytes: for the selection and launch-spec tests, which read
    shapes only (quantizing random values of the large shapes takes seconds)."""
    rows = int(np.prod(shape[:-1]))
    return od.param(name, np.zeros(rows * DTYPES[dtype].row_bytes(shape[-1]), np.uint8), dtype, shape=shape)


# -- the plugin, without a GPU ---------------------------------------------------------------


def test_kernels_and_rules_are_for_cuda_devices_only() -> None:
    assert list(cm.kernels(device=CPU)) == [] and list(cm.fusion_rules(device=CPU)) == []
    names = [(k.op, k.name) for k in cm.kernels(device=H200)]
    assert names == [(op, path) for op, path, _ in bind.PATHS]
    assert [r.name for r in cm.fusion_rules(device=H200)] == [name for name, _ in fusion.PATTERNS]


PATH_CASES = [
    # (a dtype, a shape, b shape, path)
    ("f32", (64, 96), (1, 96), "mmvf"),
    ("f16", (64, 96), (8, 96), "mmvf"),
    ("bf16", (64, 65), (3, 65), "mmvf"),
    ("f16", (64, 96), (9, 96), "mmf"),  # support.MMF_MIN_N
    ("bf16", (2, 64, 96), (2, 16, 96), "mmf"),
    ("bf16", (64, 100), (16, 100), "cublas"),  # K % 8 != 0: mmf declines
    ("f16", (64, 96), (17, 96), "cublas"),
    ("f32", (64, 96), (12, 96), "cublas"),  # mmf takes f16/bf16 weights
    ("bf16", (2, 64, 96), (2, 512, 96), "cublas"),
    ("f32", (64, 80), (128, 80), "cublas"),
    ("q4_0", (64, 96), (1, 96), "mmvq"),  # K % 256 != 0: a legacy format, no RAGGED instance
    ("mxfp4", (64, 2880), (1, 2880), "mmvq_stream"),  # K % 512 != 0: the RAGGED instances (one column)
    ("mxfp4", (64, 2880), (2, 2880), "mmvq"),  # ... more columns take mmvq
    ("q6_K", (64, 3584), (1, 3584), "mmvq_stream"),  # K % 2048 != 0, RAGGED
    ("q5_1", (64, 96), (8, 96), "mmvq"),  # K % 64 != 0
    ("q4_0", (64, 4096), (1, 4096), "mmvq_stream"),
    ("q8_0", (64, 14336), (8, 14336), "mmvq_stream"),
    ("q4_1", (64, 128), (3, 128), "mmvq_stream"),
    ("q5_0", (3, 64, 256), (6, 2, 256), "mmvq_stream"),
    ("q5_1", (64, 64), (1, 64), "mmvq_stream"),
    ("q4_0", (64, 4128), (1, 4128), "mmvq"),  # K % 256 != 0 (legacy: no RAGGED instance)
    ("q4_1", (64, 4160), (1, 4160), "mmvq"),  # K % 128 != 0
    ("q8_0", (64, 65536), (8, 65536), "mmvq"),  # b's q8_1 copy does not fit in shared memory
    ("q8_0", (64, 96), (9, 96), "dequant_cublas"),  # K % 256 != 0: mmq declines; K % 64 != 0: mmq_wgmma too
    ("q4_1", (64, 96), (512, 96), "dequant_cublas"),  # K % 128 != 0
    ("q4_0", (64, 4096), (9, 4096), "mmq_small"),
    ("q4_0", (64, 4096), (32, 4096), "mmq_small"),
    ("q4_0", (64, 4096), (33, 4096), "mmq"),
    ("q8_0", (77, 256), (16, 256), "mmq_small"),
    ("q8_0", (4096, 4096), (16, 4096), "mmq_small"),
    ("q8_0", (2, 64, 14336), (2, 64, 14336), "mmq"),
    ("q8_0", (2, 64, 14336), (2, 65, 14336), "mmq_wgmma"),  # N >= support.MMQ_WGMMA_MIN_N (q8_0 selected)
    ("q4_0", (64, 4096), (128, 4096), "mmq_wgmma"),
    ("q8_0", (2, 64, 14336), (2, 512, 14336), "mmq_wgmma"),  # N > support.MMQ_MAX_N
    ("q4_K", (2, 64, 14336), (2, 512, 14336), "dequant_cublas"),  # N > support.MMQ_MAX_N, support.MMQ_WGMMA_MIN_VALUES
    ("q4_1", (64, 128), (16, 128), "mmq_small"),
    ("q4_1", (64, 128), (40, 128), "mmq"),
    ("q5_1", (64, 64), (70, 64), "mmq"),
    ("q4_K", (64, 256), (16, 256), "mmq_small"),
    ("q5_K", (2, 64, 512), (2, 128, 512), "mmq"),  # a weight under support.MMQ_WGMMA_MIN_VALUES
    ("q6_K", (64, 2048), (9, 2048), "mmq_small"),
    ("q6_K", (64, 2048), (64, 2048), "mmq"),
    ("q6_K", (64, 256), (9, 256), "dequant_cublas"),  # K % 2048 != 0: q6_K rows of whole 1680-byte chunks
    ("q4_K", (64, 256), (129, 256), "dequant_cublas"),  # N > support.MMQ_MAX_N, support.MMQ_WGMMA_MIN_VALUES
]

#: with mmq_wgmma selected (wgmma_selected): the products mmq declines, where its own conditions hold
WGMMA_PATH_CASES = [
    ("q8_0", (2, 64, 14336), (2, 512, 14336), "mmq_wgmma"),  # N > support.MMQ_MAX_N
    ("q4_K", (64, 256), (129, 256), "mmq_wgmma"),
    ("q4_0", (64, 4128), (512, 4128), "dequant_cublas"),  # K % 64 != 0 (mmq_wgmma's K tile)
    ("iq4_xs", (64, 256), (16, 256), "dequant_cublas"),  # K % 512 != 0: both GEMMs decline (their raw stages)
    ("q6_K", (64, 2048), (64, 2048), "mmq"),  # mmq takes it
]


@pytest.fixture
def wgmma_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmq_wgmma takes every format's products that mmq declines, whatever support.MMQ_WGMMA_TYPES (the formats
    where it is faster than dequant_cublas) says."""
    select_wgmma(monkeypatch)


def select_wgmma(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "MMQ_WGMMA_TYPES", specs.QUANT_NAMES)
    monkeypatch.setattr(support, "MMQ_WGMMA_MIN_VALUES", {})


def test_mmq_wgmma_takes_the_selected_formats() -> None:
    """By default the RS formats' many-column products take mmq_wgmma (the K-quants' from
    support.MMQ_WGMMA_MIN_VALUES weight values); q4_1's stay on dequant_cublas, the note says why."""
    big, small = (2048, 8192), (2048, 4096)  # 2^24 and 2^23 values
    assert big[0] * big[1] == max(support.MMQ_WGMMA_MIN_VALUES.values())
    for dt in mmq_wgmma.RS_FORMATS:
        for shape in (big, small):
            x = ops.mul_mat(zero_weight("w", shape, dt), od.input("x", (512, shape[1])))
            least = support.MMQ_WGMMA_MIN_VALUES.get(dt, 0)
            assert support.choose(x, H200).path == ("mmq_wgmma" if shape[0] * shape[1] >= least else
                                                    "dequant_cublas"), (dt, shape)
    y = ops.mul_mat(zero_weight("w", small, "q4_K"), od.input("x", (512, small[1])))
    assert support.choose(y, H200).note.endswith(
        "mmq_wgmma: not selected for q4_K weights of 2048 x 4096 values (support.MMQ_WGMMA_MIN_VALUES: from "
        "16777216; dequant_cublas is faster below)")
    y = ops.mul_mat(zero_weight("w", small, "q4_K"), od.input("x", (128, small[1])))
    assert support.choose(y, H200).path == "mmq"  # where mmq_wgmma is not selected, mmq keeps its columns
    y = ops.mul_mat(weight("w", (64, 14336), "q4_1"), od.input("x", (512, 14336)))
    c = support.choose(y, H200)
    assert c.path == "dequant_cublas"
    assert c.note.endswith("mmq_wgmma: not selected for q4_1 (support.MMQ_WGMMA_TYPES: not faster than "
                           "dequant_cublas)")


@pytest.mark.usefixtures("wgmma_selected")
@pytest.mark.parametrize(("dt", "a_shape", "b_shape", "path"), WGMMA_PATH_CASES)
def test_mul_mat_path_with_mmq_wgmma_selected(dt: str, a_shape: tuple, b_shape: tuple, path: str) -> None:
    test_mul_mat_path_by_dtype_and_batch(dt, a_shape, b_shape, path)


@pytest.mark.usefixtures("wgmma_selected")
def test_mmq_decline_reason_is_explained() -> None:
    """A block-format node mmq and mmq_wgmma decline runs dequant_cublas, and the mmq kernel says why both
    declined."""
    node = ops.mul_mat(weight("w", (64, 96), "q8_0"), od.input("x", (16, 96)))
    (k,) = [k for k in cm.kernels(device=H200) if k.name == "mmq"]
    assert k.supports(H200, node) == "dequant_cublas takes it (mmq: K=96 is not a multiple of 256 (rows of whole " \
        "272-byte chunks); mmq_wgmma: K=96 is not a multiple of 64 (mmq_wgmma's K tile))"


@pytest.mark.usefixtures("wgmma_selected")
def test_mmq_wgmma_needs_compute_capability_9_0() -> None:
    """wgmma is sm_90a code: another device's many-column product runs dequant_cublas, and the note says why."""
    a100 = Device("cuda0", "cuda", "an sm_80 GPU", {**H200.props, "cc": (8, 0)})
    y = ops.mul_mat(weight("w", (64, 14336), "q4_0"), od.input("x", (512, 14336)))
    assert support.choose(y, H200).path == "mmq_wgmma"
    c = support.choose(y, a100)
    assert c.path == "dequant_cublas"
    assert c.note.endswith("mmq_wgmma: wgmma needs compute capability 9.0 (sm_90a code), not 8.0")


@pytest.fixture
def mmf_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmf takes 9..16 columns, whatever support.MMF_MIN_N (still to be set on the H200) says."""
    monkeypatch.setattr(support, "MMF_MIN_N", support.MMV_MAX_N + 1)


@pytest.fixture
def mmq_small_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmq_small takes 9..support.MMQ_SMALL_MAX_N columns, whatever support.MMQ_SMALL_MIN_N (off until it is
    tuned) says."""
    monkeypatch.setattr(support, "MMQ_SMALL_MIN_N", support.MMV_MAX_N + 1)


@pytest.fixture
def mmq_any_n(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmq takes every column count above the mat-vecs' (the default stops at support.MMQ_MAX_N, and gives
    9 .. support.MMQ_SMALL_MAX_N columns to mmq_small)."""
    monkeypatch.setattr(support, "MMQ_MAX_N", 2**31)
    monkeypatch.setattr(support, "MMQ_WGMMA_MIN_N", 2**31)  # mmq_wgmma only where mmq declines
    monkeypatch.setattr(support, "MMQ_SMALL_MAX_N", support.MMV_MAX_N)


@pytest.mark.usefixtures("mmf_selected")
@pytest.mark.parametrize(("dt", "a_shape", "b_shape"), [("f16", (64, 96), (9, 96)), ("bf16", (2, 64, 96), (2, 16, 96))])
def test_mmf_path_when_selected(dt: str, a_shape: tuple, b_shape: tuple) -> None:
    y = ops.mul_mat(weight("w", a_shape, dt), od.input("x", b_shape))
    (step,) = steps_of(od.compile(y, H200), "mul_mat")
    assert (step.plugin, step.kernel) == ("cuda_matmul", "mmf")


@pytest.mark.usefixtures("mmf_selected")
def test_mmf_declines_where_its_shared_memory_does_not_fit() -> None:
    """A device of 99 KB of shared memory a block (sm_86 / sm_89) cannot hold mmf's rings and b's split: the
    product goes to cuBLAS, and the reason names both sizes; the H200 takes it."""
    small = Device("cuda0", "cuda", "an sm_86 GPU", {**H200.props, "cc": (8, 6), "smem_per_block_optin": 99 * 1024})
    y = ops.mul_mat(weight("w", (2048, 2048), "bf16"), od.input("x", (16, 2048)))
    need = mmf.smem_bytes(16, mmf.node_split(y, small).ks)
    assert need > 99 * 1024
    assert support.mmf_ok(y, small) == f"mmf needs {need} bytes of shared memory a block, the device allows {99 * 1024}"
    assert support.choose(y, small).path == "cublas"
    assert support.mmf_ok(y, H200) is True and support.choose(y, H200).path == "mmf"


@pytest.mark.usefixtures("wgmma_selected")
def test_mmq_stops_at_its_crossover() -> None:
    node = ops.mul_mat(weight("w", (64, 14336), "q4_0"), od.input("x", (support.MMQ_MAX_N + 1, 14336)))
    assert support.choose(node, H200).note == f"mmq: N={support.MMQ_MAX_N + 1} > {support.MMQ_MAX_N}: " \
        "mmq_wgmma or dequant_cublas is faster there"


@pytest.mark.parametrize(("dt", "a_shape", "b_shape", "path"), PATH_CASES)
def test_mul_mat_path_by_dtype_and_batch(dt: str, a_shape: tuple, b_shape: tuple, path: str) -> None:
    y = ops.mul_mat(weight("w", a_shape, dt), od.input("x", b_shape))
    plan = od.compile(y, H200)
    (step,) = steps_of(plan, "mul_mat")
    assert (step.plugin, step.kernel, step.device.name) == ("cuda_matmul", path, "cuda0")
    assert f"cuda_matmul:{path} on cuda0" in plan.explain()


MMQ_SMALL_PATH_CASES = [
    ("q4_0", (64, 4096), (9, 4096), "mmq_small"),
    ("q4_0", (64, 4096), (32, 4096), "mmq_small"),
    ("q4_0", (64, 4096), (33, 4096), "mmq"),  # N > support.MMQ_SMALL_MAX_N
    ("q8_0", (77, 256), (16, 256), "mmq_small"),  # M any
    ("q4_1", (64, 128), (16, 128), "mmq_small"),
    ("q4_K", (64, 256), (16, 256), "mmq_small"),
    ("q6_K", (64, 2048), (9, 2048), "mmq_small"),
    ("q6_K", (64, 256), (9, 256), "dequant_cublas"),  # K % 2048 != 0: no GEMM
]


@pytest.mark.usefixtures("mmq_small_selected")
@pytest.mark.parametrize(("dt", "a_shape", "b_shape", "path"), MMQ_SMALL_PATH_CASES)
def test_mul_mat_path_with_mmq_small_selected(dt: str, a_shape: tuple, b_shape: tuple, path: str) -> None:
    test_mul_mat_path_by_dtype_and_batch(dt, a_shape, b_shape, path)


@pytest.mark.parametrize(("n_tok", "path"), [(1, "mmv_id"), (4, "mmv_id_grouped"), (129, "mmv_id_grouped")])
@pytest.mark.parametrize("dt", ["f16", "q4_0"])
def test_mul_mat_id_path(n_tok: int, path: str, dt: str) -> None:
    y = ops.mul_mat_id(weight("experts", (8, 32, 64), dt), od.input("x", (n_tok, 1, 64)),
                       od.input("ids", (n_tok, 2), "i32"))
    (step,) = steps_of(od.compile(y, H200), "mul_mat_id")
    assert (step.plugin, step.kernel) == ("cuda_matmul", path)


def _moe_node(dt: str, experts: tuple[int, int, int], n_tok: int, used: int, b_rows: int = 1) -> Tensor:
    """mul_mat_id of (E, M, K) experts of type dt (inputs: no data) for n_tok tokens of b_rows b rows, `used` slots."""
    k = experts[-1]
    return ops.mul_mat_id(od.input("experts", experts, dt), od.input("x", (n_tok, b_rows, k)),
                          od.input("ids", (n_tok, used), "i32"))


#: (dt, experts (E, M, K), tokens, slots, path, why the path before it declines): the quantized GEMMs from more than
#: support.MMQ_ID_PAIRS_PER_EXPERT pairs an expert, for their formats and rows of whole chunks: mmq_wgmma_id above
#: support.MMQ_WGMMA_ID_MIN_MEAN pairs an expert for its formats, else mmq_id
FEW = "pairs an expert on average (at most 32): mmq_id's narrower column tiles waste less"
MMQ_ID_PATHS = [
    ("q4_0", (8, 64, 256), 33, 2, "mmq_id", f"9 {FEW}"),  # 66 pairs > 8 * 8
    ("q4_0", (8, 64, 256), 32, 2, "mmv_id_grouped",
     "64 (token, slot) pairs for 8 experts: at most 8 an expert do not fill the GEMM's column tiles"),
    ("q4_K", (64, 64, 2048), 512, 8, "mmq_wgmma_id", ""),  # the target: 64 experts, 8 used, a 512-token prefill
    ("q4_0", (8, 64, 256), 256, 1, "mmq_id", f"32 {FEW}"),
    ("q4_0", (8, 64, 256), 257, 1, "mmq_wgmma_id", ""),  # 33 pairs an expert
    ("q4_1", (8, 64, 256), 512, 2, "mmq_id", "not selected for q4_1 (support.MMQ_WGMMA_ID_TYPES)"),
    ("q8_0", (64, 64, 2048), 64, 8, "mmv_id_grouped",
     "512 (token, slot) pairs for 64 experts: at most 8 an expert do not fill the GEMM's column tiles"),
    ("q6_K", (8, 64, 256), 64, 2, "mmv_id_grouped", "K=256 is not a multiple of 2048 (rows of whole 1680-byte chunks)"),
    ("q5_1", (4, 64, 96), 40, 2, "mmv_id_grouped", "K=96 is not a multiple of 64 (rows of whole 48-byte chunks)"),
    ("mxfp4", (4, 64, 512), 40, 2, "mmq_id", f"20 {FEW}"),
    ("mxfp4", (4, 64, 512), 160, 2, "mmq_wgmma_id", ""),  # gpt-oss's expert format
    ("f16", (8, 64, 256), 64, 2, "mmv_id_grouped", "float experts take the mat-vecs"),
    ("q8_0", (8, 64, 256), 1, 8, "mmv_id", ""),  # one token: the mat-vec, whatever the pairs
    *([("iq2_xs", (8, 64, 2048), 64, 2, "mmv_id_grouped", "iq2_xs has no quantized GEMM")] if "iq2_xs" in DTYPES
      else []),
]


@pytest.mark.parametrize(("dt", "experts", "n_tok", "used", "path", "why"), MMQ_ID_PATHS)
def test_mul_mat_id_takes_mmq_id_with_enough_pairs(dt: str, experts: tuple, n_tok: int, used: int, path: str,
                                                   why: str) -> None:
    """choose() takes a quantized GEMM for several tokens where its conditions hold (mmq_wgmma_id, else mmq_id),
    else mmv_id_grouped, and the Kernel of the path declining says why; exactly one Kernel takes each node."""
    y = _moe_node(dt, experts, n_tok, used)
    (step,) = steps_of(od.compile(y, H200), "mul_mat_id")
    assert (step.plugin, step.kernel) == ("cuda_matmul", path)
    kernels = {k.name: k for k in cm.kernels(device=H200) if k.op == "mul_mat_id"}
    assert [name for name, k in kernels.items() if k.supports(H200, y) is True] == [path]
    declined = {"mmv_id_grouped": "mmq_id", "mmq_id": "mmq_wgmma_id"}.get(path)
    if declined:
        assert support.choose(y, H200).note == f"{declined}: {why}"
        assert kernels[declined].supports(H200, y) == f"{path} takes it ({declined}: {why})"
    if n_tok > 1 and dt in mmq.MMQ_FORMATS:  # the threshold is the named constant's
        assert (support.mmq_id_ok(y, H200) is True) == (
            n_tok * used > support.MMQ_ID_PAIRS_PER_EXPERT * experts[0] and experts[-1] % stream.stream_geo(
                dt).row_values == 0)


def test_mmq_wgmma_id_follows_its_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmq_wgmma_id takes the formats of support.MMQ_WGMMA_ID_TYPES above support.MMQ_WGMMA_ID_MIN_MEAN pairs an
    expert, and compute capability 9.0 only (wgmma is sm_90a code)."""
    y = _moe_node("q4_0", (8, 64, 256), 64, 2)  # 16 pairs an expert
    assert support.choose(y, H200).path == "mmq_id"
    monkeypatch.setattr(support, "MMQ_WGMMA_ID_MIN_MEAN", 15)
    assert support.choose(y, H200).path == "mmq_wgmma_id"
    a100 = Device("cuda0", "cuda", "an sm_80 GPU", {**H200.props, "cc": (8, 0)})
    assert support.choose(y, a100) == support.Choice(
        "mmq_id", note="mmq_wgmma_id: wgmma needs compute capability 9.0 (sm_90a code), not 8.0")
    monkeypatch.setattr(support, "MMQ_WGMMA_ID_TYPES", ())
    assert support.choose(y, H200) == support.Choice(
        "mmq_id", note="mmq_wgmma_id: not selected for q4_0 (support.MMQ_WGMMA_ID_TYPES)")


def test_mmq_id_threshold_follows_the_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    y = _moe_node("q4_0", (8, 64, 256), 16, 2)  # 32 pairs: 4 an expert
    assert support.choose(y, H200).path == "mmv_id_grouped"
    monkeypatch.setattr(support, "MMQ_ID_PAIRS_PER_EXPERT", 3)
    assert support.choose(y, H200).path == "mmq_id"


def test_mmq_id_max_tiles_bounds_every_routing(rng) -> None:  # noqa: ANN001
    """The grid's column tiles (max_tiles, from the shapes) hold the tiles of any routing: random ids, every pair
    on one expert, and the worst case (each used expert one pair past whole tiles)."""
    for bn in (32, 64):
        for experts, pairs in ((8, 18), (8, 80), (64, 4096), (64, 40), (128, 8 * 129)):
            tiles = mmq_id.max_tiles(pairs, experts, bn)
            used = min(experts, pairs)
            worst = np.full(used, pairs // used)  # then one pair more for the first pairs % used experts
            worst[:pairs % used] += 1
            counts = [np.bincount(rng.integers(0, experts, pairs), minlength=experts), np.array([pairs]), worst,
                      np.full(min(experts, pairs // (bn + 1)), bn + 1)]
            for c in counts:
                assert c.sum() <= pairs
                assert sum(-(-int(x) // bn) for x in c) <= tiles, (bn, experts, pairs, c)


def _recording_scratch() -> tuple[dict, Callable]:
    sizes: dict[str, int] = {}

    def scratch(role: str, nbytes: int, zeroed: bool = False) -> int:
        sizes[role] = nbytes
        return SCRATCH + 2**30 * len(sizes)

    return sizes, scratch


@pytest.mark.parametrize(("dt", "experts", "n_tok", "used", "b_rows", "kernel"), [
    ("q4_0", (64, 2048, 2048), 512, 8, 1, "mmq_id<W_Q4_0, 2, 4, 4, 2, 2, 8>"),  # the target: 64 pairs an expert
    ("q4_K", (8, 77, 512), 40, 2, 2, "mmq_id<W_Q4_K, 1, 2, 4, 2, 4, 8>"),  # 10 pairs an expert: 64 x 32 tiles
    ("q6_K", (4, 40, 2048), 72, 2, 1, "mmq_id<W_Q6_K, 2, 4, 4, 2, 3, 8>"),
])
def test_mmq_id_specs(dt: str, experts: tuple, n_tok: int, used: int, b_rows: int, kernel: str) -> None:
    """moe_route with its tile table (tile_n the configuration's columns, room for max_tiles), quantize_q8_1 of
    b's rows, then mmq_id on a grid of row tiles times max_tiles, its shared memory within the H200's, every
    argument typed as the kernels' parameters."""
    y = _moe_node(dt, experts, n_tok, used, b_rows)
    e, m, k = experts
    pairs = n_tok * used
    sizes, scratch = _recording_scratch()
    guard = FakeGuard()
    route, quant, spec = mmq_id.mmq_id_specs(y, y, fake_ptr, scratch, guard)
    for s in (route, quant, spec):
        check_spec(s)
    cfg = mmq_id.mmq_id_config(dt, pairs, e)
    assert spec.kernel == kernel == mmq_id.instance_name(dt, cfg) and kernel in specs.KERNEL_SOURCES[specs.MMQ_ID_CU]
    mean_columns = 32 if -(-pairs // e) <= mmq_id.SMALL_MEAN else 10**6  # mmq's table's, by the mean pairs
    assert cfg == attrs.evolve(mmq.mmq_config(dt, mean_columns), splits=1)
    tiles = -(-pairs // cfg.bn) + min(e, pairs)
    assert route.kernel == "moe_route" and route.grid == (1,) and route.smem == 2 * 4 * e
    assert (route.args.tile_n, route.args.T, route.args.U, route.args.E) == (cfg.bn, n_tok, used, e)
    assert guard.uses == [(y, y.srcs[2], e, f"an expert of {y.srcs[0].describe()}",
                           "its output row is filled with NaN")]
    assert sizes["route"] == 4 * (1 + 3 * e + pairs + 1 + 3 * tiles)
    assert quant.kernel == "quantize_q8_1<B_F32>" and quant.grid == (n_tok * b_rows, -(-k // 32 // 8))
    args = spec.args
    assert spec.grid == (-(-m // cfg.bm) * tiles,) and spec.block == cfg.threads
    assert spec.smem == 8 * cfg.bn + mmq.mmq_smem(dt, cfg) <= stream.device_facts(H200).smem_per_block_optin
    assert (args.pairs, args.max_tiles, args.U, args.Ub) == (pairs, tiles, used, b_rows)
    assert (args.E, args.M, args.K) == (e, m, k)
    assert (args.a_row, args.a_e) == (y.srcs[0].strides[1], y.srcs[0].strides[0])
    q = quant.args
    assert (args.route, args.bq, args.bds, args.nbp) == (route.args.route, q.bq, q.bds, q.nbp)
    assert (args.out, args.bias, args.bias_e) == (fake_ptr(y), 0, 0)
    assert int(args.as_) == fake_ptr(y.srcs[0]) and args.as_ % 16 == 0


def test_mmq_id_fused_bias_spec() -> None:
    """mul_mat_id -> add_id on mmq_id: the add_id node is written, the experts' bias rows passed."""
    y = _moe_add_id(40, "q4_0", 256)
    node = Graph.build(y).nodes[0]
    assert support.choose(node, H200).path == "mmq_id"
    bias = y.srcs[1]
    route, _, spec = mmq_id.mmq_id_specs(node, y, fake_ptr, fake_scratch, FakeGuard(), bias=bias)
    assert (spec.args.out, route.args.out) == (fake_ptr(y), fake_ptr(y))  # moe_route's NaN rows too
    assert (spec.args.bias, spec.args.bias_e) == (fake_ptr(bias), 32 * 4)


def test_mmq_id_fits_every_format() -> None:
    """Both configurations of every format mmq_id takes fit the H200's shared memory, and each is compiled."""
    for dt in mmq.MMQ_FORMATS:
        for pairs in (8 * 9, 64 * 8):
            cfg = mmq_id.mmq_id_config(dt, pairs, 8)
            assert mmq_id.mmq_id_fits(dt, pairs, 8, H200)
            assert mmq_id.instance_name(dt, cfg) in mmq_id.NAMES
    assert len(mmq_id.NAMES) == 2 * len(mmq.MMQ_FORMATS)


@pytest.mark.parametrize(("dt", "b_rows"), [("q4_0", 1), ("q6_K", 8), ("mxfp4", 2)])
def test_mmq_wgmma_id_specs(dt: str, b_rows: int) -> None:
    """moe_route with its tile table (tile_n 128, room for max_tiles), b's T * Ub rows converted to bf16, then
    mmq_wgmma_id on a grid of 128-row tiles times max_tiles, its pair table and stages within the H200's shared
    memory, every argument typed as the kernel's parameters."""
    e, m, k, n_tok, used = 64, 2048, 2048, 512, 8
    y = _moe_node(dt, (e, m, k), n_tok, used, b_rows)
    assert support.choose(y, H200).path == "mmq_wgmma_id"
    pairs = n_tok * used
    sizes, scratch = _recording_scratch()
    route, conv, spec = mmq_wgmma.wgmma_id_specs(y, y, fake_ptr, scratch, FakeGuard())
    for s in (route, conv, spec):
        check_spec(s)
    tiles = -(-pairs // 128) + min(e, pairs)
    assert route.kernel == "moe_route" and (route.args.tile_n, route.args.T, route.args.U) == (128, n_tok, used)
    assert sizes["route"] == 4 * (1 + 3 * e + pairs + 1 + 3 * tiles)
    assert conv.kernel == "convert<B_F32, B_BF16>" and conv.args.dst == SCRATCH + 2**30 * 2
    assert sizes["b"] == n_tok * b_rows * k * 2
    assert spec.kernel == mmq_wgmma.id_instance_name(dt) == f"mmq_wgmma_id<W_{dt.upper()}, 2, 128>"
    assert spec.kernel in specs.KERNEL_SOURCES[specs.MMQ_WGMMA_CU]
    assert spec.grid == (m // 128 * tiles,) and spec.block == (384 if dt in mmq_wgmma.RS_FORMATS else 256)
    assert spec.smem == 8 * 128 + mmq_wgmma.wgmma_smem(dt, mmq_wgmma.NARROW)
    assert spec.smem <= stream.device_facts(H200).smem_per_block_optin
    args = spec.args
    assert (args.pairs, args.max_tiles, args.U, args.Ub, args.E, args.M, args.K) == (pairs, tiles, used, b_rows, e,
                                                                                         m, k)
    assert (args.route, args.b, args.out, args.bias, args.bias_e) == (route.args.route, conv.args.dst, fake_ptr(y),
                                                                      0, 0)
    assert (args.a_row, args.a_e, int(args.as_)) == (y.srcs[0].strides[1], y.srcs[0].strides[0],
                                                     fake_ptr(y.srcs[0]))


def test_mmq_wgmma_id_fused_bias_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """mul_mat_id -> add_id on mmq_wgmma_id: the add_id node is written, the experts' bias rows passed."""
    monkeypatch.setattr(support, "MMQ_WGMMA_ID_MIN_MEAN", 0)
    y = _moe_add_id(40, "q4_0", 256)
    plan = od.compile(y, H200)
    assert [(s.plugin, s.kernel) for s in plan.fusions] == [("cuda_matmul", "mul_mat_id_add_id")], plan.explain()
    node = Graph.build(y).nodes[0]
    assert support.choose(node, H200).path == "mmq_wgmma_id"
    bias = y.srcs[1]
    route, _, spec = mmq_wgmma.wgmma_id_specs(node, y, fake_ptr, fake_scratch, FakeGuard(), bias=bias)
    assert (spec.args.out, route.args.out) == (fake_ptr(y), fake_ptr(y))  # moe_route's NaN rows too
    assert (spec.args.bias, spec.args.bias_e) == (fake_ptr(bias), 32 * 4)


@pytest.mark.parametrize("dt", ["f32", "f16", "q8_0"])
def test_out_prod_takes_cublas(dt: str) -> None:
    y = ops.out_prod(weight("a", (7, 64), dt), od.input("b", (7, 5)))
    (step,) = steps_of(od.compile(y, H200), "out_prod")
    assert (step.plugin, step.kernel) == ("cuda_matmul", "cublas_out_prod")


def test_paths_are_mutually_exclusive() -> None:
    kernels = list(cm.kernels(device=H200))
    for dt, a_shape, b_shape, path in PATH_CASES:
        node = ops.mul_mat(weight("w", a_shape, dt), od.input("x", b_shape))
        takers = [k.name for k in kernels if k.op == "mul_mat" and k.supports(H200, node) is True]
        assert takers == [path]


def _strided_k_rows() -> Tensor:
    a = od.input("a", (16, 128))
    return ops.mul_mat(a.view((16, 64), (512, 8)), od.input("x", (1, 64)))


def _many_experts() -> Tensor:
    return ops.mul_mat_id(od.input("e", (5000, 4, 32)), od.input("x", (2, 1, 32)), od.input("ids", (2, 2), "i32"))


def _overlapping_rows() -> Tensor:
    a = od.input("a", (40,))
    return ops.mul_mat(a.view((8, 32), (4, 4)), od.input("x", (1, 32)))


def _misaligned_f32() -> Tensor:
    a = od.input("a", (16 * 33,), "f16")
    return ops.mul_mat(a.view((16, 32), (66, 2), 1), od.input("x", (1, 32)))


@pytest.mark.parametrize(("build", "reason"), [
    (_strided_k_rows, "a's rows (the K axis) must be contiguous"),
    (_many_experts, "more than 4096 experts with several tokens"),
    (_overlapping_rows, "a's rows overlap"),
    (_misaligned_f32, "a's strides and offset must be whole elements"),
])
def test_declines_with_the_reason_and_falls_back_to_cpu(build: Callable[[], Tensor], reason: str) -> None:
    y = build()
    plan = od.compile(y, H200)
    (step,) = steps_of(plan, y.op)
    assert step.device.name == "cpu" and step.plugin == "cpu"
    assert ("cuda_matmul", reason) in step.declined
    assert f"cuda_matmul ({reason})" in plan.explain()


def _misaligned_rows(dt: str) -> Tensor:
    """(77, 512) weights whose rows are 17 blocks apart (a view of (77, 544)): rows not 16-byte aligned."""
    a = od.input("a", (77, 544), dt)
    return a.view((77, 512), a.strides)


def test_stream_path_reasons() -> None:
    """mmvq_stream takes rows of whole 16-byte chunks of 16-byte aligned weights, and other rows (the RAGGED
    instances, RAGGED_TYPES only) at one f32 column with the weights' base 16-byte aligned; mmvq the rest, and
    support.stream_ok says why."""
    def node(dt: str, k: int, n: int = 1) -> Tensor:
        return ops.mul_mat(weight("w", (64, k), dt), od.input("x", (n, k)))

    def ragged(k: int, rv: int, chunk: int) -> str:
        return (f"K={k} is not a multiple of {rv} (rows of whole {chunk}-byte chunks), which mmvq_stream takes at "
                "1 f32 column only")

    assert support.stream_ok(node("q4_0", 4096)) is True
    assert support.stream_ok(node("mxfp4", 2880)) is True  # RAGGED
    assert support.stream_ok(node("q6_K", 3584)) is True
    assert support.stream_ok(node("mxfp4", 2880, 2)) == ragged(2880, 512, 272)
    assert support.stream_ok(node("q6_K", 3584, 8)) == ragged(3584, 2048, 1680)
    assert support.stream_ok(node("q4_0", 4128)) == (  # a legacy format: no RAGGED instance, at any column count
        "K=4128 is not a multiple of 256 (rows of whole 144-byte chunks), and mmvq_stream's RAGGED instances take "
        "no legacy format (q4_0): mmvq runs those rows")
    wide = od.input("w", (64, 2912), "mxfp4")  # a view one 17-byte block in
    off = ops.mul_mat(wide.view((63, 2880), wide.strides, wide.dtype.block_bytes), od.input("x", (1, 2880)))
    assert support.stream_ok(off) == "a's offset is not a multiple of 16 bytes"
    misaligned = ops.mul_mat(_misaligned_rows("q4_0"), od.input("x", (1, 512)))
    assert support.stream_ok(misaligned) == "a's offset or row/batch strides are not multiples of 16 bytes"
    (step,) = steps_of(od.compile(misaligned, H200), "mul_mat")
    assert step.kernel == "mmvq"
    assert "q8_1 copy of 8x65536 values does not fit" in support.stream_ok(node("q8_0", 65536, 8))
    old = Device("cuda0", "cuda", "an sm_75 GPU", {**H200.props, "cc": (7, 5)})
    assert support.stream_ok(node("q4_0", 4096), old) == "cp.async needs sm_80"
    (step,) = steps_of(od.compile(node("q4_0", 4096), old), "mul_mat")
    assert step.kernel == "mmvq"


def test_stream_chunks_mirror_the_kernel() -> None:
    """stream.STREAMED: the fewest blocks whose bytes are a multiple of 16, an odd number of 16-byte
    granules (conflict-free 16-byte shared loads at a chunk stride), as mmvq_stream.cu's Geo; a lane's
    piece the chunk up to REG_CHUNK_MAX bytes (every legacy format's; half of it, 8-byte words, for
    HALF_PIECE's formats), else one block, a stage of 32 pieces whole granules; every block format streams."""
    assert set(stream.STREAMED) == set(specs.QUANT_NAMES)
    for dt, (nbytes, cb) in stream.STREAMED.items():
        assert nbytes == DTYPES[dt].block_bytes
        assert cb * nbytes % 16 == 0 and all(c * nbytes % 16 for c in range(1, cb))
        g = stream.stream_geo(dt)
        assert (g.chunk // 16) % 2 == 1 and (g.bpiece // 16) % 2 == 1 and g.bpiece >= g.values // 32 * 40
        reg = g.chunk <= stream.REG_CHUNK_MAX
        assert g.lb == (1 if not reg else cb // 2 if dt in stream.HALF_PIECE else cb) and (32 * g.piece) % 16 == 0
        assert not reg or g.piece % 8 == 0
        assert g.row_values == cb * DTYPES[dt].block_size and g.values == g.lb * DTYPES[dt].block_size
    assert all(stream.stream_geo(dt).lb > 1 or stream.STREAMED[dt][1] == 1 for dt in specs.LEGACY_NAMES)
    src = specs.MMVQ_STREAM_CU.read_text()
    assert "static constexpr int CB = 16 / pow2_of(F::BYTES);" in src
    assert "static constexpr bool REG = CHUNK <= REG_CHUNK_MAX;" in src
    half = sorted(f"WT == W_{dt.upper()}" for dt in stream.HALF_PIECE)
    assert f"constexpr bool HALF_PIECE = {' || '.join(half)};" in src
    assert f"constexpr int REG_CHUNK_MAX = {stream.REG_CHUNK_MAX};" in src
    assert "static constexpr int NU = LB * F::QK / 32;" in src
    assert "static constexpr int BCHUNK = (BRAW / 16) % 2 == 1 ? BRAW : BRAW + 16;" in src


def test_stream_grid_bytes_mirror_the_traits() -> None:
    """stream.GRID_BYTES, the shared memory mmvq_stream gives a grid format's lookup grid, is the grid's size
    (its entries times their width, opdispatch.quants.iq_grids.TABLES) and quant_iq.cuh's traits name that grid
    with that many entries of that width: a smaller figure would let stage_grid write past the block's memory."""
    grids = {"iq2_xxs": "iq2xxs_grid", "iq2_xs": "iq2xs_grid", "iq2_s": "iq2s_grid", "iq3_xxs": "iq3xxs_grid",
             "iq3_s": "iq3s_grid", "iq1_s": "iq1s_nibbles", "iq1_m": "iq1s_nibbles"}
    assert set(stream.GRID_BYTES) == set(grids) == {dt for dt in stream.STREAMED if dt.startswith("iq")} - {
        "iq4_nl", "iq4_xs"}
    src = (INCLUDE_DIR / "quant_iq.cuh").read_text()
    for dt, name in grids.items():
        grid = TABLES[name]
        assert stream.GRID_BYTES[dt] == grid.size
        entry = "unsigned long long" if grid.shape[1] == 8 else "unsigned"
        head = re.search(rf"struct {dt} : (\w+)<([^>]*)> {{\n.*?return (\w+); }}", src)
        assert head is not None, dt
        args = head[2].split(", ")
        assert (int(args[-1]), head[3]) == (grid.shape[0], name), dt
        # GridScaled<BYTES, SUB, entry, entries>, or iq2's Iq2Halves<BYTES, SC, entries> (8-byte entries)
        assert args[2] == entry if head[1] == "GridScaled" else (head[1], entry) == ("Iq2Halves", "unsigned long long")
    assert "struct Iq2Halves : GridScaled<BYTES_, 16, unsigned long long, ENTRIES_>" in src
    assert "+ GRID_BYTES.get(dt, 0) * copies" in inspect.getsource(stream.stream_smem)
    assert {dt for dt in grids if TABLES[grids[dt]].shape[1] != 8} == set(stream.GRID_ENTRY)


def test_stream_grid_copies_keep_the_warps_and_blocks() -> None:
    """mmvq_stream's blocks hold a wavefront's worth of copies of a small grid where they fit beside what one copy
    leaves (the warps a block, the blocks an SM), fewer where not, and one where fewer than GRID_COPIES_MIN would
    fit; the spec passes the count and sizes the shared memory for it."""
    lanes = {"iq2_xxs": 16, "iq2_xs": 8, "iq3_xxs": 32, "iq3_s": 16}  # a wavefront's lanes within 32 KB of copies
    for dt in stream.GRID_BYTES:
        assert stream.grid_copies(dt, 4096, 1, H200) == lanes.get(dt, 1), dt
    assert stream.grid_copies("q4_K", 4096, 1, H200) == 1
    # the kernel reads copies through GridAt only for the grids of which GRID_COPIES_MIN copies fit (GRID_COPIES)
    kernel = specs.MMVQ_STREAM_CU.read_text()
    assert "F::GRID_BYTES > 0 && F::GRID_BYTES * GRID_COPIES_MIN <= GRID_COPIES_MAX" in kernel
    assert (f"constexpr int GRID_COPIES_MIN = {stream.GRID_COPIES_MIN}, GRID_COPIES_MAX = {stream.GRID_COPIES_MAX};"
            in kernel)
    for dt, g in stream.GRID_BYTES.items():
        if g * stream.GRID_COPIES_MIN > stream.GRID_COPIES_MAX:
            assert all(stream.grid_copies(dt, k, n, H200) == 1 for k in (256, 4096, 14336) for n in (1, 8)), dt
    cfg = specs.STREAM
    for dt, k, n in itertools.product(lanes, (4096, 14336, 18944), (1, 2, 8)):
        c = stream.grid_copies(dt, k, n, H200)
        assert c == 1 or stream.GRID_COPIES_MIN <= c <= lanes[dt], (dt, k, n)
        warps = stream.stream_warps(dt, k, n, H200)
        assert stream.stream_warps(dt, k, n, H200, copies=c) == warps
        per_sm = stream.stream_blocks_per_sm(stream.stream_smem(dt, k, n, warps, cfg.stages), H200, cfg)
        assert stream.stream_blocks_per_sm(stream.stream_smem(dt, k, n, warps, cfg.stages, c), H200, cfg) == per_sm
    # where a wavefront's copies would cost a block its warps (iq3_s, 8 columns of K 14336: 8 warps fit with 8 copies,
    # not with 16), fewer
    assert stream.grid_copies("iq3_s", 14336, 8, H200) == 8
    assert stream.stream_warps("iq3_s", 14336, 8, H200, copies=16) < stream.stream_warps("iq3_s", 14336, 8, H200)
    y = ops.mul_mat(zero_weight("w", (4096, 14336), "iq2_xxs"), od.input("x", (1, 14336)))
    (spec,) = mmv.mmv_specs(y, y, fake_ptr, fake_scratch)
    assert spec.kernel.startswith("mmvq_stream<W_IQ2_XXS,") and int(spec.args.grid_copies) == 16
    assert spec.smem == stream.stream_smem("iq2_xxs", 14336, 1, cfg.warps, cfg.stages, 16)


@pytest.mark.parametrize(("dt", "k", "glu", "layout"), [
    ("q4_0", 4096, False, (16, 16, 2, 1, 2, 1)),
    ("q8_0", 4096, True, (16, 16, 2, 1, 1, 1)),  # gate row in lanes 0-15, up row in 16-31
    ("q4_0", 14336, False, (56, 32, 1, 2, 1, 2)),  # two segments a row: 32 + 24 chunks
    ("q4_0", 14336, True, (56, 32, 1, 2, 1, 4)),  # gate's two segments, then up's
    ("q4_1", 4096, False, (32, 32, 1, 1, 1, 1)),
    ("q5_1", 14336, False, (224, 32, 1, 7, 1, 7)),
    ("q5_0", 256, False, (1, 1, 32, 1, 32, 1)),
    ("q5_0", 256, True, (1, 1, 32, 1, 16, 1)),
    ("q4_0", 768, True, (3, 4, 8, 1, 4, 1)),
    ("q4_K", 256, False, (1, 1, 32, 1, 32, 1)),  # a q4_K block a lane, in registers
    ("q5_K", 14336, True, (56, 32, 1, 2, 1, 4)),
    ("iq4_xs", 4096, False, (16, 16, 2, 1, 2, 1)),  # a half piece: one block a lane
    ("mxfp4", 16896, False, (66, 32, 1, 3, 1, 3)),  # a half piece of 8 blocks, a partial third segment
    ("iq4_nl", 4096, True, (16, 16, 2, 1, 1, 1)),
    ("q6_K", 4096, False, (16, 16, 2, 1, 2, 1)),  # one block a lane from shared memory: 2 chunks of 8
    ("q3_K", 14336, False, (56, 32, 1, 2, 1, 2)),
    ("q2_K", 1024, True, (4, 4, 8, 1, 4, 1)),  # one chunk of 4 blocks
])
def test_stream_layout(dt: str, k: int, glu: bool, layout: tuple) -> None:
    assert stream.stream_layout(dt, k, glu) == stream.StreamLayout(*layout)


@pytest.mark.parametrize(("m", "batches", "warps", "per_sm", "sms"), [
    (4096, 1, 4, 2, 132), (14336, 1, 4, 2, 132), (2048, 1, 4, 2, 132), (77, 1, 4, 2, 132), (13, 6, 4, 2, 132),
    (4096, 1, 8, 1, 132), (100000, 1, 4, 3, 132), (4096, 1000, 2, 2, 132),
])
def test_stream_grid_splits_evenly(m: int, batches: int, warps: int, per_sm: int, sms: int) -> None:
    """Every block slot used while each warp has a group, and the groups spread evenly (no warp more
    than one group above another) and whole."""
    groups = m  # RO = 1
    lay = stream.StreamLayout(1, 32, 1, 1, 1, 1)
    blocks = stream.stream_grid(lay, m, batches, warps, per_sm, sms)
    target = max(1, per_sm * sms // batches)
    assert blocks <= target and (blocks - 1) * warps < groups  # no more blocks than aimed at, none idle
    assert blocks == target or blocks * warps >= groups  # short of the target only when each warp has a group
    w = blocks * warps
    counts = [(i + 1) * groups // w - i * groups // w for i in range(w)]
    assert max(counts) - min(counts) <= 1 and sum(counts) == groups


def test_stream_spec_shrinks_warps_to_fit() -> None:
    """8 columns of K 14336 (150 KB of q8_1 b): 4 q8_0 warps of 3 stages do not fit in 227 KB, 2 do;
    of 2 stages (the default's), 8 do not, 4 do."""
    y = ops.mul_mat(weight("w", (64, 14336), "q8_0"), od.input("x", (8, 14336)))
    (spec,) = mmv.mmv_specs(y, y, fake_ptr, fake_scratch, stream=specs.StreamConfig(3, 4, 2))
    assert spec.kernel == "mmvq_stream<W_Q8_0, B_F32, 8, EPI_NONE, 3>" and spec.block == 64
    assert spec.smem == stream.stream_smem("q8_0", 14336, 8, 2, 3) <= 227 * 1024
    (spec,) = mmv.mmv_specs(y, y, fake_ptr, fake_scratch)
    assert spec.kernel == "mmvq_stream<W_Q8_0, B_F32, 8, EPI_NONE, 2>" and spec.block == 128
    assert spec.smem == stream.stream_smem("q8_0", 14336, 8, 4, 2) <= 227 * 1024
    check_spec(spec)


def test_stream_fused_glu_spec() -> None:
    y = _glu_graph("q4_0", n=2, kind="geglu", bias=True, k=4096)
    nodes = Graph.build(y).nodes
    prods, biases, glu = fusion.parts(nodes)
    (spec,) = mmv.fused_specs(nodes, fake_ptr, fake_scratch, FakeGuard(), H200)
    assert spec.kernel == f"mmvq_stream<W_Q4_0, B_F32, 2, EPI_GLU, {specs.STREAM.stages}>"
    check_spec(spec)
    m = prods[0].shape[-1]
    args = spec.args
    assert int(args.a0) == fake_ptr(prods[0].srcs[0]) and int(args.a1) == fake_ptr(prods[1].srcs[0])
    assert int(args.bias0) == fake_ptr(biases[0]) and int(args.bias1) == fake_ptr(biases[1])
    assert (int(args.M), int(args.K), int(args.N), int(args.glu_kind)) == (m, 4096, 2, 1)
    assert int(args.out) == fake_ptr(nodes[-1])
    # R = 2 at K 4096: one gate and one up row a stage, so as many groups as rows
    lay = stream.stream_layout("q4_0", 4096, True)
    assert spec.grid == (stream.stream_grid(lay, m, 1, specs.STREAM.warps, specs.STREAM.blocks_per_sm, 132), 1, 1)


#: (M, K) -> mmf's split on the H200 (132 SMs: 264 blocks of 8 warps): the 1b preset's weights at 16 columns
MMF_H200_SPLITS = {
    (2048, 2048): mmf.MmfSplit(8, 256, 16),  # q, o: 128 warp tiles, 8 splits of 8 units (2 groups a warp)
    (512, 2048): mmf.MmfSplit(8, 256, 4),  # k, v: as many splits, few warps
    (3072, 2048): mmf.MmfSplit(8, 256, 24),  # the q/k/v stack
    (8192, 2048): mmf.MmfSplit(4, 512, 64),  # gate, up: 2048 warps, one tile each
    (2048, 8192): mmf.MmfSplit(16, 512, 16),  # down
    (128256, 2048): mmf.MmfSplit(4, 512, 63),  # the LM head: persistent blocks, 16 tiles a warp, b in 4 splits
}


@pytest.mark.parametrize(("m", "k"), list(MMF_H200_SPLITS))
def test_mmf_split_on_the_h200(m: int, k: int) -> None:
    assert mmf.split_k(m, k, 1, H200.props["sm_count"]) == MMF_H200_SPLITS[m, k]


def test_mmf_split_rules() -> None:
    """Over many shapes and batch counts: splits of whole groups, none empty, b's split within KS_MAX (its
    shared memory within the opt-in limit), at most BLOCKS_PER_SM blocks an SM unless one tile a warp
    needs more, and every warp within one tile of the busiest."""
    sms = H200.props["sm_count"]
    for m, k, batches in itertools.product((1, 17, 77, 300, 2048, 4099, 14336, 128256), (8, 40, 1000, 2056, 8192,
                                                                                        14336), (1, 3, 32)):
        sp = mmf.split_k(m, k, batches, sms)
        what = f"M={m} K={k} batches={batches}: {sp}"
        assert sp.ks % (mmf.UNIT * mmf.SPLIT_STEP) == 0 and (sp.splits - 1) * sp.ks < k <= sp.splits * sp.ks, what
        assert sp.ks <= max(mmf.KS_MAX, mmf.UNIT * mmf.SPLIT_STEP), what
        assert mmf.smem_bytes(16, sp.ks) <= H200.props["smem_per_block_optin"], what
        tiles, warps = -(-m // mmf.TILE_ROWS), sp.groups * mmf.WARPS
        busiest = -(-tiles // warps)
        assert warps * (busiest - 1) < tiles <= warps * busiest, what  # no row group idle
        if busiest > 1:  # persistent: about BLOCKS_PER_SM blocks an SM
            assert sp.groups * sp.splits * batches <= mmf.BLOCKS_PER_SM * sms + sp.splits * batches, what


def test_mmf_specs_on_the_h200() -> None:
    """The gate/up pair at 16 columns (8192 x 2048): one launch of the GLU instance, its grid from split_k,
    8 warps, the rings and b's split in shared memory, the partials and zeroed counters a warp tile and split
    each; the LM head's (128256 rows, 9 columns) likewise, persistent."""
    y = gate_up_glu("bf16", 8192, 2048, 16, False, "swiglu")
    nodes = [n for n in Graph.build(y).nodes if n.op not in ("view", "reshape", "permute", "transpose")]
    asked = {}

    def scratch(role: str, nbytes: int, zeroed: bool = False) -> int:
        asked[role] = (nbytes, zeroed)
        return SCRATCH

    (spec,) = mmf.mmf_fused_specs(nodes, fake_ptr, scratch, H200)
    check_spec(spec)
    sp = MMF_H200_SPLITS[8192, 2048]
    assert spec.kernel == "mmf<W_BF16, 2, EPI_GLU>" and spec.block == 256 == mmf.THREADS
    assert spec.grid == (sp.groups * sp.splits, 1, 1) and spec.smem == mmf.RING_BYTES + 512 * 16 * 2
    assert (int(spec.args.ks), int(spec.args.splits)) == (sp.ks, sp.splits)
    tiles = 8192 // 16
    assert asked == {"mmf partials": (tiles * sp.splits * 2 * 2 * 32 * 16, False), "mmf counters": (tiles * 4, True)}
    asked.clear()
    head = ops.mul_mat(od.input("w", (128256, 2048), "bf16"), od.input("x", (9, 2048)))
    (spec,) = mmf.mmf_specs(head, head, fake_ptr, scratch, device=H200)
    check_spec(spec)
    sp = MMF_H200_SPLITS[128256, 2048]
    assert spec.kernel == "mmf<W_BF16, 2, EPI_NONE>" and spec.grid == (sp.groups * sp.splits, 1, 1)
    assert spec.smem == mmf.RING_BYTES + sp.ks * 16 * 2 and int(spec.args.splits) == sp.splits
    tiles = -(-128256 // 16)
    assert asked == {"mmf partials": (tiles * sp.splits * 2 * 32 * 16, False), "mmf counters": (tiles * 4, True)}


def test_gate_declines_devices_without_32_lane_warps() -> None:
    wide = Device("cuda0", "cuda", "a 64-lane device", {"cc": (9, 0), "warp_size": 64})
    y = ops.mul_mat(od.input("a", (4, 64)), od.input("x", (1, 64)))
    (step,) = steps_of(od.compile(y, wide), "mul_mat")
    assert step.device.name == "cpu"
    assert ("cuda_matmul", "the kernels need 32-lane warps, cuda0 has 64") in step.declined


# -- fusion matching ---------------------------------------------------------------------------------


def _glu_graph(dt: str = "f16", n: int = 1, kind: str = "swiglu", bias: bool = False, same_x: bool = True,
               gate_first: bool = True, k: int = 64) -> Tensor:
    x = od.input("x", (n, k))
    g = ops.mul_mat(weight("wg", (32, k), dt, 1), x)
    if bias:
        g = ops.add(g, od.input("bg", (32,)))
    u = ops.mul_mat(weight("wu", (32, k), dt, 2), x if same_x else od.input("x2", (n, k)))
    if bias:
        u = ops.add(u, od.input("bu", (32,)))
    return ops.glu_split(g, u, kind) if gate_first else ops.glu_split(u, g, kind)


def _moe_glu_graph(n_tok: int = 1, bias: bool = False, dt: str = "q4_0") -> Tensor:
    x = od.input("x", (n_tok, 1, 64))
    ids = od.input("ids", (n_tok, 4), "i32")
    g = ops.mul_mat_id(weight("wg", (8, 32, 64), dt, 1), x, ids)
    if bias:
        g = ops.add_id(g, od.input("bg", (8, 32)), ids)
    u = ops.mul_mat_id(weight("wu", (8, 32, 64), dt, 2), x, ids)
    if bias:
        u = ops.add_id(u, od.input("bu", (8, 32)), ids)
    return ops.glu_split(g, u, "swiglu_oai", alpha=1.702, limit=7.0)


def test_gate_up_glu_nodes_are_consecutive() -> None:
    y = _glu_graph(bias=True)
    assert [n.op for n in Graph.build(y).nodes] == ["mul_mat", "add", "mul_mat", "add", "glu"]
    assert [n.op for n in Graph.build(_glu_graph()).nodes] == ["mul_mat", "mul_mat", "glu"]


@pytest.mark.parametrize(("build", "rule", "ops_in_group"), [
    (lambda: ops.add(ops.mul_mat(weight("w", (32, 64), "f16"), od.input("x", (1, 64))), od.input("b", (32,))),
     "mul_mat_add", ["mul_mat", "add"]),
    (lambda: ops.add(ops.mul_mat(weight("w", (32, 64), "q4_0"), od.input("x", (8, 64))), od.input("b", (1, 32))),
     "mul_mat_add", ["mul_mat", "add"]),
    (lambda: _glu_graph("f16"), "mul_mat_glu", ["mul_mat", "mul_mat", "glu"]),
    (lambda: _glu_graph("q8_0", n=3, kind="geglu"), "mul_mat_glu", ["mul_mat", "mul_mat", "glu"]),
    (lambda: _glu_graph("q4_0", gate_first=False), "mul_mat_glu", ["mul_mat", "mul_mat", "glu"]),
    (lambda: _glu_graph("bf16", bias=True), "mul_mat_add_glu", ["mul_mat", "add", "mul_mat", "add", "glu"]),
    (lambda: _moe_glu_graph(), "mul_mat_id_glu", ["mul_mat_id", "mul_mat_id", "glu"]),
    (lambda: _moe_glu_graph(bias=True), "mul_mat_id_add_id_glu",
     ["mul_mat_id", "add_id", "mul_mat_id", "add_id", "glu"]),
    (lambda: _moe_add_id(4), "mul_mat_id_add_id", ["mul_mat_id", "add_id"]),
    (lambda: _moe_add_id(1), "mul_mat_id_add_id", ["mul_mat_id", "add_id"]),
    (lambda: _moe_add_id(40, "q4_0", 256), "mul_mat_id_add_id", ["mul_mat_id", "add_id"]),  # mmq_id
])
def test_fuses(build: Callable[[], Tensor], rule: str, ops_in_group: list) -> None:
    plan = od.compile(build(), H200)
    (step,) = plan.fusions
    assert (step.plugin, step.kernel, step.device.name) == ("cuda_matmul", rule, "cuda0")
    assert [n.op for n in step.nodes] == ops_in_group
    assert len([s for s in plan.steps if s.kind in ("kernel", "fused")]) == 1
    assert f"cuda_matmul [fused {rule}] on cuda0" in plan.explain()


def _moe_add_id(n_tok: int, dt: str = "f16", k: int = 64) -> Tensor:
    ids = od.input("ids", (n_tok, 2), "i32")
    y = ops.mul_mat_id(weight("e", (4, 32, k), dt), od.input("x", (n_tok, 2, k)), ids)
    return ops.add_id(y, od.input("b", (4, 32)), ids)


def _bias_add_of_large_batch() -> Tensor:
    return ops.add(ops.mul_mat(weight("w", (32, 64), "f16"), od.input("x", (17, 64))), od.input("b", (32,)))


def _addend(shape: tuple, dt: str = "f32", n: int = 3, batch: tuple = (2,), view: str | None = None) -> Tensor:
    """add(mul_mat(w (32, 64) f16, x (*batch, n, 64)), r): r an input of `shape` (dt), its transpose (view "T"),
    or the first `shape` rows and columns of a larger one (view "rows": batch rows not evenly spaced)."""
    if view == "T":
        r = od.input("r", shape[::-1], dt).transpose()
    elif view == "rows":
        wide = od.input("r", (*shape[:-2], shape[-2] + 2, shape[-1]), dt)
        r = wide.view(shape, wide.strides)
    else:
        r = od.input("r", shape, dt)
    return ops.add(ops.mul_mat(weight("w", (32, 64), "f16"), od.input("x", (*batch, n, 64))), r)


def _glu_residuals_spaced_apart() -> Tensor:
    """mul_mat_add_glu whose two addends have the products' shape but rows 32 and 40 floats apart (the second
    add reads its product as its second source, so that the addend's view comes before the product)."""
    x = od.input("x", (3, 64))
    wide = od.input("ru", (3, 40))
    g = ops.add(ops.mul_mat(weight("wg", (32, 64), "f16", 1), x), od.input("rg", (3, 32)))
    u = ops.add(wide.view((3, 32), wide.strides), ops.mul_mat(weight("wu", (32, 64), "f16", 2), x))
    return ops.glu_split(g, u, "swiglu")


def _f16_bias() -> Tensor:
    return ops.add(ops.mul_mat(weight("w", (32, 64), "f16"), od.input("x", (1, 64))), od.input("b", (32,), "f16"))


def _f16_b() -> Tensor:
    return ops.add(ops.mul_mat(weight("w", (32, 64), "f16"), od.input("x", (1, 64), "f16")), od.input("b", (32,)))


def _moe_glu_several_tokens() -> Tensor:
    return _moe_glu_graph(n_tok=4)


def _glu_of_other_weight_dtypes() -> Tensor:
    x = od.input("x", (1, 64))
    return ops.glu_split(ops.mul_mat(weight("wg", (32, 64), "f16"), x), ops.mul_mat(weight("wu", (32, 64), "q8_0"), x),
                         "swiglu")


@pytest.mark.parametrize(("build", "reason"), [
    (_bias_add_of_large_batch, r"mul_mat takes cublas, which adds a contiguous addend of the product's shape "
                               r"\(17, 32\) \(its C\), not"),
    (lambda: _addend((2, 1, 32)), r"the addend .* is neither one row of 32 values nor of the product's shape"),
    (lambda: _addend((3, 32), batch=(2,)), r"the addend .* is neither one row of 32 values nor of the product's shape"),
    (lambda: _addend((2, 3, 32), view="rows"), r"the addend .* rows are not evenly spaced"),
    (lambda: _addend((3, 32), batch=(), view="T"), r"the bias .* rows must be contiguous"),
    (lambda: _addend((3, 32), "f16", batch=()), r"the bias .* must be f32"),
    (lambda: _glu_graph("q4_0", n=16, k=256), r"mul_mat takes mmq_small, which fuses a bias or residual, not a GLU"),
    (_f16_bias, r"the bias .* must be f32"),
    (_f16_b, r"mul_mat: b must be f32 to fuse, got f16"),
    (lambda: _glu_graph(same_x=False), r"the two products read different inputs"),
    (_moe_glu_several_tokens, r"4 tokens: the fused GLU is for one token"),
    (_glu_of_other_weight_dtypes, r"the weights differ in dtype, shape or strides"),
    (lambda: _glu_graph(n=17), r"mul_mat takes cublas, which fuses a bias or residual, not a GLU \(batch 17\)"),
])
def test_fusion_check_declines_with_a_reason(build: Callable[[], Tensor], reason: str) -> None:
    y = build()
    graph = Graph.build(y)
    group = [n for n in graph.nodes if n.op not in ("view", "reshape", "permute", "transpose")]
    pattern = tuple(n.op for n in group)
    answers = [fusion.check(H200, group[i:i + len(p)], graph)
               for i in range(len(group)) for _, p in fusion.PATTERNS if pattern[i:i + len(p)] == p]
    assert answers and all(isinstance(a, str) for a in answers), answers
    assert any(re.search(reason, a) for a in answers), answers
    plan = od.compile(y, H200)
    assert not [s for s in plan.fusions if s.plugin == "cuda_matmul"], plan.explain()


def test_glu_addends_spaced_apart_fuse_each_on_its_own() -> None:
    """The GLU kernels take one bias_col for both addends: addends of the products' shape whose rows are spaced
    differently decline the GLU group (saying why), and each product fuses its own add instead."""
    y = _glu_residuals_spaced_apart()
    graph = Graph.build(y)
    nodes = [n for n in graph.nodes if n.op not in ("view", "reshape", "permute", "transpose")]
    assert [n.op for n in nodes] == ["mul_mat", "add", "mul_mat", "add", "glu"]
    assert fusion.check(H200, nodes, graph) == "the two addends' rows are spaced differently (the kernels take one " \
                                               "bias_col)"
    plan = od.compile(y, H200)
    assert [s.kernel for s in plan.fusions] == ["mul_mat_add", "mul_mat_add"], plan.explain()
    assert [fusion.bias_col(s.nodes[0], fusion.parts(s.nodes)[1][0]) for s in plan.fusions] == [32, 40]


def test_glu_over_halves_of_one_product_does_not_match() -> None:
    y = ops.glu(ops.mul_mat(weight("w", (64, 64), "f16"), od.input("x", (1, 64))), "swiglu")
    plan = od.compile(y, H200)
    assert not [s for s in plan.fusions if s.plugin == "cuda_matmul"]
    (step,) = steps_of(plan, "mul_mat")
    assert step.kernel == "mmvf"


def test_fusion_off_runs_each_node() -> None:
    plan = od.compile(_glu_graph(bias=True), H200, fusion=False)
    assert not plan.fusions
    assert [s.kernel for s in steps_of(plan, "mul_mat")] == ["mmvf", "mmvf"]


def test_fusion_parts_orders_gate_first() -> None:
    for gate_first in (True, False):
        y = _glu_graph("q4_0", bias=True, gate_first=gate_first)
        nodes = Graph.build(y).nodes
        prods, biases, glu = fusion.parts(nodes)
        assert glu is nodes[-1]
        assert prods[0].srcs[0].name == ("wg" if gate_first else "wu")
        assert biases[0].name == ("bg" if gate_first else "bu")


# -- launch specs, without a GPU --------------------------------------------------------------

BASE = 0x7F00_0000_0000  # 256-byte aligned, as arena slots and buffers are

SCRATCH = BASE + 2**40


def fake_ptr(t: Tensor) -> int:
    return BASE + (t.base.uid % 997) * 2**20 + t.view_offset


def fake_scratch(role: str, nbytes: int, zeroed: bool = False) -> int:
    return SCRATCH


def check_spec(spec: KernelSpec) -> None:
    assert spec.kernel in specs.KERNEL_SOURCES[spec.source], spec.kernel
    base = spec.kernel.split("<")[0]
    assert tuple(type(a) for a in spec.arg_values) == kernel_param_types(spec.source)[base]


@pytest.mark.parametrize(("dt", "a_shape", "b_view", "kernel"), [
    ("f16", (64, 4096), None, "mmv<W_F16, B_F32, 1, 2, true, EPI_NONE>"),
    ("f32", (64, 65), None, "mmv<W_F32, B_F32, 8, 2, false, EPI_NONE>"),  # K % 8 != 0: scalar
    ("bf16", (64, 80), None, "mmv<W_BF16, B_F32, 4, 2, true, EPI_NONE>"),
    ("q4_0", (64, 4096), None, "mmvq_stream<W_Q4_0, B_F32, 1, EPI_NONE, 2>"),
    ("q4_0", (64, 4128), None, "mmvq<W_Q4_0, 4, EPI_NONE>"),  # K % 256 != 0: two launches
    ("q8_0", (64, 96), "offset", "mmvq<W_Q8_0, 4, EPI_NONE>"),  # b read by elements: any layout
    ("q8_0", (64, 256), "offset", "mmvq_stream<W_Q8_0, B_F32, 4, EPI_NONE, 2>"),  # b misaligned: scalar loads
    ("q4_1", (64, 128), "T", "mmvq_stream<W_Q4_1, B_F32, 4, EPI_NONE, 2>"),
    ("q5_1", (64, 64), "f16", "mmvq_stream<W_Q5_1, B_F16, 8, EPI_NONE, 2>"),
    ("f16", (64, 96), "T", "mmv<W_F16, B_F32, 8, 2, false, EPI_NONE>"),  # b's K axis strided
    ("f32", (64, 96), "offset", "mmv<W_F32, B_F32, 8, 2, false, EPI_NONE>"),  # b rows misaligned
    ("q5_1", (64, 96), "f16", "mmvq<W_Q5_1, 4, EPI_NONE>"),
    ("bf16", (64, 96), "f16", "mmv<W_BF16, B_F16, 8, 2, true, EPI_NONE>"),
])
def test_mmv_spec_picks_the_variant(dt: str, a_shape: tuple, b_view: str | None, kernel: str) -> None:
    k = a_shape[-1]
    n = 1 if b_view is None and a_shape[-1] == 4096 else 3
    if b_view == "offset":
        x = od.input("x", (n, k + 1))
        b = x.view((n, k), x.strides, 4)
    elif b_view == "T":
        b = od.input("x", (k, n)).transpose()
    else:
        b = od.input("x", (n, k), "f16" if b_view == "f16" else "f32")
    y = ops.mul_mat(weight("w", a_shape, dt), b)
    launches = mmv.mmv_specs(y, y, fake_ptr, fake_scratch)
    spec = launches[-1]
    assert spec.kernel == kernel
    for sp in launches:
        check_spec(sp)
    if kernel.startswith("mmvq_stream"):  # one launch, b quantized in shared memory, no ids to check
        assert len(launches) == 1 and int(spec.args.err_.word) == 0
        assert spec.block == 32 * specs.STREAM.warps
        assert spec.smem == stream.stream_smem(dt, k, n, specs.STREAM.warps, specs.STREAM.stages)
        assert spec.grid[1:] == (1, 1) and spec.grid[0] >= 1
        assert int(spec.args.b) == fake_ptr(b)
        assert int(spec.args.preload) == 1  # params: the first weight copies go before the PDL wait
    elif dt in QUANTS:  # b quantized to q8_1 first, then QROWS rows a block
        quant = launches[0]
        assert len(launches) == 2 and quant.kernel == f"quantize_q8_1<{specs.B_KIND[b.dtype.name]}>"
        nbp = -(-k // 32 // 32) * 32
        assert quant.grid == (n, -(-k // 32 // 8)) and int(quant.args.b) == fake_ptr(b)
        assert int(quant.args.bq) == SCRATCH and int(quant.args.bds) == SCRATCH + n * nbp * 32
        assert spec.grid == (a_shape[0] // specs.QROWS, 1, 1) and spec.block == mmv.q_threads(k) and spec.smem == 0
        assert (int(spec.args.bq), int(spec.args.bds), int(spec.args.nbp)) == (SCRATCH, SCRATCH + n * nbp * 32, nbp)
    else:
        assert spec.grid == (a_shape[0] // 2, 1, 1) and spec.block == specs.BLOCK and spec.smem == 0


def dtypes_block_bytes(dt: str) -> int:
    return {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34}[dt]


def test_q_constants_mirror_the_kernel() -> None:
    """QROWS, QWARPS_MAX, QUANT_BLOCK as mmv.cu and mmv_common.cuh have them; threads a block from K."""
    src = specs.MMV_CU.read_text() + specs.KERNELS_DIR.joinpath("mmv_common.cuh").read_text()
    for name, value in (("QROWS", specs.QROWS), ("QWARPS_MAX", specs.QWARPS_MAX), ("QUANT_BLOCK", specs.QUANT_BLOCK)):
        assert re.search(rf"constexpr int {name} = {value};", src), name
    assert [mmv.q_threads(k) for k in (32, 1024, 2048, 4096, 5632, 14336)] == [32, 32, 64, 128, 128, 128]
    assert [mmv.q8_padded(k) for k in (32, 1024, 1056, 4096)] == [32, 32, 64, 128]


def test_mmf_constants_mirror_the_kernel() -> None:
    """specs/mmf.py's WARPS, UNIT, UNIT_BYTES, STAGES and STAGE_BYTES as mmf.cu has them (its shared memory is
    sized from them) and the launch bound of BLOCKS_PER_SM blocks an SM."""
    src = specs.MMF_CU.read_text()
    for name, value in (("WARPS", mmf.WARPS), ("UNIT", mmf.UNIT), ("UNIT_BYTES", mmf.UNIT_BYTES),
                        ("STAGES", mmf.STAGES), ("STAGE_BYTES", mmf.STAGE_BYTES)):
        assert re.search(rf"constexpr int {name} = {value};", src), name
    assert f"__launch_bounds__(mmfk::THREADS, {mmf.BLOCKS_PER_SM})" in src


def test_mmv_spec_batch_geometry() -> None:
    a = weight("w", (3, 2, 16, 64), "f16")
    y = ops.mul_mat(a, od.input("x", (6, 4, 5, 64)))
    (spec,) = mmv.mmv_specs(y, y, fake_ptr, fake_scratch)
    args = spec.args
    assert spec.grid == (8, 4, 6)
    assert (args.r2, args.r3) == (2, 2)
    assert (args.a_row, args.a_s2, args.a_s3) == (128, 16 * 128, 2 * 16 * 128)
    assert (args.b_col, args.b_s2, args.b_s3) == (256, 5 * 256, 4 * 5 * 256)
    assert (args.M, args.K, args.N) == (16, 64, 5)
    assert int(args.preload) == 1  # params: the first weights are loaded before the PDL wait
    (spec,) = mmv.mmv_specs(ops.mul_mat(od.input("w", (16, 64), "f16"), od.input("x", (5, 64))), y, fake_ptr,
                           fake_scratch)
    assert int(spec.args.preload) == 0  # inputs may be written by the kernel before: loaded after the wait


def test_mmv_id_and_grouped_specs() -> None:
    experts = weight("e", (8, 32, 64), "q4_0")
    ids = od.input("ids", (1, 4), "i32")
    y = ops.mul_mat_id(experts, od.input("x", (1, 1, 64)), ids)  # K % 256 != 0, legacy: not streamed
    guard = FakeGuard()
    quant, spec = mmv.mmv_id_specs(y, y, fake_ptr, fake_scratch, guard)
    assert guard.uses == [(y, ids, 8, f"an expert of {experts.describe()}", "its output row is filled with NaN")]
    assert (int(spec.args.err_.word), int(spec.args.err_.tag)) == (FAKE_WORD, 0)
    assert quant.kernel == "quantize_q8_1<B_F32>" and quant.grid == (1, 1)
    assert spec.kernel == "mmvq_id<W_Q4_0, EPI_NONE>" and spec.grid == (8, 4, 1)
    assert spec.block == 32 and spec.smem == 0
    check_spec(quant)
    check_spec(spec)
    y = ops.mul_mat_id(experts, od.input("x", (32, 1, 64)), od.input("ids", (32, 4), "i32"))
    route, quant, grouped = mmv.grouped_specs(y, y, fake_ptr, fake_scratch, guard)
    assert (int(route.args.err_.word), int(route.args.err_.tag), int(route.args.E)) == (FAKE_WORD, 1, 8)
    assert guard.uses[1][:3] == (y, y.srcs[2], 8)  # the route checks the ids; the grouped kernels read its table
    assert quant.kernel == "quantize_q8_1<B_F32>" and quant.grid == (32, 1)  # 32 tokens x 1 b row
    assert grouped.kernel == "mmvq_id_grouped<W_Q4_0, 8, EPI_NONE>" and grouped.grid == (8, 8)
    assert grouped.smem == 0
    check_spec(quant)
    check_spec(grouped)
    ids = od.input("ids", (32, 4), "i32")
    y = ops.mul_mat_id(weight("e16", (8, 32, 64), "f16"), od.input("x", (32, 4, 64)), ids)
    route, grouped = mmv.grouped_specs(y, y, fake_ptr, fake_scratch, FakeGuard())
    check_spec(route)
    check_spec(grouped)
    assert route.kernel == "moe_route" and route.grid == (1,) and route.smem == 2 * 4 * 8
    assert grouped.kernel == "mmv_id_grouped<W_F16, B_F32, 8, 2, true, EPI_NONE>"  # 128 pairs on 8 experts
    assert grouped.grid == (16, 8)


@pytest.mark.parametrize("b_rows", [1, 4])
def test_mmv_id_streams_block_formats(b_rows: int) -> None:
    """Whole-chunk rows of q4_0 experts take mmvq_stream, a grid batch a slot: the expert stride as a's
    batch stride, the ids and the number of experts passed, b's slot stride 0 when one b row serves all
    slots; preloaded only when the ids, not just the experts, are constant."""
    experts = weight("e", (8, 32, 256), "q4_0")
    x = od.input("x", (1, b_rows, 256))
    for ids, preload in ((od.input("ids", (1, 4), "i32"), 0), (od.param("ids", np.array([[3, 1, 7, 0]]), "i32"), 1)):
        y = ops.mul_mat_id(experts, x, ids)
        guard = FakeGuard()
        (spec,) = mmv.mmv_id_specs(y, y, fake_ptr, fake_scratch, guard)
        check_spec(spec)
        assert spec.kernel == "mmvq_stream<W_Q4_0, B_F32, 1, EPI_NONE, 2>" and spec.grid[1:] == (4, 1)
        assert [u[:3] for u in guard.uses] == [(y, ids, 8)]
        assert (int(spec.args.err_.word), int(spec.args.err_.tag)) == (FAKE_WORD, 0)
        args = spec.args
        assert (args.a_row, args.a_s2, args.N) == (8 * 18, 32 * 8 * 18, 1)
        assert args.b_s2 == (256 * 4 if b_rows > 1 else 0)
        assert (args.ids, args.E, args.preload) == (fake_ptr(ids), 8, preload)
    y = ops.mul_mat_id(weight("e", (8, 32, 96), "q4_0"), od.input("x", (1, 1, 96)), od.input("ids", (1, 4), "i32"))
    assert [s.kernel.split("<")[0] for s in mmv.mmv_id_specs(y, y, fake_ptr, fake_scratch, FakeGuard())] == [
        "quantize_q8_1", "mmvq_id"]  # K % 256 != 0, a legacy format: two launches
    y = ops.mul_mat_id(weight("e", (8, 32, 2880), "mxfp4"), od.input("x", (1, 1, 2880)),
                       od.input("ids", (1, 4), "i32"))
    (spec,) = mmv.mmv_id_specs(y, y, fake_ptr, fake_scratch, FakeGuard())
    assert spec.kernel == "mmvq_stream<W_MXFP4, B_F32, 1, EPI_NONE, 2, false, true>"  # K % 512 != 0: RAGGED


def test_fused_glu_spec() -> None:
    y = _glu_graph("q4_0", n=2, kind="geglu", bias=True)
    nodes = Graph.build(y).nodes
    prods, biases, glu = fusion.parts(nodes)
    quant, spec = mmv.mmv_specs(prods[0], nodes[-1], fake_ptr, fake_scratch, a1=prods[1].srcs[0],
                               bias0=biases[0], bias1=biases[1], glu=glu)
    assert quant.kernel == "quantize_q8_1<B_F32>"  # b quantized once for both weights
    assert spec.kernel == "mmvq<W_Q4_0, 2, EPI_GLU>"
    m = prods[0].shape[-1]
    assert spec.grid == (-(-m // (specs.QROWS // 2)), 1, 1)  # gate and up rows: half as many a block
    check_spec(spec)
    assert int(spec.args.a1) == fake_ptr(prods[1].srcs[0]) and int(spec.args.glu_kind) == 1  # geglu


# -- residual adds: an addend of the product's own shape, fused into the product's kernel ---------------------

#: (weight dtype, N, the product's path) of the residual tests: the mat-vecs at 2 and 8 columns (mmvq: rows of
#: partial chunks), mmf at 9 and 16, mmq at 16, 33 and 128 (every TABLE size class), mmq_small when selected (at
#: column counts of its own: a plan is cached by the graph's structure, not by the selection the tests set)
RESIDUAL_PATHS = (
    *((dt, n, "mmvf") for dt in ("f32", "bf16") for n in (2, 8)),
    *((dt, n, "mmvq_stream") for dt in ("q4_0", "q8_0", "q4_K") for n in (2, 8)),
    ("q5_0", 3, "mmvq"),
    *((dt, n, "mmf") for dt in ("f16", "bf16") for n in (9, 16)),
    *((dt, n, "mmq") for dt in ("q4_0", "q8_0", "q4_K") for n in (16, 33, 128)),
    ("q4_0", 24, "mmq_small"), ("q4_K", 32, "mmq_small"),
)


def select_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """The selection table set so that `path` takes its columns whatever the tuned constants say (mmf from 9
    columns; mmq for any count above the mat-vecs'; mmq_small from 9)."""
    monkeypatch.setattr(support, "MMF_MIN_N", support.MMV_MAX_N + 1)
    if path == "mmq":
        monkeypatch.setattr(support, "MMQ_MAX_N", 2**31)
        monkeypatch.setattr(support, "MMQ_WGMMA_MIN_N", 2**31)  # mmq_wgmma only where mmq declines
        monkeypatch.setattr(support, "MMQ_SMALL_MAX_N", support.MMV_MAX_N)
    elif path == "mmq_small":
        monkeypatch.setattr(support, "MMQ_SMALL_MIN_N", support.MMV_MAX_N + 1)


def residual(dt: str, m: int, k: int, n: int, batch: tuple = (), first: bool = False, pad: int = 0) -> Tensor:
    """add(mul_mat(w, x), r), or add(r, mul_mat(w, x)) when `first`: w (m, k) an input of dtype dt, x (*batch, n, k),
    r of the product's shape (*batch, n, m): an input, or with pad > 0 a view of one whose rows are m + pad floats
    (evenly spaced over the batch axis too)."""
    prod = ops.mul_mat(od.input("w", (m, k), dt), od.input("x", (*batch, n, k)))
    if pad:
        wide = od.input("r", (*batch, n, m + pad))
        r = wide.view((*batch, n, m), wide.strides)
    else:
        r = od.input("r", (*batch, n, m))
    return ops.add(r, prod) if first else ops.add(prod, r)


def residual_cases(dt: str, n: int, path: str) -> list[tuple[Tensor, int]]:
    """(graph, its addend's bias_col) for an entry of RESIDUAL_PATHS: two shapes (M off the tiles; one split of K
    and several for mmf and mmq), each with the product as the add's first source and a contiguous addend, and
    as its second source over a batch axis of 2 with padded addend rows."""
    if path == "mmvq":
        shapes = ((77, 288), (45, 4128))  # rows of partial 16-byte chunks: not mmvq_stream's
    elif dt in FLOATS:
        shapes = ((77, 40), (300, 8192))
    else:
        shapes = ((77, 256), (61, 14336))
    return [case for m, k in shapes
            for case in ((residual(dt, m, k, n), m), (residual(dt, m, k, n, batch=(2,), first=True, pad=24), m + 24))]


def fused_launches(nodes: list[Tensor], path: str, ptr: Callable[[Tensor], int] = fake_ptr) -> list[KernelSpec]:
    """The launches bind_fused makes for a mul_mat_add group whose product takes `path`, on fake addresses."""
    if path == "mmf":
        return mmf.mmf_fused_specs(nodes, ptr, fake_scratch, H200)
    if path in fusion.GEMM_PATHS:
        return bind.gemm_fused_specs(nodes, ptr, fake_scratch, H200)
    return mmv.fused_specs(nodes, ptr, fake_scratch, FakeGuard(), H200)


@pytest.mark.parametrize(("dt", "n", "path"), RESIDUAL_PATHS)
def test_residual_add_fuses_into_the_product(dt: str, n: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An addend of the product's shape fuses into every path that takes the epilogue, the product either source
    of the add: one launch writes the add, reading the addend's rows bias_col floats apart."""
    select_path(monkeypatch, path)
    for y, col in residual_cases(dt, n, path):
        plan = od.compile(y, H200)
        (step,) = plan.fusions
        what = f"{path} {dt} {y.shape}: {plan.explain()}"
        assert (step.plugin, step.kernel) == ("cuda_matmul", "mul_mat_add"), what
        assert len([s for s in plan.steps if s.kind in ("kernel", "fused")]) == 1, what
        prod, add = step.nodes  # the plan's own tensors (a cached plan's for a graph of the same structure)
        (bias,) = fusion.parts(step.nodes)[1]
        assert support.choose(prod, H200).path == path, what
        assert (add.op, add.shape, bias.shape, add.srcs.index(prod)) == ("add", y.shape, y.shape,
                                                                         int(y.srcs[1].op == "mul_mat")), what
        assert fusion.bias_col(prod, bias) == col
        launch = fused_launches(step.nodes, path)[-1]
        check_spec(launch)
        args = launch.args
        assert int(args.bias if path in fusion.GEMM_PATHS else args.bias0) == fake_ptr(bias)
        assert (int(args.bias_col), int(args.out)) == (col, fake_ptr(add))
        assert path in fusion.GEMM_PATHS or "EPI_BIAS" in launch.kernel


def test_bias_col_of_one_row_is_zero() -> None:
    """One row of M values (any leading 1s) is broadcast to every output row: bias_col 0, on the mat-vecs and on
    mmq; so is an addend of the product's shape when the product has one row."""
    for bias, b_shape in ((od.input("b", (32,)), (4, 256)), (od.input("b", (1, 1, 32)), (2, 4, 256)),
                          (od.input("b", (1, 32)), (1, 256))):
        x = od.input("x", b_shape)
        for dt in ("f16", "q4_0"):
            y = ops.add(ops.mul_mat(od.input("w", (32, 256), dt), x), bias)
            (step,) = od.compile(y, H200).fusions
            assert fusion.bias_col(step.nodes[0], bias) == 0
            (launch,) = fused_launches(step.nodes, support.choose(step.nodes[0], H200).path)[-1:]
            assert int(launch.args.bias_col) == 0 and int(launch.args.bias0) == fake_ptr(bias)


def test_mmq_residual_with_misaligned_weights_raises() -> None:
    """The fused mmq group cannot fall back to cuBLAS: weights off a 16-byte boundary (an arena aligns to 256)
    raise a ValueError naming the product."""
    y = residual("q4_0", 64, 256, 16)
    with pytest.MonkeyPatch.context() as mp:
        select_path(mp, "mmq")
        (step,) = od.compile(y, H200).fusions
        with pytest.raises(ValueError, match=r"mmq: the weights of .* are not 16-byte aligned"):
            fused_launches(step.nodes, "mmq", lambda t: fake_ptr(t) + (8 if t.name == "w" else 0))


def test_cublaslt_structs_and_alignment() -> None:
    """cublasLt's heuristic result is 96 bytes (an array of them is read past index 0), and the
    alignment told to its heuristic divides the address and the batch stride, at most 256."""
    import ctypes

    from opdispatch.backends.cuda import cublas

    assert ctypes.sizeof(cublas.LtAlgo) == 64 and ctypes.sizeof(cublas.LtHeuristic) == 96
    assert cublas._alignment(0x7F0000000100, 0) == 256
    assert cublas._alignment(0x7F0000000102, 0) == 2
    assert cublas._alignment(0x7F0000000100, 3 * 4096 * 2 + 16) == 16


def test_every_kernel_instance_is_a_template_of_the_sources() -> None:
    for source, names in specs.KERNEL_SOURCES.items():
        text = source.read_text()
        for name in names:
            assert re.search(rf"\b{name.split('<')[0]}\(", text), name


# -- cuBLAS call specs, emulated with numpy ----------------------------------------------------------

NP = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
B_OF = {v: k for k, v in specs.B_KIND.items()}
W_OF = {v: k for k, v in specs.W_KIND.items()}


class Memory:
    """A flat byte array standing for device memory: tensors and scratch buffers placed in it."""

    def __init__(self) -> None:
        self.mem = np.zeros(1 << 24, np.uint8)
        self.top = 256
        self.where: dict[Tensor, int] = {}

    def alloc(self, nbytes: int) -> int:
        at = self.top
        self.top = (self.top + nbytes + 255) // 256 * 256
        assert self.top <= self.mem.size
        return at

    def place(self, t: Tensor, data: np.ndarray | None = None) -> None:
        b = t.base
        if b not in self.where:
            self.where[b] = self.alloc(b.nbytes)
            if data is not None:
                self.mem[self.where[b]:self.where[b] + b.nbytes] = data

    def ptr(self, t: Tensor) -> int:
        return self.where[t.base] + t.view_offset

    def scratch(self, role: str, nbytes: int, zeroed: bool = False) -> int:
        return self.alloc(nbytes)

    def array(self, ptr: int, shape: tuple, strides: tuple, dt: np.dtype) -> np.ndarray:
        return np.ndarray(shape, dt, self.mem, offset=ptr, strides=strides)

    def run(self, spec: KernelSpec | GemmSpec) -> None:
        if isinstance(spec, GemmSpec):
            self.gemm(spec)
        else:
            self.convert(spec)

    def convert(self, spec: KernelSpec) -> None:
        kind, types = spec.kernel.split("<")
        if kind in ("convert_norm", "convert_glu"):
            return self.prologue(kind, B_OF[types.rstrip(">").split(",")[0].strip()], spec.args)
        ts, td = (x.strip() for x in types.rstrip(">").split(","))
        args = [int(a) for a in spec.arg_values]
        if kind == "convert":
            src, n0, n1, n2, n3, s0, s1, s2, s3, dst = args
            vals = self.array(src, (n3, n2, n1, n0), (s3, s2, s1, s0), NP[B_OF[ts]]).astype(np.float32)
        else:
            src, n0, n1, n2, n3, s1, s2, s3, dst = args
            wt = W_OF[ts]
            row = n0 // 32 * {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34}[wt]
            raw = self.array(src, (n3, n2, n1, row), (s3, s2, s1, 1), np.dtype(np.uint8))
            vals = dequantize(wt, np.ascontiguousarray(raw))
        out = from_float(B_OF[td], vals)
        flat = np.ascontiguousarray(out).view(np.uint8).reshape(-1)
        self.mem[dst:dst + flat.size] = flat

    def prologue(self, kind: str, td: str, args: attrs.AttrsInstance) -> None:
        """convert_norm (rms_norm(x) * w, x's rows s1 bytes apart) or convert_glu (act(g) * u) into td."""
        if kind == "convert_norm":
            x = self.array(int(args.x), (int(args.rows), int(args.n0)), (int(args.s1), 4), NP["f32"]).astype(np.float64)
            w = self.array(int(args.w), (int(args.n0),), (4,), NP["f32"])
            vals = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + float(args.eps)) * w
        else:
            g, u = (self.array(int(p), (int(args.n),), (4,), NP["f32"]) for p in (args.g, args.u))
            y = ops.glu_split(od.param("g", g.copy()), od.param("u", u.copy()), GLU_KINDS[int(args.kind)],
                              float(args.alpha), float(args.limit))
            (vals,) = od.compile(y, "cpu").run({})
        flat = np.ascontiguousarray(from_float(td, vals.astype(np.float32))).view(np.uint8).reshape(-1)
        dst = int(args.dst)
        self.mem[dst:dst + flat.size] = flat

    def gemm(self, g: GemmSpec) -> None:
        if g.kind == "gemm":
            trips = [(g.a, g.b, g.c)]
        elif g.kind == "strided":
            sa, sb, sc = g.strides
            ea, eb = NP[g.a_type].itemsize, NP[g.b_type].itemsize
            trips = [(g.a + i * sa * ea, g.b + i * sb * eb, g.c + i * sc * 4) for i in range(g.batch)]
        else:
            trips = list(g.ptrs)
        for pa, pb, pc in trips:
            a = self.colmajor(pa, (g.k, g.m) if g.transa else (g.m, g.k), g.lda, g.a_type)
            b = self.colmajor(pb, (g.n, g.k) if g.transb else (g.k, g.n), g.ldb, g.b_type)
            c = (a.T if g.transa else a) @ (b.T if g.transb else b)
            if g.addend:
                c = c + self.colmajor(g.addend, (g.m, g.n), g.ldc, "f32")
            self.colmajor(pc, (g.m, g.n), g.ldc, "f32")[...] = c

    def colmajor(self, ptr: int, shape: tuple, ld: int, dtype: str) -> np.ndarray:
        """Element (i, j) at ptr + (i + j * ld) * size: cuBLAS' view of memory."""
        assert ld >= shape[0], (ld, shape)
        dt = NP[dtype]
        view = self.array(ptr, shape, (dt.itemsize, ld * dt.itemsize), dt)
        return view if dtype == "f32" else view.astype(np.float64)


def _emulate(y: Tensor, make_specs: Callable) -> tuple[np.ndarray, np.ndarray, list]:
    graph = Graph.build(y)
    memory = Memory()
    for leaf in graph.leafs:
        memory.place(leaf, leaf.data)
    memory.place(y)
    launches = make_specs(y, memory.ptr, memory.scratch)
    for spec in launches:
        memory.run(spec)
    got = np.array(memory.array(memory.ptr(y), y.shape, y.strides, np.dtype(np.float32)))
    (ref,) = od.compile(y, "cpu").run({})
    return got, ref, launches


def _param(shape: tuple, dt: str, rng: np.random.Generator) -> Tensor:
    return od.param("p", rng.uniform(-1, 1, shape).astype(np.float32), dt)


GEMM_CASES = {
    # name: (a dtype, a shape, b dtype, b leaf shape, view of b, expected kinds)
    "f16 plain": ("f16", (16, 64), "f16", (24, 64), None, ["gemm"]),
    "f32 batch strided": ("f32", (3, 16, 65), "f32", (3, 24, 65), None, ["strided"]),
    "bf16 f32 b converted": ("bf16", (16, 80), "f32", (24, 80), None, ["convert", "gemm"]),
    "f16 broadcast folded": ("f16", (2, 16, 64), "f16", (6, 24, 64), None, ["strided"]),
    "f16 broadcast 4-d": ("f16", (3, 1, 16, 64), "f16", (3, 2, 12, 64), None, ["strided"]),
    "f16 broadcast a3": ("f16", (1, 2, 16, 64), "f16", (3, 4, 12, 64), None, ["batched"]),
    "f32 permuted b": ("f32", (2, 16, 64), "f32", (12, 4, 64), lambda x: x.permute(1, 0, 2), ["batched"]),
    "f32 transposed b": ("f32", (16, 64), "f32", (64, 12), lambda x: x.transpose(), ["gemm"]),
    "f16 offset b": ("f16", (16, 64), "f16", (12, 96), lambda x: x.view((12, 64), x.strides, 2), ["gemm"]),
    "f16 strided b elements": ("f16", (16, 32), "f16", (12, 64), lambda x: x.view((12, 32), (128, 4)),
                               ["convert", "gemm"]),
    "q4_0 dequant": ("q4_0", (16, 64), "f32", (20, 64), None, ["dequant", "convert", "gemm"]),
    "q5_1 dequant batched": ("q5_1", (2, 16, 96), "f32", (2, 10, 96), None, ["dequant", "convert", "strided"]),
    "q8_0 broadcast": ("q8_0", (2, 1, 8, 32), "f32", (2, 3, 9, 32), None, ["dequant", "convert", "strided"]),
}


@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_gemm_specs_compute_mul_mat(case: str, rng) -> None:  # noqa: ANN001
    ta, a_shape, tb, b_shape, view, kinds = GEMM_CASES[case]
    b = _param(b_shape, tb, rng)
    y = ops.mul_mat(_param(a_shape, ta, rng), view(b) if view else b)
    got, ref, launches = _emulate(y, gemm.gemm_specs)
    for s in launches:
        if isinstance(s, KernelSpec):
            check_spec(s)
    got_kinds = [s.kind if isinstance(s, GemmSpec) else s.kernel.split("<")[0] for s in launches]
    assert got_kinds == kinds
    assert nmse(got, ref) <= NMSE_MAX, nmse(got, ref)


OUT_PROD_CASES = {
    "f32": ("f32", (7, 13), (7, 5), None, ["gemm"]),
    "f32 batched broadcast": ("f32", (2, 7, 13), (4, 7, 5), None, ["batched"]),
    "f16 converted": ("f16", (2, 3, 9, 11), (2, 6, 9, 4), None, ["convert", "batched"]),
    "q8_0": ("q8_0", (11, 64), (11, 5), None, ["dequant", "gemm"]),
    "b transposed": ("f32", (7, 13), (16, 7), lambda x: x.transpose(), ["gemm"]),
    "b strided": ("f32", (7, 13), (7, 10), lambda x: x.view((7, 5), (40, 8)), ["convert", "gemm"]),
    "k = 1": ("f32", (1, 13), (1, 5), None, ["gemm"]),
}


@pytest.mark.parametrize("case", list(OUT_PROD_CASES))
def test_out_prod_specs_compute_out_prod(case: str, rng) -> None:  # noqa: ANN001
    ta, a_shape, b_shape, view, kinds = OUT_PROD_CASES[case]
    b = _param(b_shape, "f32", rng)
    y = ops.out_prod(_param(a_shape, ta, rng), view(b) if view else b)
    got, ref, launches = _emulate(y, gemm.out_prod_specs)
    for s in launches:
        if isinstance(s, KernelSpec):
            check_spec(s)
    assert [s.kind if isinstance(s, GemmSpec) else s.kernel.split("<")[0] for s in launches] == kinds
    assert nmse(got, ref) <= 1e-10, nmse(got, ref)


# -- on a GPU -------------------------------------------------------------------------------------


def uniform(rng: np.random.Generator, shape: tuple, lo: float = -1, hi: float = 1) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float32)


def assert_close(got: np.ndarray, ref: np.ndarray, what: str, bound: float = NMSE_MAX) -> None:
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (an element not written?)"
    err = nmse(got, ref)
    assert err <= bound, f"{what}: NMSE {err:.3g} > {bound}"


def feeds_for(y: Tensor | list, rng: np.random.Generator, n_experts: int = 0) -> dict:
    feeds = {}
    for t in Graph.build(y).inputs:
        if t.dtype.name == "i32":  # expert ids: distinct along the last axis
            order = np.argsort(rng.random(t.shape[:-1] + (n_experts,)), axis=-1)
            feeds[t] = order[..., : t.shape[-1]].astype(np.int32)
        elif not encodable(t.dtype):  # a grid I-quant: random valid blocks, as opdispatch cannot round to it
            raw_shape = t.array_layout()[0]
            feeds[t] = random_blocks(rng, t.dtype.name, int(np.prod(raw_shape)) // t.dtype.block_bytes
                                     ).reshape(raw_shape)
        else:
            feeds[t] = uniform(rng, t.shape)
    return feeds


def run_both(y: Tensor, feeds: dict, path: str | None = None, **kw: object) -> tuple[od.Plan, np.ndarray, np.ndarray]:
    """(plan on cuda0, its output, the reference's); every matrix product taken by cuda_matmul."""
    plan = od.compile(y, "cuda0", **kw)
    for s in plan.steps:
        if s.kind in ("kernel", "fused") and s.nodes[0].op in MATMUL_OPS:
            assert (s.plugin, s.device.name) == ("cuda_matmul", "cuda0"), plan.explain()
            if path is not None and s.kind == "kernel":
                assert s.kernel == path, plan.explain()
    (got,) = plan.run(feeds)
    (ref,) = od.compile(y, "cpu").run(feeds)
    return plan, got, ref


SWEEP_N = (*range(1, 10), 16, 128, 512)
MMQ_N = (9, 16, 32, 64, 128, 512, 33, 70, 513)  # every entry of specs/mmq.TABLE, full and partial column tiles


@gpu
@pytest.mark.usefixtures("mmq_any_n")
@pytest.mark.parametrize("n", MMQ_N)
@pytest.mark.parametrize("dt", QUANTS)
def test_mmq(dt: str, n: int, rng) -> None:  # noqa: ANN001
    """The quantized GEMM against the reference: odd M (partial row tiles), K tails (q4_1 K 384: a 4-block
    K tile; q5_1 K 1088: 2 blocks), a long K; three runs of the plan (warm-up, CUDA-graph capture,
    replay), its arenas poisoned before each."""
    tail = {"q4_1": 384, "q5_1": 1088}.get(dt, 768)
    mmq_three_runs(dt, n, ((77, 256), (130, tail), (61, 14336)), lambda y: feeds_for(y, rng), lambda f: f)


def mmq_three_runs(dt: str, n: int, shapes: tuple[tuple[int, int], ...], feeds_of: Callable,
                   ref_feeds: Callable, *bound: float, path: str = "mmq") -> None:
    """mul_mat of (m, k) `dt` weights by n columns for each of `shapes` planned on `path` (mmq, mmq_small), run
    three times (warm-up, CUDA-graph capture, replay), its arenas poisoned before each, against the CPU reference
    on ref_feeds(feeds)."""
    for m, k in shapes:
        y = ops.mul_mat(od.input("a", (m, k), dt), od.input("b", (n, k)))
        plan = od.compile(y, "cuda0")
        (step,) = steps_of(plan, "mul_mat")
        assert step.kernel == path, plan.explain()
        for run in range(3):
            feeds = feeds_of(y)
            poison_arenas(plan)
            (got,) = plan.run(feeds)
            (ref,) = od.compile(y, "cpu").run(ref_feeds(feeds))
            assert_close(got, ref, f"{path} a={dt} m={m} k={k} n={n}, run {run}", *bound)


@gpu
@pytest.mark.usefixtures("mmq_any_n")
@pytest.mark.parametrize(("n", "path"), [(16, "mmq"), (64, "mmq"), (128, "mmq")])
def test_mmq_split_k_is_deterministic(n: int, path: str, rng) -> None:  # noqa: ANN001
    """Split K (the last block of a tile adds the slices in order): the same inputs give the same bits,
    run after run and replay after replay, whichever block finishes last."""
    split_k_deterministic(n, path, rng)


def split_k_deterministic(n: int, path: str, rng: np.random.Generator) -> None:
    y = ops.mul_mat(od.input("a", (300, 14336), "q4_0"), od.input("b", (n, 14336)))
    plan = od.compile(y, "cuda0")
    (step,) = steps_of(plan, "mul_mat")
    assert step.kernel == path, plan.explain()
    feeds = feeds_for(y, rng)
    (first,) = plan.run(feeds)
    (ref,) = od.compile(y, "cpu").run(feeds)
    assert_close(first, ref, f"{path} split K n={n}")
    for run in range(3):
        (got,) = plan.run(feeds)
        assert np.array_equal(got, first), f"{path} split K n={n}: run {run + 1} differs from the first"


def force_a8(monkeypatch: pytest.MonkeyPatch, cfg: mmq.MmqConfig) -> None:
    """mmq takes every column count above the mat-vecs' (as mmq_any_n), with the converted-tile configuration cfg
    above 64 columns in both tables: split in 2 slices up to 128, as given above (mmq_id: for more than
    specs/mmq_id.SMALL_MEAN pairs an expert)."""
    monkeypatch.setattr(support, "MMQ_MAX_N", 2**31)
    monkeypatch.setattr(support, "MMQ_WGMMA_MIN_N", 2**31)  # mmq_wgmma only where mmq declines
    monkeypatch.setattr(support, "MMQ_SMALL_MAX_N", support.MMV_MAX_N)
    for name in ("TABLE", "TABLE_K"):
        few = tuple(e for e in getattr(mmq, name) if e[0] <= 64)
        monkeypatch.setattr(mmq, name, (*few, (128, attrs.evolve(cfg, splits=2)), (2**31, cfg)))


#: the a8 configurations the sweep times (specs/mmq.py), by name
A8_CONFIGS = {"wide": mmq.A8_WIDE, "tall": mmq.A8_TALL, "64": mmq.A8_64}
#: columns of the a8 GPU tests: split K (100), a partial column tile (129, 513 for 128-column tiles), whole ones
A8_N = (100, 129, 256, 512)


def test_a8_configs_fit_and_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every a8 configuration fits the H200's shared memory for every mmq format (its ring and converted tile); forced
    into the table, the plan launches its instance (A8 named) on the grid of its tiles and splits."""
    for cfg in A8_CONFIGS.values():
        assert {cfg.template} <= {c.template for cands in mmq.CANDIDATES.values() for c in cands}
        for dt in mmq.MMQ_FORMATS:
            assert mmq.mmq_smem(dt, cfg) == mmq.mmq_smem(dt, attrs.evolve(cfg, a8=False)) + mmq.conv_bytes(dt, cfg)
            assert mmq.mmq_fits(dt, 512, H200, cfg), (dt, str(cfg), mmq.mmq_smem(dt, cfg))
    assert mmq.conv_bytes("q4_0", mmq.A8_WIDE) == 8 * 8 * (512 + 8 * 16)
    assert mmq.conv_bytes("q2_K", mmq.A8_WIDE) == 8 * 8 * (512 + 8 * 32)
    force_a8(monkeypatch, mmq.A8_WIDE)
    for dt, m, k, n, splits in (("q4_0", 4096, 14336, 512, 1), ("q6_K", 77, 4096, 129, 1), ("q8_0", 300, 2048, 100, 2)):
        y = ops.mul_mat(zero_weight("w", (m, k), dt), od.input("x", (n, k)))
        assert support.choose(y, H200).path == "mmq"
        quant, spec = mmq.mmq_specs(y, fake_ptr, fake_scratch)
        cfg = attrs.evolve(mmq.A8_WIDE, splits=splits)
        assert mmq.mmq_config(dt, n) == cfg and spec.kernel == mmq.instance_name(dt, cfg)
        assert spec.kernel.endswith(", true>") and spec.args.splits == splits
        assert spec.grid == (-(-m // 128) * splits * -(-n // 128), 1, 1) and spec.block == 256
        assert spec.smem == mmq.mmq_smem(dt, cfg) <= stream.device_facts(H200).smem_per_block_optin
    y = moe("q4_0", 64, 2048, 2048, 512, 8, False, False)
    assert mmq_id.mmq_id_specs(y, y, fake_ptr, fake_scratch, FakeGuard())[-1].kernel == \
        mmq_id.instance_name("q4_0", mmq.A8_WIDE)


@gpu
@pytest.mark.parametrize("n", A8_N)
@pytest.mark.parametrize("dt", mmq.MMQ_FORMATS)
def test_mmq_a8(dt: str, n: int, monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    """mmq with the converted K tile (specs/mmq.A8_WIDE: 128 x 128 blocks) for every format against the reference
    on b rounded to q8_1 (its only rounding): odd M (partial row tiles), K tails (q4_1 K 384, q5_1 K 1088: a short
    last K tile), a long K, split and unsplit; three runs (warm-up, CUDA-graph capture, replay), the arenas
    poisoned before each."""
    force_a8(monkeypatch, mmq.A8_WIDE)
    mmq_a8_runs(dt, n, rng)


@gpu
@pytest.mark.parametrize("n", [129, 512])
@pytest.mark.parametrize("cfg", ["tall", "64"])
@pytest.mark.parametrize("dt", ["q4_0", "q8_0", "q4_K", "q6_K"])
def test_mmq_a8_other_tiles(dt: str, cfg: str, n: int, monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    """The other a8 configurations the sweep times (32 x 64 warps; today's 128 x 64 tiles with a8), as test_mmq_a8."""
    force_a8(monkeypatch, A8_CONFIGS[cfg])
    mmq_a8_runs(dt, n, rng)


def mmq_a8_runs(dt: str, n: int, rng: np.random.Generator) -> None:
    if dt in specs.LEGACY_NAMES:
        tail = {"q4_1": 384, "q5_1": 1088}.get(dt, 768)
        shapes, feeds_of = ((77, 256), (131, tail), (61, 14336)), lambda y: feeds_for(y, rng)
    else:
        rv = stream.stream_geo(dt).row_values
        shapes, feeds_of = ((77, rv), (131, 3 * rv), (61, 14336)), lambda y: subscaled_feeds(y, rng)
    assert mmq.mmq_config(dt, n).a8
    mmq_three_runs(dt, n, shapes, feeds_of, lambda f: q8_1_rounded(f, "b"), Q8_1_NMSE)


@gpu
@pytest.mark.parametrize("n", [100, 512])
def test_mmq_a8_split_k_is_deterministic(n: int, monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    """Split K with the converted K tile (100 columns: 2 slices) and unsplit: the same bits run after run."""
    force_a8(monkeypatch, mmq.A8_WIDE)
    split_k_deterministic(n, "mmq", rng)


@gpu
@pytest.mark.parametrize("dt", ["q4_0", "q4_K", "q6_K"])
def test_mmq_id_a8(dt: str, monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    """mul_mat_id on mmq_id with the converted K tile (the table's many-column entry: specs/mmq.A8_WIDE) at the MoE
    prefill shape (64 experts, 8 used, 512 tokens; 77 rows: a partial row tile) against the reference on b rounded
    to q8_1; three runs, arenas poisoned and new ids each time."""
    force_a8(monkeypatch, mmq.A8_WIDE)
    take_id_gemm(monkeypatch, "mmq_id")
    n_tok, used, n_exp = 512, 8, 64
    assert mmq_id.mmq_id_config(dt, n_tok * used, n_exp) == mmq.A8_WIDE
    mmq_id_three_runs(dt, n_tok, n_exp, used, 1, rng)


MMQ_SMALL_N = (9, 16, 17, 32)  # both column tiles, full and partial


@pytest.mark.usefixtures("mmq_small_selected")
@gpu
@pytest.mark.parametrize("n", MMQ_SMALL_N)
@pytest.mark.parametrize("dt", mmq.MMQ_FORMATS)
def test_mmq_small(dt: str, n: int, rng) -> None:  # noqa: ANN001
    """The weight-streaming quantized GEMM of every format against the reference (sub-scaled formats: on b
    rounded to q8_1, their only rounding, with random valid blocks): odd M (a partial warp tile and row tile),
    K tails (q4_1 K 384, q5_1 K 1088: a short last K tile), a long K (split K); three runs (warm-up,
    CUDA-graph capture, replay), the arenas poisoned before each."""
    rv = stream.stream_geo(dt).row_values
    if dt in specs.LEGACY_NAMES:
        tail = {"q4_1": 384, "q5_1": 1088}.get(dt, 768)
        mmq_three_runs(dt, n, ((77, 256), (131, tail), (61, 14336)), lambda y: feeds_for(y, rng), lambda f: f,
                       path="mmq_small")
    else:
        mmq_three_runs(dt, n, ((77, rv), (131, 3 * rv), (61, 14336)), lambda y: subscaled_feeds(y, rng),
                       lambda f: q8_1_rounded(f, "b"), Q8_1_NMSE, path="mmq_small")


@pytest.mark.usefixtures("mmq_small_selected")
@gpu
@pytest.mark.parametrize("n", [9, 32])
def test_mmq_small_split_k_is_deterministic(n: int, rng) -> None:  # noqa: ANN001
    """mmq_small's split K adds the slices in order too: the same bits run after run."""
    split_k_deterministic(n, "mmq_small", rng)


@pytest.mark.usefixtures("mmq_small_selected")
@gpu
@pytest.mark.parametrize("dt", ["q4_0", "q4_K"])
@pytest.mark.parametrize("bs", [(2, 3), (3, 2)])
def test_mmq_small_broadcast_batches(dt: str, bs: tuple, rng) -> None:  # noqa: ANN001
    """Batched mmq_small, a's batches repeat-interleaved over b's, b f32 / f16 / transposed."""
    a = od.input("a", (1, bs[1], 45, 256), dt)
    for b in (od.input("b", (*bs, 17, 256)), od.input("b", (*bs, 17, 256), "f16"),
              od.input("b", (*bs, 256, 17)).transpose()):
        y = ops.mul_mat(a, b)
        _, got, ref = run_both(y, feeds_for(y, rng), path="mmq_small")
        assert_close(got, ref, f"mmq_small a={dt} bs={bs} b {b.describe()}")


def test_mmq_small_grid_on_the_h200() -> None:
    """mmq_small's cut of the benchmark's shapes on the H200's description: split K into as many slices as keep
    the grid within SMALL.blocks_per_sm blocks an SM (one wave), slices of kt_min K tiles at least, and the shared
    memory fits."""
    cfg, sms = mmq_small.SMALL, 132
    for dt, m, k, n in (("q4_0", 14336, 4096, 16), ("q8_0", 4096, 14336, 32), ("q4_K", 2048, 2048, 16),
                        ("q4_0", 2048, 8192, 9)):
        g = mmq_small.small_grid(m, k, 1, H200)
        nkt = -(-k // 32 // cfg.kb)
        assert g.tiles_m == -(-m // cfg.bm) and 1 <= g.splits <= min(cfg.split_max, nkt // cfg.kt_min)
        assert g.splits == cfg.split_max or g.splits == nkt // cfg.kt_min or \
            g.tiles_m * g.splits <= cfg.blocks_per_sm * sms < g.tiles_m * (g.splits + 1), (dt, m, k, g)
        assert g.kts * g.splits >= nkt > (g.kts - 1) * g.splits
        smem = mmq_small.small_smem(dt, mmq_small.small_nt(n), g.kts)
        assert smem <= 227 * 1024, (dt, smem)
    assert mmq_small.small_grid(14336, 4096, 1, H200) == mmq_small.SmallGrid(112, 2, 8)
    assert mmq_small.small_grid(8192, 2048, 2, H200) == mmq_small.SmallGrid(64, 2, 4)  # the gate/up pair: 256 blocks
    assert mmq_small.small_smem("q4_0", 2, 6) == 16 * (6 * 8 * 40 + 32) + cfg.warps * cfg.stages * 16 * 144


def test_mmq_small_config_by_waves_on_the_h200() -> None:
    """SMALL_WAVE where its grid is one wave on the H200's description (the 1b preset's q/k/v and o weights), SMALL
    where it would be more (its gate/up and down, a 8B model's)."""
    for (m, k), wave in (((3072, 2048), True), ((2048, 2048), True), ((8192, 2048), False), ((2048, 8192), False),
                         ((4096, 14336), False)):
        for dt in ("q4_0", "q4_K", "q8_0"):
            node = ops.mul_mat(zero_weight("w", (m, k), dt), od.input("x", (16, k)))
            cfg = mmq_small.small_config(node, H200)
            assert cfg == (mmq_small.SMALL_WAVE if wave else mmq_small.SMALL), (dt, m, k)
            g = mmq_small.small_grid(m, k, 1, H200, cfg)
            assert (g.tiles_m * g.splits <= 132) == wave, (dt, m, k, g)  # SMALL_WAVE's blocks: one an SM
            assert mmq_small.small_fits(node, H200)
            assert support.choose(node, H200).path == "mmq_small", (dt, m, k)
            assert mmq_small.small_specs(node, fake_ptr, fake_scratch, H200)[-1].kernel == mmq_small.small_name(
                dt, 2, cfg)


@pytest.mark.usefixtures("mmq_small_selected")
def test_mmq_small_declines_what_mmq_takes() -> None:
    """Past MMQ_SMALL_MAX_N columns, below MMQ_SMALL_MIN_N, or where b's slice and the rings do not fit, mmq
    runs the node, and mmq_small's Kernel says why."""
    node = ops.mul_mat(weight("w", (64, 4096), "q4_0"), od.input("x", (support.MMQ_SMALL_MAX_N + 1, 4096)))
    assert support.mmq_small_ok(node, H200) == f"N={support.MMQ_SMALL_MAX_N + 1} > {support.MMQ_SMALL_MAX_N}"
    few = ops.mul_mat(weight("w", (64, 4096), "q4_0"), od.input("x", (support.MMQ_SMALL_MIN_N - 1, 4096)))
    assert support.mmq_small_ok(few, H200) == f"N={support.MMQ_SMALL_MIN_N - 1} < {support.MMQ_SMALL_MIN_N}: mmq is " \
        "faster there"
    (k,) = [k for k in cm.kernels(device=H200) if k.name == "mmq_small"]
    assert k.supports(H200, node) == "mmq takes it"
    big = ops.mul_mat(weight("w", (16, 1 << 20), "q8_0"), od.input("x", (32, 1 << 20)))  # one row tile: no split
    assert support.mmq_small_ok(big, H200) == "b's slice and the warps' rings do not fit in shared memory"
    off = ops.mul_mat(weight("w", (64, 96), "q8_0"), od.input("x", (16, 96)))
    assert support.mmq_small_ok(off, H200) == support.mmq_ok(off, H200)


@gpu
@pytest.mark.usefixtures("mmq_any_n")
@pytest.mark.parametrize(("bs", "nr"), [((1, 1), (2, 3)), ((2, 3), (1, 1)), ((3, 2), (2, 2))])
@pytest.mark.parametrize("dt", QUANTS)
@pytest.mark.parametrize("n", [9, 64, 130])
def test_mmq_broadcast_batches(dt: str, n: int, bs: tuple, nr: tuple, rng) -> None:  # noqa: ANN001
    """Batched mmq, a's batches repeat-interleaved over b's (r2, r3), b f32 / f16 / transposed."""
    a = od.input("a", (*bs, 45, 256), dt)
    for b in (od.input("b", (bs[0] * nr[0], bs[1] * nr[1], n, 256)),
              od.input("b", (bs[0] * nr[0], bs[1] * nr[1], n, 256), "f16"),
              od.input("b", (bs[0] * nr[0], bs[1] * nr[1], 256, n)).transpose()):
        y = ops.mul_mat(a, b)
        _, got, ref = run_both(y, feeds_for(y, rng), path="mmq")
        assert_close(got, ref, f"mmq a={dt} bs={bs} nr={nr} n={n} b {b.describe()}")


@gpu
@pytest.mark.parametrize("n", SWEEP_N)
@pytest.mark.parametrize("dt", FLOATS + QUANTS)
def test_mul_mat_sweep(dt: str, n: int, rng) -> None:  # noqa: ANN001
    ks = (64, 65, 80) if dt in FLOATS else (64, 96)
    for k in ks:
        a, b = od.input("a", (16, k), dt), od.input("b", (n, k))
        y = ops.mul_mat(a, b)
        plan, got, ref = run_both(y, feeds_for(y, rng))
        assert_close(got, ref, f"mul_mat a={dt} n={n} k={k} ({steps_of(plan, 'mul_mat')[0].kernel})")


@gpu
@pytest.mark.parametrize(("bs", "nr"), list(itertools.product(((1, 1), (1, 2), (3, 1), (3, 2)),
                                                              ((1, 1), (1, 2), (2, 1), (2, 2)))))
@pytest.mark.parametrize("dt", ["f32", "f16", "bf16", "q4_0", "q8_0"])
def test_mul_mat_broadcast_batches(dt: str, bs: tuple, nr: tuple, rng) -> None:  # noqa: ANN001
    for n, k in itertools.product((1, 7, 16), (64, 256) if dt in QUANTS else (64,)):  # K 256: mmvq_stream
        a = od.input("a", (*bs, 13, k), dt)
        b = od.input("b", (bs[0] * nr[0], bs[1] * nr[1], n, k))
        y = ops.mul_mat(a, b)
        _, got, ref = run_both(y, feeds_for(y, rng))
        assert_close(got, ref, f"mul_mat a={dt} bs={bs} nr={nr} n={n} k={k}")


B_LAYOUTS: dict[str, Callable[[Tensor], Tensor]] = {
    "permuted batches": lambda x: x.permute(1, 0, 2, 3),
    "transposed": lambda x: x.transpose(),
    "offset rows": lambda x: x.view(x.shape[:-1] + (x.shape[-1] - 32,), x.strides, 4 * 32 // 2),
}


def _b_leaf_shape(layout: str, shape: tuple) -> tuple:
    if layout == "permuted batches":
        return (shape[1], shape[0], *shape[2:])
    if layout == "transposed":
        return (*shape[:-2], shape[-1], shape[-2])
    return (*shape[:-1], shape[-1] + 32)


@gpu
@pytest.mark.parametrize("layout", list(B_LAYOUTS))
@pytest.mark.parametrize("n", [1, 5, 16, 128])
@pytest.mark.parametrize("dt", ["f32", "f16", "bf16", "q4_1", "q8_0"])
def test_mul_mat_b_layouts(dt: str, n: int, layout: str, rng) -> None:  # noqa: ANN001
    for k in (64, 256) if dt in QUANTS else (64,):  # K 256: mmvq_stream (b read by elements or 16 bytes)
        shape = (2, 3, n, k)
        x = od.input("x", _b_leaf_shape(layout, shape))
        b = B_LAYOUTS[layout](x)
        assert b.shape == shape
        y = ops.mul_mat(od.input("a", (1, 3, 24, k), dt), b)
        _, got, ref = run_both(y, feeds_for(y, rng))
        assert_close(got, ref, f"mul_mat a={dt} n={n} k={k} b {layout}")


@gpu
@pytest.mark.parametrize("tb", ["f16", "bf16"])
@pytest.mark.parametrize("dt", ["f32", "f16", "bf16", "q4_0"])
@pytest.mark.parametrize("n", [1, 4, 16])
def test_mul_mat_half_b(dt: str, tb: str, n: int, rng) -> None:  # noqa: ANN001
    for k in (64, 80) if dt in FLOATS else (64, 256):  # q4_0 K 256: mmvq_stream
        y = ops.mul_mat(od.input("a", (16, k), dt), od.input("b", (n, k), tb))
        _, got, ref = run_both(y, feeds_for(y, rng))
        assert_close(got, ref, f"mul_mat a={dt} b={tb} n={n}")


@gpu
@pytest.mark.parametrize(("m", "k", "n"), [(4096, 4096, 1), (1000, 4096, 3), (3, 14336, 2), (300, 4128, 64)])
@pytest.mark.parametrize("dt", ["f16", "bf16", "q4_0", "q5_0", "q8_0"])
def test_mul_mat_large(dt: str, m: int, k: int, n: int, rng) -> None:  # noqa: ANN001
    y = ops.mul_mat(od.input("a", (m, k), dt), od.input("b", (n, k)))
    _, got, ref = run_both(y, feeds_for(y, rng))
    assert_close(got, ref, f"mul_mat a={dt} m={m} k={k} n={n}")


def run_poisoned(y: Tensor, rng: np.random.Generator, path: str) -> tuple[od.Plan, np.ndarray, np.ndarray]:
    """(plan on cuda0, its output, the reference's) with every arena poisoned (NaN bytes) before the
    run, `path` checked on every matrix-product kernel step."""
    plan = od.compile(y, "cuda0")
    for s in plan.steps:
        if s.kind == "kernel" and s.nodes[0].op == "mul_mat":
            assert (s.plugin, s.kernel) == ("cuda_matmul", path), plan.explain()
    feeds = feeds_for(y, rng)
    poison_arenas(plan)
    (got,) = plan.run(feeds)
    (ref,) = od.compile(y, "cpu").run(feeds)
    return plan, got, ref


#: (M, K) of the mmf tests: odd M, a partial unit of 32 k, one split and several (split_k on the H200)
MMF_SHAPES = ((77, 40), (1001, 2056), (2048, 2048), (300, 8192))


@gpu
@pytest.mark.parametrize("n", range(1, 17))
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_mmf_sweep(dt: str, n: int, monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    """mmf for 1..16 columns (MMF_MIN_N lowered to 1 so that it takes the mat-vec's too), every output
    written (arenas poisoned)."""
    monkeypatch.setattr(support, "MMF_MIN_N", 1)
    for m, k in MMF_SHAPES:
        y = ops.mul_mat(od.input("a", (m, k), dt), od.input("b", (n, k)))
        _, got, ref = run_poisoned(y, rng, "mmf")
        assert_close(got, ref, f"mmf a={dt} n={n} m={m} k={k}")


@gpu
@pytest.mark.usefixtures("mmf_selected")
@pytest.mark.parametrize(("bs", "nr"), [((1, 1), (1, 2)), ((3, 1), (1, 1)), ((3, 2), (2, 2))])
@pytest.mark.parametrize("k", [64, 1024])
def test_mmf_broadcast_batches(bs: tuple, nr: tuple, k: int, rng) -> None:  # noqa: ANN001
    for n in (9, 16):
        y = ops.mul_mat(od.input("a", (*bs, 45, k), "bf16"), od.input("b", (bs[0] * nr[0], bs[1] * nr[1], n, k)))
        _, got, ref = run_poisoned(y, rng, "mmf")
        assert_close(got, ref, f"mmf bs={bs} nr={nr} n={n} k={k}")


@gpu
@pytest.mark.usefixtures("mmf_selected")
@pytest.mark.parametrize("n", [9, 16])
@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("build", ["mul_mat_add", "mul_mat_glu swiglu", "mul_mat_add_glu swiglu_oai"])
def test_mmf_fused(build: str, dt: str, n: int, rng) -> None:  # noqa: ANN001
    """The bias and gate/up GLU fusions on mmf, against the reference and the unfused nodes (mmf each)."""
    y = FUSED_BUILDS[build](dt, n)
    feeds = feeds_for(y, rng)
    plan, fused, ref = run_both(y, feeds)
    assert [s.kernel for s in plan.fusions] == [build.split()[0]], plan.explain()
    assert_close(fused, ref, f"{build} a={dt} n={n} fused")
    unfused_plan, unfused, _ = run_both(y, feeds, path="mmf", fusion=False)
    assert_close(fused, unfused, f"{build} a={dt} n={n} fused vs unfused")


@gpu
@pytest.mark.usefixtures("mmf_selected")
def test_mmf_split_k_in_cuda_graph_replays(rng) -> None:  # noqa: ANN001
    """Split K (the last block of a row block sums the partials and sets its counter back to 0) over a
    captured CUDA graph's replays, fused gate/up included: every run right, every output written."""
    x = od.input("x", (16, 2048))
    wg, wu = od.input("wg", (2048, 2048), "bf16"), od.input("wu", (2048, 2048), "bf16")
    y = ops.glu_split(ops.mul_mat(wg, x), ops.mul_mat(wu, x), "swiglu")
    z = ops.mul_mat(od.input("wd", (512, 2048), "bf16"), y)
    plan = od.compile(z, "cuda0")
    assert sorted(s.kernel for s in plan.steps if s.plugin == "cuda_matmul") == ["mmf", "mul_mat_glu"], plan.explain()
    for run in range(4):  # warm-up, capture, replays
        feeds = named_feeds([z], rng, 0)
        poison_arenas(plan)
        (got,) = plan.run(feeds)
        (ref,) = od.compile(z, "cpu").run(feeds)
        assert_close(got, ref, f"mmf chain, run {run}")


@gpu
@pytest.mark.parametrize("n", [2, 9, 16])
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_mmf_persistent_in_cuda_graph_replays(dt: str, n: int, monkeypatch, rng) -> None:  # noqa: ANN001
    """Constant weights (the loads before the PDL wait) of more warp tiles than the H200's grid holds warps
    (40001 rows, an M tail: persistent blocks, several tiles a warp) and K = KS_MAX + 8 (two splits, b
    beyond KS_MAX; the last split ends in a partial unit), over a captured CUDA graph's replays on poisoned
    arenas: every run right, every output written."""
    monkeypatch.setattr(support, "MMF_MIN_N", 1)
    m, k = 40001, mmf.KS_MAX + 8
    sp = mmf.split_k(m, k, 1, H200.props["sm_count"])
    assert sp.splits == 2 and -(-m // 16) > sp.groups * mmf.WARPS, sp
    y = ops.mul_mat(weight("a", (m, k), dt), od.input("b", (n, k)))
    plan = od.compile(y, "cuda0")
    assert [s.kernel for s in plan.steps if s.plugin == "cuda_matmul"] == ["mmf"], plan.explain()
    for run in range(4):  # warm-up, capture, replays
        feeds = named_feeds([y], rng, 0)
        poison_arenas(plan)
        (got,) = plan.run(feeds)
        (ref,) = od.compile(y, "cpu").run(feeds)
        assert_close(got, ref, f"mmf {dt} n={n}, run {run}")


#: (K, M) of the mmvq_stream sweep: M not a multiple of the rows a warp stage holds (R = 2 at
#: K 4096 for q4_0/q5_0/q8_0, R = 1 with 2 segments at 14336), K 14336 = 56 chunks for 8-block
#: chunks, 112 for q4_1, 224 for q5_1
STREAM_SHAPES = ((4096, 77), (14336, 45), (4096, 1001))


@gpu
@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("dt", QUANTS)
def test_mmvq_stream_sweep(dt: str, n: int, rng) -> None:  # noqa: ANN001
    for k, m in STREAM_SHAPES:
        y = ops.mul_mat(od.input("a", (m, k), dt), od.input("b", (n, k)))
        _, got, ref = run_poisoned(y, rng, "mmvq_stream")
        assert_close(got, ref, f"mmvq_stream a={dt} m={m} k={k} n={n}")


#: K whose rows of the legacy formats are not whole 16-byte chunks: mmvq runs them at every column count (no
#: RAGGED instances of the legacy formats: specs.RAGGED_TYPES)
FALLBACK_K = {"q4_0": 4128, "q5_0": 288, "q8_0": 4000, "q4_1": 4160, "q5_1": 4128}


@gpu
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("dt", QUANTS)
def test_mmvq_fallback_k(dt: str, n: int, rng) -> None:  # noqa: ANN001
    k = FALLBACK_K[dt]
    y = ops.mul_mat(od.input("a", (77, k), dt), od.input("b", (n, k)))
    _, got, ref = run_poisoned(y, rng, "mmvq")
    assert_close(got, ref, f"mmvq a={dt} k={k} n={n}")


@pytest.mark.parametrize("dt", QUANTS)
def test_legacy_ragged_rows_take_mmvq(dt: str) -> None:
    """A legacy format at a K that is not whole chunks, one f32 column (what the RAGGED instances take for the
    other formats): support.stream_ok declines it, saying why, and mul_mat runs mmvq (quantize_q8_1, then the
    mat-vec), mul_mat_id at one token mmvq_id; no RAGGED instance of the format is compiled."""
    k = FALLBACK_K[dt]
    g = stream.stream_geo(dt)
    assert stream.ragged(dt, k) and dt in specs.LEGACY_NAMES and dt not in specs.RAGGED_TYPES
    why = (f"K={k} is not a multiple of {g.row_values} (rows of whole {g.chunk}-byte chunks), and mmvq_stream's "
           f"RAGGED instances take no legacy format ({dt}): mmvq runs those rows")
    y = ops.mul_mat(weight("w", (77, k), dt), od.input("x", (1, k)))
    assert support.stream_ok(y, H200) == why
    assert support.choose(y, H200).path == "mmvq"
    (step,) = steps_of(od.compile(y, H200), "mul_mat")
    assert (step.plugin, step.kernel) == ("cuda_matmul", "mmvq")
    assert [s.kernel for s in mmv.mmv_specs(y, y, fake_ptr, fake_scratch, device=H200)] == [
        "quantize_q8_1<B_F32>", specs.mmvq_name(dt, 1, specs.EPI_NONE)]
    e = ops.mul_mat_id(weight("e", (4, 32, k), dt), od.input("x", (1, 1, k)), od.input("ids", (1, 2), "i32"))
    assert support.stream_ok(e, H200) == why
    assert [s.kernel.split("<")[0] for s in mmv.mmv_id_specs(e, e, fake_ptr, fake_scratch, FakeGuard())] == [
        "quantize_q8_1", "mmvq_id"]
    assert not any(specs.stream_name(dt, "f32", specs.RAGGED_NT, epi, ragged=True) in specs.STREAM_NAMES
                   for epi in specs.EPIS)


def test_ragged_types() -> None:
    """specs.RAGGED_TYPES: every streamed format whose rows can be other than whole chunks (chunks of more than one
    block), but the legacy formats; STREAM_NAMES holds their RAGGED instances (one column, every epilogue) and no
    other, and the kernel refuses a RAGGED instance of a legacy format."""
    can = {dt for dt in stream.STREAMED if stream.stream_geo(dt).row_values > DTYPES[dt].block_size}
    assert set(specs.RAGGED_TYPES) == can - set(specs.LEGACY_NAMES)
    assert {"q4_K", "q5_K"}.isdisjoint(can) and set(specs.LEGACY_NAMES) <= can
    ragged = {n for n in specs.STREAM_NAMES if n.count(",") == 6 and n.endswith(", true>")}  # the 7th argument
    assert ragged == {specs.stream_name(dt, "f32", specs.RAGGED_NT, epi, ragged=True)
                      for dt in specs.RAGGED_TYPES for epi in specs.EPIS}
    assert "static_assert(!(RAGGED && mm::Fmt<WT>::LEGACY)" in specs.MMVQ_STREAM_CU.read_text()


def ragged_k(dt: str) -> int | None:
    """A K whose rows of dt are not whole chunks (gpt-oss's 2880 where the blocks allow), None where every row is
    (chunks of one block)."""
    rv, qk = stream.stream_geo(dt).row_values, DTYPES[dt].block_size
    if rv == qk:
        return None
    return 2880 if 2880 % qk == 0 and 2880 % rv else 14 * qk if (14 * qk) % rv else 9 * qk


@gpu
@pytest.mark.parametrize("dt", specs.RAGGED_TYPES)
def test_mmvq_stream_ragged(dt: str, rng) -> None:  # noqa: ANN001
    """Rows that are not whole chunks (and off 16-byte boundaries) at one column on mmvq_stream's RAGGED instances
    (specs.RAGGED_TYPES): a product, a fused gate/up GLU with biases, a residual, and mul_mat_id at one token, each
    against the reference (random valid blocks), the arenas poisoned, over a CUDA graph's capture and replay."""
    k = ragged_k(dt)
    assert k is not None
    builds = (lambda: ops.mul_mat(od.input("a", (77, k), dt), od.input("b", (1, k))),
              lambda: gate_up_glu(dt, 45, k, 1, True, "swiglu"),
              lambda: ops.add(od.input("r", (1, 61)), ops.mul_mat(od.input("a", (61, k), dt), od.input("b", (1, k)))),
              lambda: moe(dt, 6, 37, k, 1, 3, False, False))
    for build in builds:
        y = build()
        plan = od.compile(y, "cuda0")
        kernels = [s.kernel for s in plan.steps if s.kind in ("kernel", "fused") and s.plugin == "cuda_matmul"]
        assert kernels and all(kn in ("mmvq_stream", "mmv_id") or kn.startswith("mul_mat") for kn in kernels), \
            plan.explain()
        prods = [n for n in Graph.build(y).nodes if n.op in ("mul_mat", "mul_mat_id")]
        assert all(support.stream_ok(n, H200) is True and stream.ragged(dt, k) for n in prods)
        for run in range(3):  # warm-up, capture, replay
            feeds = subscaled_feeds(y, rng, 6) if dt in SUBSCALED else feeds_for(y, rng, 6)
            poison_arenas(plan)
            (got,) = plan.run(feeds)
            (ref,) = od.compile(y, "cpu").run(feeds)
            assert_close(got, ref, f"RAGGED {dt} k={k} {y.describe()} run {run}")


@gpu
@pytest.mark.parametrize("dt", ["q4_0", "q8_0"])
def test_mmvq_fallback_misaligned_rows(dt: str, rng) -> None:  # noqa: ANN001
    y = ops.mul_mat(_misaligned_rows(dt), od.input("b", (2, 512)))
    _, got, ref = run_poisoned(y, rng, "mmvq")
    assert_close(got, ref, f"mmvq a={dt} rows 16-byte misaligned")


@gpu
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("dt", QUANTS)
def test_mmvq_stream_fused_glu(dt: str, n: int, bias: bool, rng) -> None:  # noqa: ANN001
    """Gate and up rows in one warp stage (K 4096: R = 2) and one after the other (K 14336: R = 1).
    Kinds and row counts keep b's q8_1 rounding alone well under the bound (numpy model, 150 seeds:
    at most 2.8e-4 for swiglu_oai at K 4096 with 77 rows; swiglu_oai at K 14336 clips often and
    exceeds 5e-4 in about 1% of 45-row runs)."""
    for k, m, kind in ((4096, 77, "swiglu_oai"), (14336, 96, "swiglu"), (4096, 1001, "geglu")):
        y = gate_up_glu(dt, m, k, n, bias, kind)
        nodes = Graph.build(y).nodes
        prods, biases, glu = fusion.parts(nodes)
        (spec,) = mmv.fused_specs(nodes, fake_ptr, fake_scratch, FakeGuard())
        assert spec.kernel.startswith("mmvq_stream<") and "EPI_GLU" in spec.kernel, spec.kernel
        feeds = feeds_for(y, rng)
        plan = od.compile(y, "cuda0")
        assert [s.kernel for s in plan.fusions] == ["mul_mat_add_glu" if bias else "mul_mat_glu"], plan.explain()
        poison_arenas(plan)
        (fused,) = plan.run(feeds)
        (ref,) = od.compile(y, "cpu").run(feeds)
        assert_close(fused, ref, f"fused {kind} a={dt} m={m} k={k} n={n} bias={bias}")
        unfused_plan, unfused, _ = run_both(y, feeds, fusion=False)
        assert {s.kernel for s in steps_of(unfused_plan, "mul_mat")} == {"mmvq_stream"}
        assert_close(fused, unfused, f"fused {kind} a={dt} m={m} k={k} n={n} bias={bias} vs unfused")


@gpu
@pytest.mark.parametrize(("n_exp", "used", "n_tok"), list(itertools.product((4, 8), (1, 2, 4), (1, 4, 32))))
@pytest.mark.parametrize("dt", FLOATS + QUANTS)
def test_mul_mat_id(dt: str, n_exp: int, used: int, n_tok: int, rng) -> None:  # noqa: ANN001
    # block formats: K 96 takes the two-launch mmvq_id, K 256 (whole chunks) mmvq_stream at one token
    for k, b_rows in itertools.product((96, 256) if dt in QUANTS else (80,), sorted({1, used})):
        experts = od.input("experts", (n_exp, 16, k), dt)
        y = ops.mul_mat_id(experts, od.input("b", (n_tok, b_rows, k)), od.input("ids", (n_tok, used), "i32"))
        gemm = dt in QUANTS and k == 256 and n_tok * used > support.MMQ_ID_PAIRS_PER_EXPERT * n_exp
        path = "mmv_id" if n_tok == 1 else "mmq_id" if gemm else "mmv_id_grouped"
        plan, got, ref = run_both(y, feeds_for(y, rng, n_exp), path)
        assert_close(got, ref, f"mul_mat_id as={dt} e={n_exp} used={used} t={n_tok} b_rows={b_rows} ({path})")


#: K of test_mmq_id's experts: rows of whole chunks (q6_K's chunk is 2048 values, mxfp4's 512, iq4_xs's 512)
MMQ_ID_K = {"q4_0": 512, "q8_0": 256, "q4_K": 768, "q5_K": 768, "q6_K": 2048, "mxfp4": 1024, "iq4_xs": 1024}
#: mul_mat_id's quantized GEMMs
ID_GEMMS = ("mmq_id", "mmq_wgmma_id")


def moe_ids(rng: np.random.Generator, n_tok: int, used: int, n_exp: int) -> np.ndarray:
    """(n_tok, used) expert ids, distinct within a token, one expert (drawn at random) never chosen."""
    pool = np.delete(np.arange(n_exp), rng.integers(n_exp))
    return pool[np.argsort(rng.random((n_tok, n_exp - 1)), axis=-1)[:, :used]].astype(np.int32)


def take_id_gemm(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Several tokens' mul_mat_id of mmq's formats on `path` (mmq_id or mmq_wgmma_id) whatever the pairs an expert
    (by default mmq_id needs more than support.MMQ_ID_PAIRS_PER_EXPERT, mmq_wgmma_id more than
    support.MMQ_WGMMA_ID_MIN_MEAN) and the formats selected for mmq_wgmma_id (support.MMQ_WGMMA_ID_TYPES)."""
    monkeypatch.setattr(support, "MMQ_ID_PAIRS_PER_EXPERT", 0)
    if path == "mmq_id":
        monkeypatch.setattr(support, "MMQ_WGMMA_ID_TYPES", ())
    else:
        monkeypatch.setattr(support, "MMQ_WGMMA_ID_MIN_MEAN", 0)
        monkeypatch.setattr(support, "MMQ_WGMMA_ID_TYPES", mmq.MMQ_FORMATS)


def id_gemm_reference(path: str, plan_cpu: od.Plan, feeds: dict) -> np.ndarray:
    """The reference of `path`'s product: on b rounded to q8_1 (mmq_id's only rounding), or on b as it is
    (mmq_wgmma_id rounds b and the weights to bf16: WGMMA_NMSE)."""
    (ref,) = plan_cpu.run(q8_1_rounded(feeds, "x") if path == "mmq_id" else feeds)
    return ref


@gpu
@pytest.mark.parametrize("path", ID_GEMMS)
@pytest.mark.parametrize("b_rows", ["1", "U"])
@pytest.mark.parametrize(("n_exp", "used"), [(8, 2), (64, 8)])
@pytest.mark.parametrize("n_tok", [9, 64, 512])
@pytest.mark.parametrize("dt", list(MMQ_ID_K))
def test_mmq_id(dt: str, n_tok: int, n_exp: int, used: int, b_rows: str, path: str, monkeypatch: pytest.MonkeyPatch,
                rng) -> None:  # noqa: ANN001
    """mul_mat_id on mmq_id and mmq_wgmma_id (moe_route's tile table, b quantized to q8_1 or converted to bf16, the
    gathered GEMM) against the reference (mmq_id's on b rounded to q8_1, its only rounding), 77 expert rows (a
    partial row tile), b one row a token or one a slot; three runs of the plan (warm-up, CUDA-graph capture,
    replay), its arenas poisoned and new ids each time (the grid is fixed by the shapes, the routing is not), an
    expert unused each run, every output written."""
    take_id_gemm(monkeypatch, path)
    mmq_id_three_runs(dt, n_tok, n_exp, used, 1 if b_rows == "1" else used, rng, path)


def mmq_id_three_runs(dt: str, n_tok: int, n_exp: int, used: int, ub: int, rng: np.random.Generator,
                      path: str = "mmq_id") -> None:
    """mul_mat_id of (n_exp, 77, K) `dt` experts planned on `path` (mmq_id or mmq_wgmma_id), run three times
    (warm-up, CUDA-graph capture, replay), its arenas poisoned and new ids each time, against id_gemm_reference."""
    k = MMQ_ID_K[dt]
    ids = od.input("ids", (n_tok, used), "i32")
    y = ops.mul_mat_id(od.input("experts", (n_exp, 77, k), dt), od.input("x", (n_tok, ub, k)), ids)
    plan = od.compile(y, "cuda0")
    (step,) = steps_of(plan, "mul_mat_id")
    assert step.kernel == path, plan.explain()
    for run in range(3):
        feeds = {**(subscaled_feeds if dt in SUBSCALED else feeds_for)(y, rng, n_exp),
                 ids: moe_ids(rng, n_tok, used, n_exp)}
        poison_arenas(plan)
        (got,) = plan.run(feeds)
        ref = id_gemm_reference(path, od.compile(y, "cpu"), feeds)
        assert_close(got, ref, f"{path} as={dt} e={n_exp} used={used} t={n_tok} b_rows={ub}, run {run}",
                     Q8_1_NMSE if path == "mmq_id" else WGMMA_NMSE)


@gpu
@pytest.mark.parametrize("tile", mmq_wgmma.ID_TILES, ids=lambda t: f"n{t.bn}")
@pytest.mark.parametrize("dt", ["q4_0", "q6_K", "mxfp4"])
def test_mmq_wgmma_id_tiles(dt: str, tile, monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    """mmq_wgmma_id in each tile the sweep times (specs/mmq_wgmma.ID_TILES), 512 tokens over 64 experts, 8 used, and
    over 8, 2 used: as test_mmq_id."""
    take_id_gemm(monkeypatch, "mmq_wgmma_id")
    monkeypatch.setattr(mmq_wgmma, "ID_TILE", tile)
    for n_exp, used in ((64, 8), (8, 2)):
        mmq_id_three_runs(dt, 512, n_exp, used, 1, rng, "mmq_wgmma_id")


@gpu
@pytest.mark.parametrize("path", ID_GEMMS)
@pytest.mark.parametrize("dt", ["q4_0", "q4_K"])
def test_mmq_id_fused_add_id(dt: str, path: str, monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    """mul_mat_id -> add_id fused on mmq_id and mmq_wgmma_id (the experts' bias rows added as the sums are written)
    against id_gemm_reference and against the unfused nodes."""
    take_id_gemm(monkeypatch, path)
    y = moe(dt, 8, 77, 512, 64, 2, False, True)
    node = Graph.build(y).nodes[0]
    assert support.choose(node).path == path
    plan = od.compile(y, "cuda0")
    assert [(s.plugin, s.kernel) for s in plan.fusions] == [("cuda_matmul", "mul_mat_id_add_id")], plan.explain()
    feeds = (subscaled_feeds if dt in SUBSCALED else feeds_for)(y, rng, 8)
    poison_arenas(plan)
    (fused,) = plan.run(feeds)
    nmse_max = Q8_1_NMSE if path == "mmq_id" else WGMMA_NMSE
    assert_close(fused, id_gemm_reference(path, od.compile(y, "cpu"), feeds), f"{path} + add_id as={dt}", nmse_max)
    unfused_plan, unfused, _ = run_both(y, feeds, fusion=False)
    assert {s.kernel for s in steps_of(unfused_plan, "mul_mat_id")} == {path}
    assert_close(fused, unfused, f"{path} + add_id as={dt}: fused vs unfused", nmse_max)


@gpu
@pytest.mark.parametrize("k", [96, 256])
@pytest.mark.parametrize("dt", ["f16", "q4_0", "q8_0"])
def test_mul_mat_id_expert_out_of_range_writes_nan(dt: str, k: int, rng) -> None:  # noqa: ANN001
    """One token: an id outside [0, E) gives its slot NaN rows and raises DeviceIndexError at the run (the
    reference raises IndexError), the other slots are right."""
    y = ops.mul_mat_id(od.input("experts", (8, 40, k), dt), od.input("b", (1, 1, k)), od.input("ids", (1, 3), "i32"))
    feeds = feeds_for(y, rng, 8)
    ids = next(t for t in feeds if t.dtype.name == "i32")
    _, got, ref = run_both(y, {**feeds, ids: np.array([[5, 0, 2]], np.int32)}, "mmv_id")
    plan = od.compile(y, "cuda0")
    with pytest.raises(DeviceIndexError, match=r"index -1 at 'ids'\[0, 1\] .* outside \[0, 8\)"):
        plan.run({**feeds, ids: np.array([[5, -1, 2]], np.int32)})
    bad = plan.read(y)
    assert np.isnan(bad[0, 1]).all(), f"mul_mat_id as={dt} k={k}: slot 1 (expert -1) not NaN"
    assert_close(bad[0, [0, 2]], ref[0, [0, 2]], f"mul_mat_id as={dt} k={k}: the valid slots")


@gpu
@pytest.mark.parametrize("k", [96, 256])
@pytest.mark.parametrize("dt", ["q4_0", "q8_0"])
def test_nan_in_b_reaches_the_quantized_mat_vec_outputs(dt: str, k: int, rng) -> None:  # noqa: ANN001
    """b's q8_1 quantization (quantize_q8_1 at K 96, mmvq_stream's own at K 256) carries a NaN of b
    into its scale, so the outputs that use it are NaN (as the reference's), the rest right."""
    y = ops.mul_mat(od.input("a", (40, k), dt), od.input("b", (2, k)))
    feeds = feeds_for(y, rng)
    b = next(t for t in feeds if t.name == "b")
    feeds[b][1, k // 3] = np.nan
    _, got, ref = run_both(y, feeds, "mmvq" if k == 96 else "mmvq_stream")
    assert np.isnan(got[1]).all(), f"mul_mat a={dt} k={k}: {np.isfinite(got[1]).sum()} finite outputs of b's NaN row"
    assert_close(got[0], ref[0], f"mul_mat a={dt} k={k}: the other row")
    y = ops.mul_mat_id(od.input("experts", (4, 40, k), dt), od.input("b", (1, 2, k)), od.input("ids", (1, 2), "i32"))
    feeds = feeds_for(y, rng, 4)
    b = next(t for t in feeds if t.name == "b")
    feeds[b][0, 1, k // 3] = np.nan
    _, got, ref = run_both(y, feeds, "mmv_id")
    assert np.isnan(got[0, 1]).all(), f"mul_mat_id as={dt} k={k}: slot 1 (b NaN) has finite outputs"
    assert_close(got[0, 0], ref[0, 0], f"mul_mat_id as={dt} k={k}: slot 0")


@gpu
@pytest.mark.parametrize(("n_exp", "used", "n_tok"), [(128, 8, 1), (128, 8, 129), (32, 4, 512)])
@pytest.mark.parametrize("dt", ["f16", "q4_0"])
def test_mul_mat_id_many_experts(dt: str, n_exp: int, used: int, n_tok: int, rng) -> None:  # noqa: ANN001
    y = ops.mul_mat_id(od.input("experts", (n_exp, 64, 256), dt), od.input("b", (n_tok, 1, 256)),
                       od.input("ids", (n_tok, used), "i32"))
    _, got, ref = run_both(y, feeds_for(y, rng, n_exp))
    assert_close(got, ref, f"mul_mat_id as={dt} e={n_exp} used={used} t={n_tok}")


@gpu
@pytest.mark.parametrize("dt", FLOATS + QUANTS)
def test_out_prod(dt: str, rng) -> None:  # noqa: ANN001
    m = 64 if dt in QUANTS else 13
    for k, n, bs, nr in [(7, 5, (1, 1), (1, 1)), (65, 16, (1, 1), (1, 1)), (1, 1, (1, 1), (1, 1)),
                         (9, 4, (2, 3), (2, 2))]:
        y = ops.out_prod(od.input("a", (*bs, k, m), dt), od.input("b", (bs[0] * nr[0], bs[1] * nr[1], k, n)))
        _, got, ref = run_both(y, feeds_for(y, rng), "cublas_out_prod")
        assert_close(got, ref, f"out_prod a={dt} k={k} n={n} bs={bs} nr={nr}")
    x = od.input("x", (5, 7))
    y = ops.out_prod(od.input("a", (7, m), dt), x.transpose())
    _, got, ref = run_both(y, feeds_for(y, rng))
    assert_close(got, ref, f"out_prod a={dt} b transposed")


FUSED_BUILDS: dict[str, Callable[[str, int], Tensor]] = {
    "mul_mat_add": lambda dt, n: ops.add(ops.mul_mat(od.input("w", (40, 128), dt), od.input("x", (n, 128))),
                                         od.input("bias", (40,))),
    "mul_mat_glu swiglu": lambda dt, n: _glu_inputs(dt, n, "swiglu", False),
    "mul_mat_glu geglu": lambda dt, n: _glu_inputs(dt, n, "geglu", False),
    "mul_mat_add_glu swiglu_oai": lambda dt, n: _glu_inputs(dt, n, "swiglu_oai", True),
    "mul_mat_id_add_id": lambda dt, n: _moe_inputs(dt, n, False, True),
    "mul_mat_id_glu": lambda dt, n: _moe_inputs(dt, 1, True, False),
    "mul_mat_id_add_id_glu": lambda dt, n: _moe_inputs(dt, 1, True, True),
    "mul_mat_id_add_id_glu K256": lambda dt, n: moe(dt, 8, 40, 256, 1, 4, True, True),  # mmvq_stream
}


def _glu_inputs(dt: str, n: int, kind: str, bias: bool) -> Tensor:
    x = od.input("x", (n, 128))
    g, u = ops.mul_mat(od.input("wg", (40, 128), dt), x), ops.mul_mat(od.input("wu", (40, 128), dt), x)
    if bias:
        g, u = ops.add(g, od.input("bg", (40,))), ops.add(u, od.input("bu", (40,)))
    return ops.glu_split(g, u, kind)


def _moe_inputs(dt: str, n_tok: int, glu: bool, bias: bool) -> Tensor:
    return moe(dt, 8, 40, 128, n_tok, 4, glu, bias)


@gpu
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("dt", ["f32", "f16", "bf16", "q4_0", "q5_1", "q8_0"])
@pytest.mark.parametrize("build", list(FUSED_BUILDS))
def test_fused_matches_reference_and_unfused(build: str, dt: str, n: int, rng) -> None:  # noqa: ANN001
    y = FUSED_BUILDS[build](dt, n)
    feeds = feeds_for(y, rng, 8)
    plan, fused, ref = run_both(y, feeds)
    assert [s.kernel for s in plan.fusions] == [build.split()[0]], plan.explain()
    assert_close(fused, ref, f"{build} a={dt} n={n} fused")
    unfused_plan, unfused, _ = run_both(y, feeds, fusion=False)
    assert not unfused_plan.fusions
    assert_close(fused, unfused, f"{build} a={dt} n={n} fused vs unfused")


#: fused against unfused residual adds: the same kernel's sums, then the addend added once (in the epilogue, or by
#: cuda_misc's add): the same floats, whatever the rounding of the product
FUSED_VS_UNFUSED_NMSE = 1e-12


@gpu
@pytest.mark.parametrize(("dt", "n", "path"), RESIDUAL_PATHS)
def test_residual_fused(dt: str, n: int, path: str, monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    """add(product, r) with r of the product's shape fused into the product's kernel (the product either source,
    r contiguous or of padded rows over a batch axis, split K and not): the product part (out - r) against the
    reference by the path's bound (the block formats' sub-scaled ones against the reference on b rounded to q8_1)
    and the whole against the unfused nodes; three runs (warm-up, CUDA-graph capture, replay), arenas poisoned
    before each, so an output not written shows."""
    select_path(monkeypatch, path)
    sub = dt in SUBSCALED
    for y, _ in residual_cases(dt, n, path):
        plan = od.compile(y, "cuda0")
        assert [(s.plugin, s.kernel) for s in plan.fusions] == [("cuda_matmul", "mul_mat_add")], plan.explain()
        unfused = od.compile(y, "cuda0", fusion=False)
        assert {s.kernel for s in steps_of(unfused, "mul_mat")} == {path}, unfused.explain()
        r_in = next(t for t in Graph.build(y).inputs if t.name == "r")
        for run in range(3):
            feeds = (subscaled_feeds if sub else feeds_for)(y, rng)
            poison_arenas(plan)
            (got,) = plan.run(feeds)
            (ref,) = od.compile(y, "cpu").run(q8_1_rounded(feeds, "x") if sub else feeds)
            r = feeds[r_in][..., :y.shape[-1]]
            what = f"{path} a={dt} n={n} out {y.shape} run {run}"
            assert_close(got - r, ref - r, f"{what}: the product", Q8_1_NMSE if sub else NMSE_MAX)
            (alone,) = unfused.run(feeds)
            assert_close(got, alone, f"{what}: fused vs unfused", FUSED_VS_UNFUSED_NMSE)


def poison_arenas(plan: od.Plan) -> None:
    """Fill every arena of a bound plan with NaN bytes (0xFF), so unwritten outputs show."""
    from opdispatch.backends.cuda.backend import CudaBuffer

    bound = plan._bind()
    for name, buf in bound.arenas.items():
        backend = bound.backends[name]
        if isinstance(buf, CudaBuffer):
            buf.mem.memset_async(0xFF, buf.nbytes, backend.stream)
            backend.synchronize()


def _chain(dt: str, n: int) -> tuple[Tensor, Tensor]:
    """A graph with every path: mat-vec, cuBLAS, fused GLU, MoE (direct and grouped), out_prod; for
    block formats at one token the two-launch mmvq (K 128) and mmvq_stream (K 256: the GLU, the MoE).
    Its out_prod weight is a new param each call, so each call plans (and binds) anew."""
    x = od.input("x", (n, 128))
    h = ops.mul_mat(od.input("w1", (256, 128), dt), x)
    g = ops.glu_split(ops.mul_mat(od.input("wg", (256, 256), dt), h), ops.mul_mat(od.input("wu", (256, 256), dt), h),
                      "swiglu")
    y = ops.mul_mat_id(od.input("experts", (4, 32, 256), dt), g.reshape(n, 1, 256), od.input("ids", (n, 2), "i32"))
    a = od.param("a", np.linspace(-1, 1, n * 24, dtype=np.float32).reshape(n, 24), "f16")
    return y, ops.out_prod(a, y.reshape(n, 64))


def named_feeds(outputs: list, rng: np.random.Generator, n_experts: int) -> dict[str, np.ndarray]:
    """Values for every input of the graph, by name (plans take feeds by leaf name)."""
    return {t.name: v for t, v in feeds_for(outputs, rng, n_experts).items()}


@gpu
@pytest.mark.parametrize("n", [1, 16])
def test_every_output_element_is_written_on_each_run(n: int, rng) -> None:  # noqa: ANN001
    y, z = _chain("q4_0", n)
    plan = od.compile([y, z], "cuda0")
    assert {s.kernel for s in plan.steps if s.plugin == "cuda_matmul"} == (
        {"mmvq", "mul_mat_glu", "mmv_id", "cublas_out_prod"} if n == 1 else
        {"dequant_cublas", "mmq_small", "mmv_id_grouped", "cublas_out_prod"}), plan.explain()  # q4_0 at 16: mmq_small
    for run in range(3):  # warm-up, capture, replay
        feeds = named_feeds([y, z], rng, 4)
        poison_arenas(plan)
        got = plan.run(feeds)
        ref = od.compile([y, z], "cpu").run(feeds)
        for g, r, what in zip(got, ref, ("mul_mat_id", "out_prod")):
            assert_close(g, r, f"{what} n={n}, run {run}")


@gpu
def test_cuda_graph_replay_matches_direct_launches(monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    values = {}
    results = {}
    for disabled in ("1", "0"):
        monkeypatch.setenv("OPDISPATCH_DISABLE_CUDA_GRAPHS", disabled)
        outs = []
        for n in (1, 16):
            y, z = _chain("q8_0", n)
            if n not in values:
                values[n] = [named_feeds([y, z], rng, 4) for _ in range(3)]
            plan = od.compile([y, z], "cuda0")
            outs.append([plan.run(f) for f in values[n]])
            assert_graph_segments(plan, disabled)
        results[disabled] = outs
    for direct, replayed in zip(results["1"], results["0"]):
        for d_run, r_run in zip(direct, replayed):
            for d, r in zip(d_run, r_run):
                assert np.array_equal(d, r)


@gpu
@pytest.mark.parametrize("case", edge_cases("mul_mat"))
def test_edge_values_match_the_reference(case, seed: int) -> None:  # noqa: ANN001
    """The sweep's edge-value cases (docs/ops.md, "Edge values") on cuda_matmul, NaN positions included:
    float weights with infinities and b with NaN: infinities and NaN where the reference has them."""
    res = run_case(case, "cuda0", plugin="cuda_matmul", seed=seed)
    assert res.status is Status.PASS, res.describe()


# -- quant_k.cuh's formats: K-quants (iq4_nl, iq4_xs, mxfp4 once opdispatch.dtypes has them) -------------

#: the sub-scaled formats the plugin multiplies by; the weights are random valid blocks
#: (helpers.subscaled_blocks), every code and scale drawn
SUBSCALED = tuple(q for q in specs.SUBSCALED_NAMES if q in BLOCK_FORMATS)  # those the op builders take too
#: dequant_cublas's NMSE bound against the reference (a and b rounded to f16)
SUBSCALED_NMSE = NMSE_MAX
#: the mat-vecs' bound against the reference run on b rounded to q8_1, their only rounding (ggml's too). Against
#: the plain reference that rounding alone reaches NMSE 1.5e-3 (iq4_xs) to 3.9e-3 (q6_K) in the swiglu_oai MoE
#: case on random blocks (40 seeds, numpy): blocks whose scales span 2**15 make b's per-32 rounding count
Q8_1_NMSE = 1e-8


def q8_1_rounded(feeds: dict, name: str) -> dict:
    """`feeds` with input `name` (an f32 b) replaced by its values rounded to q8_1, as the mat-vecs see them."""
    (t,) = [t for t in feeds if t.name == name]
    codes, d = q8_1_reference(feeds[t])
    return {**feeds, t: (codes * d[..., None]).astype(np.float32).reshape(feeds[t].shape)}


def subscaled_feeds(y: Tensor | list, rng: np.random.Generator, n_experts: int = 0) -> dict:
    """feeds_for, with the block-format inputs as random valid blocks (scales about 0.01: values well
    inside f16, which dequant_cublas rounds the weights to)."""
    feeds = feeds_for(y, rng, n_experts)
    for t in list(feeds):
        if t.dtype.is_quant:
            qk = t.dtype.block_size
            nb = t.size // qk
            raw = subscaled_blocks(rng, t.dtype.name, nb, e_range=(110, 125), scale=0.01)
            feeds[t] = raw.reshape(*t.shape[:-1], t.shape[-1] // qk * t.dtype.block_bytes)
    return feeds


@pytest.mark.parametrize("wgmma", [False, True], ids=["default", "wgmma"])
@pytest.mark.parametrize("dt", SUBSCALED)
@pytest.mark.parametrize("n", [1, 8, 9, 64, 128, 129])
def test_subscaled_mul_mat_path(dt: str, n: int, wgmma: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch runs on the GPU: rows of whole chunks take the streamed mat-vec up to 8 columns and mmq
    up to support.MMQ_MAX_N (the grid I-quants: mmq_wgmma); the others mmvq (dot32 from global memory)
    and mmq_wgmma (where selected: `wgmma`; else dequant_cublas), whose step says why mmq declined."""
    if wgmma:
        select_wgmma(monkeypatch)
    rv, qk = stream.stream_geo(dt).row_values, DTYPES[dt].block_size
    # q4_K, q5_K: chunks of one block, every K streams; other partial rows stream at one column (RAGGED)
    partial = ((rv + qk, "mmvq_stream" if n == 1 else "mmvq"),) if rv > qk else ()
    for k, small in ((rv, "mmvq_stream"), (14336, "mmvq_stream"), *partial):
        y = ops.mul_mat(od.input("w", (3, 13, k), dt), od.input("x", (3, n, k)))
        (step,) = steps_of(od.compile(y, H200), "mul_mat")
        why = f"K={k} is not a multiple of {rv} (rows of whole {stream.stream_geo(dt).chunk}-byte chunks)"
        whole = k % rv == 0
        if n <= 8:  # stream_ok is asked of mat-vecs only
            assert (step.plugin, step.kernel) == ("cuda_matmul", small), (k, n)
            streamed = small == "mmvq_stream"
            assert support.stream_ok(y, H200) == (True if streamed else why + ", which mmvq_stream takes at 1 f32 "
                                                  "column only")
        else:
            gemm = dt in mmq.MMQ_FORMATS  # the grid I-quants have no quantized GEMM
            selected = wgmma or support.wgmma_takes(dt, 13, k) is True
            wide = "mmq_wgmma" if selected and whole and k % mmq_wgmma.BK == 0 else "dequant_cublas"
            wgmma_first = wide == "mmq_wgmma" and n >= support.MMQ_WGMMA_MIN_N  # mmq_wgmma is faster there
            big = "mmq" if gemm and whole and n <= support.MMQ_MAX_N and not wgmma_first else wide
            small_gemm = support.MMQ_SMALL_MIN_N <= n <= support.MMQ_SMALL_MAX_N
            big = "mmq_small" if big == "mmq" and small_gemm else big
            assert (step.plugin, step.kernel) == ("cuda_matmul", big), (k, n)
            over = f"N={n} > {support.MMQ_MAX_N}: mmq_wgmma or dequant_cublas is faster there"
            want = f"{dt} has no quantized GEMM" if not gemm else over if n > support.MMQ_MAX_N else \
                True if whole else why
            assert support.mmq_ok(y, H200) == want


def test_weights_no_kernel_reads_are_declined_by_name() -> None:
    """q8_K is a block format (ggml's activation format) that no kernel reads as weights: every matrix product
    of it goes to the reference, the reason given, instead of a plugin that accepts it and has no kernel."""
    why = "no kernel reads the weights' block format (q8_K is ggml's activation format, not a weight's)"
    for y in (ops.mul_mat(od.input("w", (16, 256), "q8_K"), od.input("x", (n, 256))) for n in (1, 16)):
        assert support.choose(y, H200).reason == why
        assert {s.device.kind for s in od.compile(y, H200).steps if s.kind == "kernel"} == {"cpu"}
    y = ops.mul_mat_id(od.input("w", (4, 16, 256), "q8_K"), od.input("x", (1, 1, 256)), od.input("i", (1, 2), "i32"))
    assert support.choose(y, H200).reason == why


@pytest.mark.parametrize("dt", ["q4_0", "q4_K", "iq4_xs"])
def test_mul_mat_id_with_fewer_b_rows_than_slots_is_not_streamed(dt: str) -> None:
    """Slot u reads b row u % Ub (ggml's broadcast of b's rows over the used experts): the streamed kernel reads
    row u, so with 1 < Ub < U the two-launch mmvq_id runs it (its quantize_q8_1 and mmvq_id pair)."""
    k = 2048
    for ub, streamed in ((1, True), (2, False), (4, True)):
        y = ops.mul_mat_id(od.input("w", (8, 32, k), dt), od.input("x", (1, ub, k)), od.input("i", (1, 4), "i32"))
        ok = support.stream_ok(y, H200)
        assert (ok is True) == streamed, ok
        kernels = [sp.kernel.split("<")[0] for sp in mmv.mmv_id_specs(y, y, fake_ptr, fake_scratch, FakeGuard(),
                                                                      device=H200)]
        assert kernels == (["mmvq_stream"] if streamed else ["quantize_q8_1", "mmvq_id"]), (ub, kernels)


@pytest.mark.parametrize("dt", SUBSCALED)
def test_subscaled_mul_mat_id_glu_and_out_prod_paths(dt: str) -> None:
    k = DTYPES[dt].block_size
    for n_tok, path in ((1, "mmv_id"), (5, "mmv_id_grouped")):
        (step,) = steps_of(od.compile(moe(dt, 4, 16, k, n_tok, 2, False, False), H200), "mul_mat_id")
        assert (step.plugin, step.kernel) == ("cuda_matmul", path)
    for build, rule in ((lambda: gate_up_glu(dt, 16, k, 3, True, "swiglu"), "mul_mat_add_glu"),
                        (lambda: moe(dt, 4, 16, k, 1, 2, True, True), "mul_mat_id_add_id_glu")):
        (step,) = od.compile(build(), H200).fusions
        assert (step.plugin, step.kernel) == ("cuda_matmul", rule)
    y = ops.out_prod(od.input("a", (7, k), dt), od.input("b", (7, 5)))
    (step,) = steps_of(od.compile(y, H200), "out_prod")
    assert (step.plugin, step.kernel) == ("cuda_matmul", "cublas_out_prod")


def test_subscaled_instances_are_compiled() -> None:
    """Every launchable sub-scaled instance is declared (tests/test_kernels_compile.py builds them)."""
    for dt in specs.SUBSCALED_NAMES:
        nts = specs.GRID_NTS if dt in specs.GRID_NAMES else specs.NTS
        assert specs.quant_nts(dt) == nts and 1 in nts and 8 in nts
        assert all(specs.mmvq_name(dt, nt, epi) in specs.MMV_NAMES for nt in nts for epi in specs.EPIS)
        assert all(specs.mmvq_id_name(dt, epi) in specs.MMV_ID_NAMES for epi in specs.EPIS)
        assert all(specs.qgrouped_name(dt, nt, epi) in specs.MMV_ID_NAMES
                   for nt in specs.grouped_nts(dt) for epi in specs.EPIS[:2])
        assert all(specs.dequant_name(dt, td) in specs.CONVERT_NAMES for td in ("f16", "f32"))
        assert all(specs.stream_name(dt, "f32", nt, epi) in specs.STREAM_NAMES for nt in nts for epi in specs.EPIS)
        b16 = [specs.stream_name(dt, tb, 8, specs.EPI_NONE) in specs.STREAM_NAMES for tb in ("f16", "bf16")]
        assert b16 == [dt in specs.STREAM_B16] * 2
        assert all(mmq.instance_name(dt, cfg) in mmq.NAMES for _, cfg in mmq.TABLE_K) == (dt in mmq.MMQ_FORMATS)


@pytest.mark.parametrize("dt", specs.GRID_NAMES)
@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_grid_formats_bind_their_compiled_instances(dt: str, n: int) -> None:
    """The grid I-quants are compiled for 1 and 8 columns: the mat-vecs' specs name those (2..8 columns run the
    8-column kernel) whether streamed (K 4096, and K 256 at one column: RAGGED) or not; an f16 b goes to mmvq (no
    streamed instance)."""
    ragged = "mmvq_stream" if n == 1 else "mmvq"  # K 256: RAGGED rows at one column
    for k, tb, path in ((4096, "f32", "mmvq_stream"), (256, "f32", ragged), (4096, "f16", "mmvq")):
        y = ops.mul_mat(od.input("w", (24, k), dt), od.input("x", (n, k), tb))
        assert support.choose(y, H200).path == path, (k, tb)
        if tb != "f32":
            assert support.stream_ok(y, H200) == f"{dt} streams an f32 b only (fewer instances to compile); " \
                "mmvq quantizes a f16 b"
        ptr = iter(range(4096, 1 << 30, 1 << 20))
        launches = mmv.mmv_specs(y, y, lambda t, p=ptr: next(p), lambda *a, **kw: 1 << 30, device=H200)
        nt = 1 if n == 1 else 8
        want = specs.stream_name(dt, "f32", nt, specs.EPI_NONE, ragged=k == 256) if path == "mmvq_stream" else \
            specs.mmvq_name(dt, nt, specs.EPI_NONE)
        assert launches[-1].kernel == want and want in specs.KERNEL_SOURCES[launches[-1].source], (k, tb)


@gpu
@pytest.mark.parametrize("n", (*range(1, 10), 16, 33))
@pytest.mark.parametrize("dt", SUBSCALED)
def test_subscaled_mul_mat_sweep(dt: str, n: int, rng) -> None:  # noqa: ANN001
    qk = DTYPES[dt].block_size
    for m, k, batch in ((13, qk, ()), (31, 3 * qk, (2,)), (64, 16 * qk, ())):  # odd M, several K, a batch axis
        a, b = od.input("a", (*batch, m, k), dt), od.input("b", (*batch, n, k))
        y = ops.mul_mat(a, b)
        feeds = subscaled_feeds(y, rng)
        path = support.choose(y).path
        plan, got, ref = run_both(y, feeds, path)
        q8_1 = path != "dequant_cublas"
        if q8_1:  # a mat-vec or mmq: b rounded to q8_1
            (ref,) = od.compile(y, "cpu").run(q8_1_rounded(feeds, "b"))
        assert_close(got, ref, f"mul_mat a={dt} m={m} k={k} n={n} ({path})", Q8_1_NMSE if q8_1 else SUBSCALED_NMSE)


@gpu
@pytest.mark.usefixtures("mmq_any_n")
@pytest.mark.parametrize("n", (9, 16, 32, 64, 128, 33, 70))
@pytest.mark.parametrize("dt", [q for q in SUBSCALED if q in mmq.MMQ_FORMATS])  # the grid I-quants: dequant_cublas
def test_subscaled_mmq(dt: str, n: int, rng) -> None:  # noqa: ANN001
    """mmq of every sub-scaled format against the reference run on b rounded to q8_1 (its only rounding):
    every specs/mmq.TABLE_K entry, odd M (partial row tiles), rows of one and of several chunks, a long K
    (split K); three runs of the plan (warm-up, CUDA-graph capture, replay), its arenas poisoned before
    each."""
    rv = stream.stream_geo(dt).row_values
    mmq_three_runs(dt, n, ((77, rv), (130, 3 * rv), (61, 14336)), lambda y: subscaled_feeds(y, rng),
                   lambda f: q8_1_rounded(f, "b"), Q8_1_NMSE)


#: mmq_wgmma's bound against the plain reference: it rounds the dequantized weights and b to bf16 (8-bit
#: significands), which on random data gives an NMSE of about 3e-6; ten times that
WGMMA_NMSE = 3e-5
#: (a shape, b shape) of the mmq_wgmma cases: partial row and column tiles; K cut in 8, 16 and 33 slices (one or
#: two raw K tiles each), and not cut (99 output tiles); b's batches broadcast over a's (r2 = 2)
WGMMA_SHAPES = (((77, 2048), (129, 2048)), ((200, 4096), (300, 4096)), ((61, 14336), (512, 14336)),
                ((4200, 2048), (300, 2048)), ((2, 70, 2048), (4, 150, 2048)))


@gpu
@pytest.mark.usefixtures("wgmma_selected")
@pytest.mark.parametrize("tile", mmq_wgmma.TILES, ids=lambda t: f"n{t.bn}")
@pytest.mark.parametrize("dt", specs.QUANT_NAMES)
def test_mmq_wgmma(dt: str, tile, rng, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """mmq_wgmma for every block format and tile at WGMMA_SHAPES, three runs of the plan (warm-up, CUDA-graph
    capture, replay), its arenas poisoned before each (so every output element must be written), against the
    reference."""
    monkeypatch.setattr(mmq_wgmma, "node_tile", lambda node, device=None: tile)
    for a_shape, b_shape in WGMMA_SHAPES:
        y = ops.mul_mat(od.input("a", a_shape, dt), od.input("b", b_shape))
        plan = od.compile(y, "cuda0")
        (step,) = steps_of(plan, "mul_mat")
        assert step.kernel == "mmq_wgmma", plan.explain()
        for run in range(3):
            feeds = subscaled_feeds(y, rng) if dt in SUBSCALED else feeds_for(y, rng)
            poison_arenas(plan)
            (got,) = plan.run(feeds)
            (ref,) = od.compile(y, "cpu").run(feeds)
            assert_close(got, ref, f"mmq_wgmma a={dt} {a_shape} b={b_shape}, run {run}", WGMMA_NMSE)


@pytest.mark.parametrize(("m", "n", "k", "bn"), [
    (14336, 9, 4096, 128), (14336, 128, 4096, 128),  # the wide tile half padding
    (14336, 129, 4096, 256), (8192, 300, 2048, 256), (4096, 512, 14336, 256), (2048, 512, 8192, 256),
    (4096, 512, 4096, 256),  # wide blocks of K 2048 and more (4096 x 4096: split in 2)
    (3072, 512, 2048, 128), (2048, 512, 2048, 128), (2048, 1024, 2048, 128),  # split to 1024 or 512 values
    (3072, 1024, 2048, 256), (2048, 2048, 2048, 256)])  # a wave of wide tiles, K not split
def test_mmq_wgmma_tile_for(m: int, n: int, k: int, bn: int) -> None:
    """The wide tile above 128 columns where each block runs 2048 values of K or more after split K, on the H200
    (132 SMs: wgmma_splits)."""
    assert mmq_wgmma.tile_for(m, n, k, 1, H200).bn == bn


def test_mmq_wgmma_node_tile_counts_batches() -> None:
    """The batches count as tiles: 2048 x 2048 weights at 512 columns take the wide tile in 4 batches (128 tiles,
    K not split), the narrow one in 1."""
    b1 = ops.mul_mat(od.input("a", (2048, 2048), "q4_0"), od.input("b", (512, 2048)))
    b4 = ops.mul_mat(od.input("a", (2048, 2048), "q4_0"), od.input("b", (4, 512, 2048)))
    assert mmq_wgmma.node_tile(b1, H200) == mmq_wgmma.NARROW
    assert mmq_wgmma.node_tile(b4, H200) == mmq_wgmma.WIDE


def test_mmq_wgmma_tiles_fit_the_h200() -> None:
    """Every format's instance of either tile fits the H200's shared memory (the RS formats hold no A stages)."""
    facts = stream.device_facts(H200)
    assert all(mmq_wgmma.wgmma_smem(dt, t) <= facts.smem_per_block_optin
               for dt in mmq_wgmma.WGMMA_FORMATS for t in mmq_wgmma.TILES)
    assert mmq_wgmma.wgmma_smem("q8_0", mmq_wgmma.WIDE) == 4 * 256 * 64 * 2 + 1024 + 2 * 128 * mmq.row_stride("q8_0", 8)


@pytest.mark.usefixtures("wgmma_selected")
def test_mmq_wgmma_specs() -> None:
    """b converted to bf16 rows, then one block per 128 x 128 output tile (300 columns: the narrow tile), batch and
    K slice (here 6 tiles and 4 batches, 24 blocks, leave the H200's 132 SMs room for 2 slices of the 2 raw K
    tiles), the weights' strides and the broadcast ratio passed as they are, the scratch of split K."""
    y = ops.mul_mat(od.input("a", (2, 200, 512), "q4_K"), od.input("b", (4, 300, 512)))
    assert support.choose(y).path == "mmq_wgmma"
    bufs = {}

    def scratch(role: str, nbytes: int, zeroed: bool = False) -> int:
        bufs[role] = (nbytes, zeroed)
        return (len(bufs) + 1) << 20

    conv, main = mmq_wgmma.wgmma_specs(y, lambda t: 1 << 20, scratch)
    assert conv.kernel == specs.convert_name("f32", "bf16") and conv.args.dst == main.args.b
    assert bufs["b"] == ((4 * 300 + 256) * 512 * 2, False)  # the widest column tile's rows past the last: read
    assert bufs["b"][0] == mmq_wgmma.b_bytes(4 * 300, 512)  # (not used), what a fused group's b16 rows hold too
    assert bufs["mmq_wgmma partial sums"] == (2 * 4 * 300 * 200 * 4, False)
    assert bufs["mmq_wgmma split counters"] == (4 * 2 * 3 * 4, True)
    # q4_K (an RS format): two computing warpgroups and one that copies
    assert main.kernel == "mmq_wgmma<W_Q4_K, 2, 128>" and main.grid == (2 * 2 * 3, 4, 1) and main.block == 384
    a = main.args
    assert (a.M, a.K, a.N, a.tiles_m, a.tiles_n, a.splits, a.r2, a.r3) == (200, 512, 300, 2, 3, 2, 2, 1)
    assert a.a_row == 512 // 256 * 144 and a.a_s2 == 200 * a.a_row
    # q4_K: no A stages, and the warp-specialized loop's 8 b stages beside 3 raw ones
    assert main.smem == 8 * 128 * 64 * 2 + 1024 + 3 * 128 * mmq.row_stride("q4_K", 8)


@pytest.mark.usefixtures("wgmma_selected")
def test_mmq_wgmma_specs_wide() -> None:
    """512 columns take the wide tile: 256 threads a block of 128 weight rows x 256 columns, b's stages twice as
    large; an A-stage format (q4_1) holds its 2 stages."""
    y = ops.mul_mat(od.input("a", (4096, 4096), "q4_1"), od.input("b", (512, 4096)))
    assert support.choose(y, H200).path == "mmq_wgmma"
    conv, main = mmq_wgmma.wgmma_specs(y, lambda t: 1 << 20, lambda role, nbytes, zeroed=False: 1 << 21, H200)
    assert main.kernel == "mmq_wgmma<W_Q4_1, 2, 256>" and main.block == 256
    assert (main.args.tiles_m, main.args.tiles_n) == (32, 2)
    assert main.smem == 2 * 128 * 64 * 2 + 4 * 256 * 64 * 2 + 1024 + 2 * 128 * mmq.row_stride("q4_1", 8)


@pytest.mark.parametrize(("tiles", "k", "splits"), [(128, 14336, 1), (64, 8192, 2), (16, 2048, 8), (16, 512, 2),
                                                     (300, 2048, 1)])
def test_mmq_wgmma_splits_fill_one_wave(tiles: int, k: int, splits: int) -> None:
    assert mmq_wgmma.wgmma_splits(tiles, k, H200) == splits


#: (K, M) of the streamed sub-scaled sweep: rows of one q4_K / q5_K / iq4_nl chunk, one chunk a stage of
#: every format at 4096 (R 2 .. 32), two segments a row at 14336 (56 one-block pieces; 28 of iq4_xs / mxfp4)
#: and 16896 (33 pieces of 512 values), odd M
SUBSCALED_STREAM_SHAPES = ((4096, 77), (14336, 45), (16896, 19), (4096, 1001))


@gpu
@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("dt", SUBSCALED)
def test_subscaled_mmvq_stream_sweep(dt: str, n: int, rng) -> None:  # noqa: ANN001
    """mmvq_stream for every sub-scaled format and column count, its output poisoned first; b f16 too."""
    for k, m in (*SUBSCALED_STREAM_SHAPES, (stream.stream_geo(dt).row_values, 33)):
        if k % stream.stream_geo(dt).row_values:
            continue
        for tb in ("f32", "f16") if n in (1, 8) and dt in specs.STREAM_B16 else ("f32",):
            y = ops.mul_mat(od.input("a", (m, k), dt), od.input("b", (n, k), tb))
            plan = od.compile(y, "cuda0")
            (step,) = steps_of(plan, "mul_mat")
            assert (step.plugin, step.kernel) == ("cuda_matmul", "mmvq_stream"), plan.explain()
            feeds = subscaled_feeds(y, rng)
            poison_arenas(plan)
            (got,) = plan.run(feeds)
            # f32 b: against the reference on b rounded to q8_1 (the kernel's only rounding); an f16 b would be
            # rounded again on the way into the reference, so it meets the plain bound
            ref_feeds, bound = (q8_1_rounded(feeds, "b"), Q8_1_NMSE) if tb == "f32" else (feeds, SUBSCALED_NMSE)
            (ref,) = od.compile(y, "cpu").run(ref_feeds)
            assert_close(got, ref, f"mmvq_stream a={dt} b={tb} m={m} k={k} n={n}", bound)


@gpu
@pytest.mark.parametrize(("n", "bias", "kind"), [(1, False, "swiglu"), (1, True, "swiglu_oai"), (5, True, "geglu"),
                                                 (8, False, "swiglu")])
@pytest.mark.parametrize("dt", SUBSCALED)
def test_subscaled_fused_glu(dt: str, n: int, bias: bool, kind: str, rng) -> None:  # noqa: ANN001
    y = gate_up_glu(dt, 37, 4 * DTYPES[dt].block_size, n, bias, kind)
    feeds = subscaled_feeds(y, rng)
    plan = od.compile(y, "cuda0")
    assert [s.plugin for s in plan.fusions] == ["cuda_matmul"], plan.explain()
    (fused,) = plan.run(feeds)
    (ref,) = od.compile(y, "cpu").run(q8_1_rounded(feeds, "x"))
    assert_close(fused, ref, f"fused {kind} a={dt} n={n} bias={bias}", Q8_1_NMSE)


@gpu
@pytest.mark.parametrize(("n_tok", "glu", "bias"), [(1, False, False), (1, True, True), (1, False, True),
                                                    (6, False, False), (6, False, True)])
@pytest.mark.parametrize("dt", SUBSCALED)
def test_subscaled_mul_mat_id(dt: str, n_tok: int, glu: bool, bias: bool, rng) -> None:  # noqa: ANN001
    y = moe(dt, 4, 24, 2 * DTYPES[dt].block_size, n_tok, 2, glu, bias)
    feeds = subscaled_feeds(y, rng, 4)
    plan, got, _ = run_both(y, feeds)
    (ref,) = od.compile(y, "cpu").run(q8_1_rounded(feeds, "x"))
    assert_close(got, ref, f"mul_mat_id as={dt} t={n_tok} glu={glu} bias={bias}", Q8_1_NMSE)


@gpu
@pytest.mark.parametrize("dt", SUBSCALED)
def test_subscaled_out_prod(dt: str, rng) -> None:  # noqa: ANN001
    y = ops.out_prod(od.input("a", (7, DTYPES[dt].block_size), dt), od.input("b", (7, 5)))
    _, got, ref = run_both(y, subscaled_feeds(y, rng), "cublas_out_prod")
    assert_close(got, ref, f"out_prod a={dt}", SUBSCALED_NMSE)
