"""What cuda_matmul compiles: its kernel sources, the template instances launched from each, and the
constants and tuned configuration that fix them; the helpers every family of specs shares.

The launch specs are per .cu family: `mmv` (kernels/mmv.cu: the mat-vecs and the q8_1 quantizer;
kernels/mmv_id.cu: the MoE mat-vecs and routing), `stream` (kernels/mmvq_stream.cu's geometry), `mmq`
(kernels/mmq.cu, the quantized GEMM), `mmq_id` (kernels/mmq_id.cu, the quantized GEMM of mul_mat_id),
`mmq_small` (kernels/mmq_small.cu, the weight-streaming quantized GEMM for few columns), `mmq_wgmma`
(kernels/mmq_wgmma.cu, the quantized GEMM for many columns on Hopper's wgmma), `mmf`
(kernels/mmf.cu, the tensor-core mat-mul for few columns) and `gemm` (kernels/convert.cu and the cuBLAS
calls). Column counts are compiled for the common case only: b f32 (and 16-byte loads for float
weights) takes NTS (the grouped MoE kernels GROUPED_NTS); the rarer variants (scalar loads, b f16/bf16,
which only unfused mul_mat takes) are compiled for 8 columns and run fewer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import attrs
import numpy as np

from opdispatch.backends.cuda.args import ArgGroup, f32, i32, i64, instance, ptr
from opdispatch.dtypes import DTYPES
from opdispatch.ops.base import pad4
from opdispatch.tensor import Tensor

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
MMV_CU = KERNELS_DIR / "mmv.cu"
MMV_ID_CU = KERNELS_DIR / "mmv_id.cu"
MMVQ_STREAM_CU = KERNELS_DIR / "mmvq_stream.cu"
MMQ_CU = KERNELS_DIR / "mmq.cu"
MMQ_ID_CU = KERNELS_DIR / "mmq_id.cu"
MMQ_SMALL_CU = KERNELS_DIR / "mmq_small.cu"
MMQ_WGMMA_CU = KERNELS_DIR / "mmq_wgmma.cu"
CONVERT_CU = KERNELS_DIR / "convert.cu"
MMF_CU = KERNELS_DIR / "mmf.cu"

#: quant_iq.cuh's grid I-quants: compiled for fewer column counts than the other formats (GRID_NTS), to
#: keep the instances down (the batch-1 mat-vec is what they are for; 2..8 columns run the 8-column kernel)
GRID_NAMES = tuple(q for q in ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m") if q in DTYPES)
#: quant_k.cuh's formats (K-quants, iq4_nl, iq4_xs, mxfp4) that opdispatch.dtypes knows, then the grid
#: I-quants: the mat-vecs (mmvq_stream too) dot them 32 values at a time (dot32), the dequantizing copy
#: decodes them
SUBSCALED_NAMES = (*(q for q in ("q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs", "mxfp4") if q in DTYPES),
                   *GRID_NAMES)
#: mm_common.cuh's weight kinds and b/destination kinds
W_KIND = {"f32": "W_F32", "f16": "W_F16", "bf16": "W_BF16", "q4_0": "W_Q4_0", "q4_1": "W_Q4_1",
          "q5_0": "W_Q5_0", "q5_1": "W_Q5_1", "q8_0": "W_Q8_0",
          **{q: f"W_{q.upper()}" for q in SUBSCALED_NAMES}}
B_KIND = {"f32": "B_F32", "f16": "B_F16", "bf16": "B_BF16"}
EPI_NONE, EPI_BIAS, EPI_GLU = "EPI_NONE", "EPI_BIAS", "EPI_GLU"
EPIS = (EPI_NONE, EPI_BIAS, EPI_GLU)
FLOAT_NAMES = ("f32", "f16", "bf16")
#: the 16-bit types the GEMM paths' b is converted to (cuBLAS: the weights' compute type; mmq_wgmma: bf16), which
#: a fused rms_norm or glu writes itself (convert.cu's convert_norm, convert_glu)
B16_TYPES = ("f16", "bf16")
LEGACY_NAMES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # quant.cuh's 32-value formats: mmq's
QUANT_NAMES = (*LEGACY_NAMES, *SUBSCALED_NAMES)

BLOCK = 128  # mmv_common.cuh's mm::BLOCK
ROWS = 2  # rows of a a mat-vec block computes (the kernels' R)
NTS = (1, 2, 4, 8)  # column counts the mat-vec kernels are compiled for
GROUPED_NTS = (1, 4, 8)  # ... and the grouped MoE kernels
GRID_NTS = (1, 8)  # ... for the grid I-quants (mmvq, mmvq_stream with b f32)
GRID_GROUPED_NTS = (8,)  # ... and their grouped MoE kernel
ROUTE_BLOCK = 1024  # mmv_id.cu's ROUTE_BLOCK
CONVERT_BLOCK = 256  # convert.cu's CONVERT_BLOCK
# mmv_common.cuh's block-format mat-vec: weight rows (streams) a block, warps a block at most,
# quantize_q8_1's threads
QROWS, QWARPS_MAX, QUANT_BLOCK = 4, 4, 256
CONVERT_GRID_MAX = 65536  # blocks of a conversion (grid-stride over rows beyond)


@attrs.frozen
class StreamConfig:
    """mmvq_stream's tunables: cp.async stages a warp (the kernel's NS, 2..4), warps a block
    (1..8; halved at bind time until the shared memory fits), blocks an SM the grid aims at.
    The default was the fastest, or within 4% of it, on the H200 (docs/cuda_matmul.md, tuning)."""

    stages: int = 2
    warps: int = 8
    blocks_per_sm: int = 2


#: the configuration binds use, and the stage count the instances are compiled for
STREAM = StreamConfig()


@attrs.frozen
class MatvecHead(ArgGroup):
    """The parameters mmv, mmvq_stream and mmf open with, alike: the weights a0 (a1: a fused GLU's up half),
    their row and batch strides and b's broadcast ratios r2, r3; b (element b_es, column b_col and batch
    strides, bytes); out and the sizes; the epilogue (biases, their row stride bias_col in floats: 0 for one
    row added to every output row, else a residual addend's; GLU kind and its alpha / limit)."""

    a0: np.uint64 = ptr()
    a1: np.uint64 = ptr()
    a_row: np.int64 = i64()
    a_s2: np.int64 = i64()
    a_s3: np.int64 = i64()
    r2: np.int32 = i32()
    r3: np.int32 = i32()
    b: np.uint64 = ptr()
    b_col: np.int64 = i64()
    b_es: np.int64 = i64()
    b_s2: np.int64 = i64()
    b_s3: np.int64 = i64()
    out: np.uint64 = ptr()
    M: np.int32 = i32()
    K: np.int32 = i32()
    N: np.int32 = i32()
    bias0: np.uint64 = ptr()
    bias1: np.uint64 = ptr()
    bias_col: np.int64 = i64()
    glu_kind: np.int32 = i32()
    alpha: np.float32 = f32()
    limit: np.float32 = f32()


def quant_nts(wt: str) -> tuple[int, ...]:
    """The column counts the block-format mat-vecs (mmvq, mmvq_stream with b f32) are compiled for."""
    return GRID_NTS if wt in GRID_NAMES else NTS


def grouped_nts(wt: str) -> tuple[int, ...]:
    """The column counts mmvq_id_grouped is compiled for."""
    return GRID_GROUPED_NTS if wt in GRID_NAMES else GROUPED_NTS


def mmv_name(wt: str, tb: str, nt: int, vec: bool, epi: str) -> str:
    return instance("mmv", W_KIND[wt], B_KIND[tb], nt, ROWS, vec, epi)


def mmv_id_name(wt: str, tb: str, vec: bool, epi: str) -> str:
    return instance("mmv_id", W_KIND[wt], B_KIND[tb], ROWS, vec, epi)


def grouped_name(wt: str, tb: str, nt: int, vec: bool, epi: str) -> str:
    return instance("mmv_id_grouped", W_KIND[wt], B_KIND[tb], nt, ROWS, vec, epi)


def mmvq_name(wt: str, nt: int, epi: str) -> str:
    return instance("mmvq", W_KIND[wt], nt, epi)


def stream_name(wt: str, tb: str, nt: int, epi: str, stages: int | None = None, keep: bool = False,
                ragged: bool = False) -> str:
    """mmvq_stream's instance for format wt (stages: STREAM.stages unless given; `keep`: the one that also
    writes a fused norm's values, KEEP_NT columns, no epilogue; `ragged`: rows that are not whole chunks)."""
    stages = STREAM.stages if stages is None else stages
    flags = (keep, True) if ragged else (True,) if keep else ()
    return instance("mmvq_stream", W_KIND[wt], B_KIND[tb], nt, epi, stages, *flags)


def mmq_name(wt: str, tile: Sequence[int]) -> str:
    return instance("mmq", W_KIND[wt], *tile)


def mmq_id_name(wt: str, tile: Sequence[int]) -> str:
    return instance("mmq_id", W_KIND[wt], *tile)


def mmvq_id_name(wt: str, epi: str) -> str:
    return instance("mmvq_id", W_KIND[wt], epi)


def qgrouped_name(wt: str, nt: int, epi: str) -> str:
    return instance("mmvq_id_grouped", W_KIND[wt], nt, epi)


def mmf_name(wt: str, n_tiles: int, epi: str) -> str:
    return instance("mmf", W_KIND[wt], n_tiles, epi)


def quantize_name(tb: str, norm: bool = False) -> str:
    """quantize_q8_1's instance for b of type tb (`norm`: the one that quantizes rms_norm(b) * w, b f32)."""
    return instance("quantize_q8_1", B_KIND[tb], *((True,) if norm else ()))


def convert_name(ts: str, td: str) -> str:
    return instance("convert", B_KIND[ts], B_KIND[td])


def dequant_name(wt: str, td: str) -> str:
    return instance("dequant", W_KIND[wt], B_KIND[td])


def convert_norm_name(td: str) -> str:
    return instance("convert_norm", B_KIND[td])


def convert_glu_name(td: str, vec: bool) -> str:
    return instance("convert_glu", B_KIND[td], vec)


ROUTE_NAME = "moe_route"

MMV_NAMES: tuple[str, ...] = (
    *(mmv_name(wt, "f32", nt, True, epi) for epi in EPIS for wt in FLOAT_NAMES for nt in NTS),
    *(mmv_name(wt, "f32", 8, False, epi) for epi in EPIS for wt in FLOAT_NAMES),
    *(mmv_name(wt, tb, 8, vec, EPI_NONE) for wt in FLOAT_NAMES for tb in ("f16", "bf16") for vec in (False, True)),
    *(quantize_name(tb) for tb in FLOAT_NAMES),
    quantize_name("f32", norm=True),
    *(mmvq_name(wt, nt, epi) for epi in EPIS for wt in QUANT_NAMES for nt in quant_nts(wt)),
)
MMV_ID_NAMES: tuple[str, ...] = (
    *(mmv_id_name(wt, "f32", vec, epi) for wt in FLOAT_NAMES for vec in (False, True) for epi in EPIS),
    *(mmvq_id_name(wt, epi) for wt in QUANT_NAMES for epi in EPIS),
    *(grouped_name(wt, "f32", nt, True, epi) for wt in FLOAT_NAMES for nt in GROUPED_NTS for epi in EPIS[:2]),
    *(grouped_name(wt, "f32", 8, False, epi) for wt in FLOAT_NAMES for epi in EPIS[:2]),
    *(qgrouped_name(wt, nt, epi) for wt in QUANT_NAMES for nt in grouped_nts(wt) for epi in EPIS[:2]),
    ROUTE_NAME,
)
CONVERT_NAMES: tuple[str, ...] = (
    *(convert_name(ts, td) for ts in FLOAT_NAMES for td in FLOAT_NAMES),
    *(dequant_name(wt, td) for wt in QUANT_NAMES for td in ("f16", "f32")),
    *(convert_norm_name(td) for td in B16_TYPES),
    *(convert_glu_name(td, vec) for td in B16_TYPES for vec in (False, True)),
)
#: mmvq_stream, every block format: b f32 for every column count (quant_nts) and epilogue; b f16/bf16
#: (unfused mul_mat only) for 8 columns, but for the grid I-quants (mmvq takes those: STREAM_B16)
STREAM_B16 = tuple(q for q in QUANT_NAMES if q not in GRID_NAMES)
#: the column count of the instances that write a fused norm's values (fusion.SHARE): one sequence's decode
KEEP_NT = 1
#: ... and of the instances for rows that are not whole chunks (support.stream_ok): one column (batch-1 decode,
#: and mul_mat_id at one token); more columns take mmvq there
RAGGED_NT = 1
#: the formats whose rows that are not whole chunks take those RAGGED instances: the sub-scaled formats but q4_K and
#: q5_K (chunks of one block: every row is whole chunks). The legacy formats (LEGACY_NAMES) run such rows on mmvq,
#: which was as fast or faster for q4_0 and q8_0 on the H200 (docs/cuda_matmul.md, "Rows that are not whole chunks")
RAGGED_TYPES = tuple(q for q in SUBSCALED_NAMES if q not in ("q4_K", "q5_K"))
STREAM_NAMES: tuple[str, ...] = (
    *(stream_name(wt, "f32", nt, epi) for epi in EPIS for wt in QUANT_NAMES for nt in quant_nts(wt)),
    *(stream_name(wt, tb, 8, EPI_NONE) for tb in ("f16", "bf16") for wt in STREAM_B16),
    *(stream_name(wt, "f32", KEEP_NT, EPI_NONE, keep=True) for wt in QUANT_NAMES),
    *(stream_name(wt, "f32", RAGGED_NT, epi, ragged=True) for epi in EPIS for wt in RAGGED_TYPES),
)
#: mmf: f16/bf16 weights, b f32, one or two 8-column tiles, every epilogue
MMF_TYPES = ("f16", "bf16")
MMF_NAMES: tuple[str, ...] = tuple(mmf_name(wt, nt, epi) for wt in MMF_TYPES for nt in (1, 2) for epi in EPIS)
#: every instance the specs can name, per source (tests/test_kernels_compile.py compiles them all; mmq's and
#: mmq_id's are added at the end of this module)
KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {MMV_CU: MMV_NAMES, MMV_ID_CU: MMV_ID_NAMES,
                                               CONVERT_CU: CONVERT_NAMES, MMVQ_STREAM_CU: STREAM_NAMES,
                                               MMF_CU: MMF_NAMES}

#: a tensor's device address (a bind's `ctx.ptr`; tests pass fakes)
Ptr = Callable[[Tensor], int]
#: scratch(role, nbytes, zeroed=False) -> device address of a buffer of at least nbytes for `role` (zeroed
#: once when allocated, if asked: counters the kernels set back to 0)
Scratch = Callable[..., int]


def nt_for(n: int, choices: Sequence[int] = NTS) -> int:
    """The fewest compiled columns that hold n (n <= 8)."""
    return next(nt for nt in choices if nt >= n)


def geometry(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and byte strides padded to 4 dims (missing outer dims: size 1, stride 0)."""
    pad = 4 - t.ndim
    return pad4(t.shape), (0,) * pad + tuple(t.strides)


def elem_stride(t: Tensor) -> int:
    """Byte stride of t's last axis (any value when it has one element)."""
    return t.strides[-1] if t.shape[-1] > 1 else t.dtype.block_bytes


def addr(ptr: Ptr, t: Tensor | None) -> int:
    """t's address, 0 (a null pointer) for an absent operand."""
    return ptr(t) if t is not None else 0


from . import mmq, mmq_id, mmq_small, mmq_wgmma  # noqa: E402 - last: they import the names above; their tables name the instances

KERNEL_SOURCES[MMQ_CU] = mmq.NAMES
KERNEL_SOURCES[MMQ_ID_CU] = mmq_id.NAMES
KERNEL_SOURCES[MMQ_SMALL_CU] = mmq_small.NAMES
KERNEL_SOURCES[MMQ_WGMMA_CU] = mmq_wgmma.NAMES
