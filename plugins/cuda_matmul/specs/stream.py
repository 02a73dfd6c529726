"""kernels/mmvq_stream.cu's launch: its argument record, the geometry it mirrors (chunks, the row
layout, shared memory) and the grid, sized by the device's facts.

The Python mirror of the kernel's geometry is what lets support.py say, on a device description,
whether a node's b copy fits in shared memory, and what the tests check against the source.
"""

from __future__ import annotations

import attrs
import numpy as np

from opdispatch.backends.cuda.args import IndexCheck, KernelArgs, f32, i32, i64, ptr
from opdispatch.backends.cuda.devices import H200, DeviceFacts, facts
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.dtypes import DTYPES
from opdispatch.hookspecs import Device
from opdispatch.tensor import Tensor

from . import EPI_GLU, MMVQ_STREAM_CU, STREAM, MatvecHead, Ptr, StreamConfig, geometry, nt_for, quant_nts, stream_name

#: (block bytes, blocks a chunk) of each legacy format mmvq_stream takes: a chunk is the fewest
#: consecutive blocks whose bytes are a multiple of 16 (mmvq_stream.cu's Geo); mmq's rows are whole chunks too
STREAM_FORMATS = {"q4_0": (18, 8), "q4_1": (20, 4), "q5_0": (22, 8), "q5_1": (24, 2), "q8_0": (34, 8)}
#: the same for quant_k.cuh's and quant_iq.cuh's formats (those opdispatch.dtypes knows)
STREAM_K_FORMATS = {q: g for q, g in {"q2_K": (84, 4), "q3_K": (110, 8), "q4_K": (144, 1), "q5_K": (176, 1),
                                      "q6_K": (210, 8), "iq4_nl": (18, 8), "iq4_xs": (136, 2),
                                      "mxfp4": (17, 16), "iq2_xxs": (66, 8), "iq2_xs": (74, 8),
                                      "iq2_s": (82, 8), "iq3_xxs": (98, 8), "iq3_s": (110, 8), "iq1_s": (50, 8),
                                      "iq1_m": (56, 2)}.items() if q in DTYPES}
#: every format mmvq_stream takes
STREAMED = {**STREAM_FORMATS, **STREAM_K_FORMATS}
#: most chunk bytes a lane holds in registers (mmvq_stream.cu's REG_CHUNK_MAX); a larger chunk's
#: blocks are dotted one a lane straight from shared memory
REG_CHUNK_MAX = 272
#: formats whose lane dots half a chunk (mmvq_stream.cu's HALF_PIECE): the table lookups make them ALU-bound,
#: and half pieces halve each warp's ring and registers, so that two 8-warp blocks fit an SM
HALF_PIECE = frozenset({"iq4_xs", "mxfp4"})
#: bytes of the grid formats' lookup grids (quant_iq.cuh's GRID_BYTES), which mmvq_stream copies into shared memory,
#: and of one entry where not 8 (quant_iq.cuh's Entry)
GRID_BYTES = {"iq2_xxs": 2048, "iq2_xs": 4096, "iq2_s": 8192, "iq3_xxs": 1024, "iq3_s": 2048, "iq1_s": 8192,
              "iq1_m": 8192}
GRID_ENTRY = {"iq3_xxs": 4, "iq3_s": 4, "iq1_s": 4, "iq1_m": 4}
#: mmvq_stream's copies of a grid (its grid_copies, interleaved entry by entry, a lane reading copy lane % copies):
#: at most as many as the lanes one shared-memory wavefront serves (128 bytes of entries), whose gathers then meet
#: no bank conflict, and GRID_COPIES_MAX bytes of them; fewer than GRID_COPIES_MIN were no faster than one (H200,
#: 14336x4096 and 4096x4096, one column: iq2_s with 4 copies, iq1_s and iq1_m with 2; docs/benchmarks.md, session 30)
GRID_COPIES_MAX, GRID_COPIES_MIN = 32768, 8
#: shared memory the driver reserves per block (sm_80 and sm_90)
SMEM_PER_BLOCK_RESERVED = 1024


@attrs.frozen
class StreamArgs(KernelArgs):
    """mmvq_stream's arguments: the mat-vecs' head, then mul_mat_id's (ids 0 for a mul_mat), a fused rms_norm's
    weight and eps (norm_w 0: none) and where it also writes the normed values (norm_out 0: nowhere), `preload`,
    a grid format's copies of its grid (stream_spec sets them: grid_copies), the ids' check (UNCHECKED for a
    mul_mat)."""

    KERNELS = ("mmvq_stream",)
    _head: MatvecHead = attrs.field()
    ids: np.uint64 = ptr()
    ids_t: np.int64 = i64()
    ids_u: np.int64 = i64()
    E: np.int32 = i32()
    bias_e: np.int64 = i64()
    norm_w: np.uint64 = ptr()
    norm_eps: np.float32 = f32()
    norm_out: np.uint64 = ptr()
    preload: np.int32 = i32()
    grid_copies: np.int32 = i32()
    err_: IndexCheck


@attrs.frozen
class StreamLayout:
    """How mmvq_stream splits a row of K values (mmvq_stream.cu's Layout): C chunks a row, G lanes
    a row, R rows (slots) a warp stage, S segments a row, RO output rows and UG stages a group."""

    C: int
    G: int
    R: int
    S: int
    RO: int
    UG: int


def device_facts(device: Device | None) -> DeviceFacts:
    """The facts kernels are sized by; None stands for an H200's description."""
    return facts(device if device is not None else H200)


@attrs.frozen
class StreamGeo:
    """mmvq_stream.cu's Geo: a chunk is `cb` blocks (`chunk` bytes, a multiple of 16: rows are whole
    chunks, `row_values` values apart); a lane dots a piece of `lb` blocks (`piece` bytes, `values`
    values): the chunk (held in registers) when it is at most REG_CHUNK_MAX bytes (half of it for
    HALF_PIECE's formats), else one block;
    `bpiece` bytes of b's q8_1 copy in shared memory a piece (its codes, then a (d, d * sum) float2
    per 32 values, padded to an odd number of 16-byte granules)."""

    cb: int
    chunk: int
    row_values: int
    lb: int
    piece: int
    values: int
    bpiece: int


def stream_geo(dt: str) -> StreamGeo:
    nbytes, cb = STREAMED[dt]
    qk = DTYPES[dt].block_size
    chunk = cb * nbytes
    lb = 1 if chunk > REG_CHUNK_MAX else cb // 2 if dt in HALF_PIECE else cb
    braw = lb * qk // 32 * 40
    return StreamGeo(cb, chunk, cb * qk, lb, lb * nbytes, lb * qk, braw if (braw // 16) % 2 == 1 else braw + 16)


def ragged(dt: str, k: int) -> bool:
    """Rows of k values are not whole chunks (mmvq_stream.cu's RAGGED instances: the last piece partial, rows
    off 16-byte boundaries)."""
    return k % stream_geo(dt).row_values != 0


#: bytes a RAGGED stage holds beyond its 32 pieces (mmvq_stream.cu's STAGE: up to 4 granules a slot)
RAGGED_STAGE_EXTRA = 32 * 4 * 16


def stream_layout(dt: str, k: int, glu: bool) -> StreamLayout:
    """The layout of rows of k values: C counts pieces (a lane's share of a stage; a ragged row's last one
    partial)."""
    c = -(-k // stream_geo(dt).values)
    g = 1
    while g < c and g < 32:
        g *= 2
    r, s = 32 // g, -(-c // g)
    if not glu:
        return StreamLayout(c, g, r, s, r, s)
    if r >= 2:
        return StreamLayout(c, g, r, s, r // 2, 1)
    return StreamLayout(c, g, r, s, 1, 2 * s)


def stream_smem(dt: str, k: int, n: int, warps: int, stages: int, copies: int = 1) -> int:
    """Dynamic shared memory of an mmvq_stream block: b's n columns, each warp's ring, a fused norm's sums
    (8 floats a warp), a grid format's `copies` copies of its grid, then each warp's stage barriers (an 8-byte
    mbarrier a stage)."""
    g = stream_geo(dt)
    stage = 32 * g.piece + (RAGGED_STAGE_EXTRA if ragged(dt, k) else 0)
    return (n * -(-k // g.values) * g.bpiece + warps * stages * stage + warps * 8 * 4 + GRID_BYTES.get(dt, 0) * copies
            + warps * stages * 8)


def stream_warps(dt: str, k: int, n: int, device: Device | None, cfg: StreamConfig | None = None,
                 copies: int = 1) -> int:
    """The warps a block of mmvq_stream gets: cfg.warps, halved until the block's shared memory
    fits the device's opt-in limit; 0 when not even one warp fits."""
    cfg = cfg or STREAM
    limit = device_facts(device).smem_per_block_optin
    w = cfg.warps
    while w >= 1 and stream_smem(dt, k, n, w, cfg.stages, copies) > limit:
        w //= 2
    return max(w, 0)


def grid_copies(dt: str, k: int, n: int, device: Device | None, cfg: StreamConfig | None = None) -> int:
    """The copies of a grid format's grid an mmvq_stream block holds: the most (a power of two, GRID_COPIES_MIN
    up to GRID_COPIES_MAX bytes and the lanes of a wavefront) that leave the block the warps and an SM the blocks
    one copy does; else 1, and 1 for the other formats."""
    cfg = cfg or STREAM
    g = GRID_BYTES.get(dt, 0)
    if not g:
        return 1
    warps = stream_warps(dt, k, n, device, cfg)
    per_sm = stream_blocks_per_sm(stream_smem(dt, k, n, warps, cfg.stages), device, cfg)
    c = min(128 // GRID_ENTRY.get(dt, 8), GRID_COPIES_MAX // g)
    while c >= GRID_COPIES_MIN:
        if (stream_warps(dt, k, n, device, cfg, c) == warps and
                stream_blocks_per_sm(stream_smem(dt, k, n, warps, cfg.stages, c), device, cfg) == per_sm):
            return c
        c //= 2
    return 1


def stream_grid(layout: StreamLayout, m: int, batches: int, warps: int, blocks_per_sm: int, sm_count: int) -> int:
    """Blocks of mmvq_stream along x (one batch): blocks_per_sm an SM over all batches, or fewer when
    there are fewer groups than warps. The kernel splits a batch's groups evenly over its gridDim.x *
    warps warps (no warp takes more than the others' count plus one), so every SM gets the same share
    of the rows: a grid trimmed to fewer blocks (the same most groups a warp) would leave SMs with one
    block of a streaming load that is bound by each SM's loads in flight (on the H200 at 14336x4096,
    224 blocks of 264 slots left 40 SMs half busy: q4_K at 77% of the copy bandwidth)."""
    groups = -(-m // layout.RO)
    target = max(1, blocks_per_sm * sm_count // max(batches, 1))
    return min(target, -(-groups // warps))


def stream_blocks_per_sm(smem: int, device: Device | None, cfg: StreamConfig) -> int:
    """cfg.blocks_per_sm, fewer when an SM's shared memory holds fewer blocks (at least 1)."""
    per_sm = device_facts(device).smem_per_sm
    return max(1, min(cfg.blocks_per_sm, per_sm // (smem + SMEM_PER_BLOCK_RESERVED)))


def stream_addresses(ptr: Ptr, a: Tensor, a1: Tensor | None) -> bool:
    """The device addresses mmvq_stream needs (support.stream_ok checks the strides): the weights,
    and a fused GLU's up weight, 16-byte aligned. Should an arena ever place one otherwise, the
    two-launch kernel runs though explain() names the stream path."""
    return ptr(a) % 16 == 0 and (a1 is None or (a1.view_offset % 16 == 0 and ptr(a1) % 16 == 0))


def stream_spec(node: Tensor, args: StreamArgs, epi: str, device: Device | None,
                cfg: StreamConfig | None = None) -> KernelSpec | None:
    """mmvq_stream with `args` for mul_mat or mul_mat_id `node`, or None when it does not fit:
    cfg's warps halved until the block's shared memory fits, the grid from stream_grid (a
    mul_mat_id batch a (token, slot)), args' grid_copies from grid_copies."""
    cfg = cfg or STREAM
    a, b = node.srcs[:2]
    if node.op == "mul_mat_id":
        (_, m, k), (t, _, _) = a.shape, b.shape
        b3, b2, n = t, node.srcs[2].shape[1], 1
    else:
        (_, _, m, k), _ = geometry(a)
        (b3, b2, n, _), _ = geometry(b)
    dt, tb = a.dtype.name, b.dtype.name
    warps = stream_warps(dt, k, n, device, cfg)
    if not warps:
        return None
    copies = grid_copies(dt, k, n, device, cfg)
    args = attrs.evolve(args, grid_copies=copies)
    smem = stream_smem(dt, k, n, warps, cfg.stages, copies)
    layout = stream_layout(dt, k, epi == EPI_GLU)
    per_sm = stream_blocks_per_sm(smem, device, cfg)
    grid = (stream_grid(layout, m, b2 * b3, warps, per_sm, device_facts(device).sm_count) if n else 0, b2, b3)
    nt = nt_for(max(n, 1), quant_nts(dt)) if tb == "f32" else 8
    keep = int(args.norm_out) != 0  # fusion.SHARE's group: KEEP_NT columns (fusion.check_share)
    name = stream_name(dt, tb, nt, epi, cfg.stages, keep, ragged(dt, k))
    return KernelSpec(MMVQ_STREAM_CU, name, grid, 32 * warps, args, smem=smem)
