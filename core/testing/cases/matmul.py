"""Cases of the matrix products (mul_mat, mul_mat_id, out_prod) and the fused mul_mat patterns."""

from __future__ import annotations

import itertools
import math
from typing import Iterator

import numpy as np

from ... import ops
from ...dtypes import dtype as as_dtype
from ...ops.base import BLOCK_FORMATS, FLOATS, QUANTS
from ...tensor import Tensor
from .base import SAMPLED, Case, Inputs, block, bound, dims, pick
from .registry import fused, generator

#: the block formats weights are stored in (q8_K is ggml's activation format: no kernel reads it as weights)
WEIGHT_FORMATS = tuple(q for q in BLOCK_FORMATS if q != "q8_K")
#: the columns (batch N) around which the GPU's products change path or tile: a mat-vec (1), then the GEMMs'
#: column ranges (9, 16, 32, 64: mmf, mmq's table lines) and a batch past them (512: dequantized for cuBLAS)
BATCHES = (1, 9, 16, 32, 64, 512)
#: odd column counts: a partial column tile of each of mmq's table lines up to 128 columns
ODD_BATCHES = (9, 33, 100)
#: values in a K tile of the GPU's quantized GEMMs (8 steps of 32 values, as ggml's mmq)
K_TILE = 256
#: mul_mat_id with many tokens: (experts, used) pairs and token counts, on both sides of the GPU's switch from
#: a mat-vec per expert to the quantized GEMM (more than 8 (token, slot) pairs an expert on average)
MOE_SHAPES = ((8, 2), (64, 8))
MOE_TOKENS = (9, 64, 512)


def chunk(dt: str) -> int:
    """Values in the fewest blocks of format `dt` whose bytes are a multiple of 16: the GPU's streamed and
    tensor-core paths take rows of whole 16-byte chunks (docs/cuda_matmul.md), others go elsewhere."""
    t = as_dtype(dt)
    return t.block_size * 16 // math.gcd(t.block_bytes, 16)


def whole_k(dt: str, least: int) -> int:
    """The smallest K of whole chunks of `dt` that is at least `least`."""
    return math.ceil(least / chunk(dt)) * chunk(dt)


def odd_k(dt: str) -> int:
    """A K of whole chunks whose K tiles do not come out even: past one K tile and not a multiple of it where
    the chunk is smaller (q4_1: 384, q5_1: 320: a partial last K tile), else 5 chunks (5 K tiles for the
    formats of 256-value chunks: uneven split-K slices)."""
    c = chunk(dt)
    if c < K_TILE:
        return next(k for k in itertools.count(K_TILE + c, c) if k % K_TILE)
    return 5 * c


def mul_mat_case(ta: str, m: int, n: int, k: int, bs: tuple[int, int] = (1, 1), nr: tuple[int, int] = (1, 1),
                 tb: str = "f32", layout: str = "contig", weights: bool = False) -> Case:
    a_shape = (*bs, m, k)
    b_shape = (bs[0] * nr[0], bs[1] * nr[1], n, k)

    def make(inp: Inputs) -> Tensor:
        a = inp.weight(a_shape, ta) if weights else inp.source(a_shape, ta)
        return ops.mul_mat(a, inp.uniform(b_shape, tb, layout=layout))

    label = f"a={ta} b={tb} m={m} n={n} k={k} bs={dims(bs)} nr={dims(nr)}"
    label += f" b:{layout}" if layout != "contig" else ""
    batch = b_shape[0] * b_shape[1]
    return Case("mul_mat", label + (" param" if weights else ""), make, bound("mul_mat", weight=ta),
                2 * m * n * k * batch)



@generator("mul_mat")
def _mul_mat(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield mul_mat_case("f32", 16, 1, 65)
        yield mul_mat_case("f16", 13, 9, 80, bs=(2, 3), nr=(1, 2))
        yield mul_mat_case("bf16", 7, 16, 64, bs=(1, 2), layout="perm")
        yield mul_mat_case("q4_0", 16, 1, 64, weights=True)
        yield mul_mat_case("q8_0", 11, 8, 96)
        yield mul_mat_case("q4_0", 77, 33, odd_k("q4_0"))  # the quantized GEMM, partial tiles, split K
        # one or two a group of the other formats: K-quants, iq4_nl / iq4_xs, mxfp4, the grid I-quants
        yield mul_mat_case("q4_K", 13, 1, 256)
        yield mul_mat_case("q6_K", 13, 9, 512, weights=True)
        yield mul_mat_case("iq4_nl", 13, 3, 96)
        yield mul_mat_case("mxfp4", 13, 16, 64)
        yield mul_mat_case("iq2_xxs", 13, 1, 256)
        yield mul_mat_case("iq3_s", 7, 8, 512)
        return
    for ta in FLOATS + QUANTS:
        for k in ((32, 96, 576) if ta in QUANTS else (65, 80, 588)):
            for n in (*range(1, 10), 16, 128, 512):
                yield mul_mat_case(ta, 16, n, k)
    for ta, bs, nr, n in itertools.product(("f32", "f16", "q4_0", "q8_0"), ((1, 1), (1, 3), (2, 1), (2, 3)),
                                           ((1, 1), (1, 2), (2, 1), (2, 2)), (1, 9)):
        yield mul_mat_case(ta, 13, n, 64, bs, nr)
    for ta, layout, n in itertools.product(("f32", "f16", "q8_0"), ("perm", "T", "strided"), (1, 16)):
        yield mul_mat_case(ta, 16, n, 64, (1, 2), (2, 1), layout=layout)
    for ta, tb, n in itertools.product(("f32", "f16", "bf16"), ("f16", "bf16"), (1, 16)):
        yield mul_mat_case(ta, 16, n, 80, tb=tb)
    for ta in ("f16", "q4_0", "q5_1"):
        yield mul_mat_case(ta, 16, 4, 64, weights=True)
    for ta in SAMPLED:  # odd M; 1 and 3 blocks a row; the mat-vecs (N <= 8), then mmq / dequant_cublas
        for blocks, n in itertools.product((1, 3), (*range(1, 10), 16, 64)):
            yield mul_mat_case(ta, 13, n, block(ta, blocks))
        for bs, nr, n in itertools.product(((1, 3), (2, 1)), ((1, 2), (2, 1)), (1, 9)):
            yield mul_mat_case(ta, 13, n, block(ta, 2), bs, nr)
        for n in (1, 16):
            yield mul_mat_case(ta, 13, n, block(ta, 2), weights=True)
    for ta in WEIGHT_FORMATS:  # each batch on rows of whole chunks, K of 16 K tiles; then odd M, N and K
        for n in BATCHES:
            yield mul_mat_case(ta, 127, n, 16 * K_TILE)
        for n in ODD_BATCHES:
            yield mul_mat_case(ta, 77, n, odd_k(ta), weights=n == 33)


@generator("mul_mat")
def _mul_mat_edges(op: str, full: bool) -> Iterator[Case]:
    """Float weights with some +-inf (rows of +-inf, or NaN where they meet), b with some NaN (its rows NaN).
    Block-format weights take no edge values: b is rounded to q8_1, which makes an infinite b NaN."""
    def one(ta: str, m: int, n: int, k: int) -> Case:
        def make(inp: Inputs) -> Tensor:
            a = inp.special((m, k), ta, (np.inf, -np.inf), 0.01)
            return ops.mul_mat(a, inp.special((n, k), "f32", (np.nan,), 0.005))

        return Case(op, f"edges a={ta} m={m} n={n} k={k} inf weights, NaN in b", make, bound(op), 2 * m * n * k)

    for ta, n in pick(full, (("f32", 1), ("f16", 1), ("bf16", 9)), itertools.product(FLOATS, (1, 4, 9, 64))):
        yield one(ta, 33, n, 160)


def _mul_mat_id_case(ta: str, n_exp: int, n_used: int, n_tok: int, m: int, k: int, b_rows: int) -> Case:
    def make(inp: Inputs) -> Tensor:
        experts = inp.source((n_exp, m, k), ta)
        b = inp.uniform((n_tok, b_rows, k))
        return ops.mul_mat_id(experts, b, inp.ids((n_tok, n_used), n_exp))

    label = f"as={ta} e={n_exp} used={n_used} t={n_tok} m={m} k={k} b_rows={b_rows}"
    return Case("mul_mat_id", label, make, bound("mul_mat_id", weight=ta), 2 * m * k * n_tok * n_used)


@generator("mul_mat_id")
def _mul_mat_id(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _mul_mat_id_case("f32", 4, 2, 5, 16, 65, 2)
        yield _mul_mat_id_case("q4_0", 8, 4, 3, 16, 64, 1)
        yield _mul_mat_id_case("q8_0", 8, 2, 64, 77, 512, 1)  # the quantized GEMM (16 pairs an expert)
        yield _mul_mat_id_case("f16", 8, 2, 9, 13, 80, 2)
        yield _mul_mat_id_case("q5_K", 4, 2, 1, 13, 256, 1)
        yield _mul_mat_id_case("iq4_xs", 8, 4, 3, 13, 512, 4)
        yield _mul_mat_id_case("iq1_s", 4, 2, 1, 13, 256, 2)
        return
    for ta in FLOATS + QUANTS:
        k = 96 if ta in QUANTS else 80
        for (n_exp, used), n_tok in itertools.product(((4, 2), (8, 4), (32, 4)), (1, 4, 32, 129)):
            for b_rows in (1, used):
                yield _mul_mat_id_case(ta, n_exp, used, n_tok, 16, k, b_rows)
    for ta in SAMPLED:  # one token (the mat-vecs) and several
        for (n_exp, used), n_tok, b_rows in itertools.product(((4, 2), (8, 4)), (1, 4, 9), (1, 2)):
            yield _mul_mat_id_case(ta, n_exp, used, n_tok, 13, block(ta, 2), b_rows)
    for ta in WEIGHT_FORMATS:  # many tokens, odd M, rows of whole chunks (b: one row a token, or one a slot)
        for (n_exp, used), n_tok in itertools.product(MOE_SHAPES, MOE_TOKENS):
            yield _mul_mat_id_case(ta, n_exp, used, n_tok, 77, whole_k(ta, 2 * K_TILE), 1 if n_exp == 8 else used)


def _out_prod_case(ta: str, k: int, m: int, n: int, bs: tuple[int, int] = (1, 1), nr: tuple[int, int] = (1, 1),
                   layout: str = "contig") -> Case:
    def make(inp: Inputs) -> Tensor:
        a = inp.source((*bs, k, m), ta)
        return ops.out_prod(a, inp.uniform((bs[0] * nr[0], bs[1] * nr[1], k, n), layout=layout))

    label = f"a={ta} k={k} m={m} n={n} bs={dims(bs)} nr={dims(nr)}" + (f" b:{layout}" if layout != "contig" else "")
    return Case("out_prod", label, make, bound("out_prod"), 2 * m * n * k * bs[0] * bs[1] * nr[0] * nr[1])


@generator("out_prod")
def _out_prod(op: str, full: bool) -> Iterator[Case]:
    if not full:
        yield _out_prod_case("f32", 13, 7, 5)
        yield _out_prod_case("f16", 16, 11, 9, (2, 3), (1, 2))
        yield _out_prod_case("q8_0", 11, 64, 5)
        yield _out_prod_case("f32", 7, 13, 16, layout="T")
        return
    for ta in FLOATS + BLOCK_FORMATS:
        m = block(ta, 2) if ta in BLOCK_FORMATS else 13
        for k, n in itertools.product((1, 7, 65), (1, 5, 16)):
            yield _out_prod_case(ta, k, m, n)
        for bs, nr in itertools.product(((1, 1), (2, 3)), ((1, 1), (2, 2))):
            yield _out_prod_case(ta, 16, m, 9, bs, nr)
        yield _out_prod_case(ta, 16, m, 9, layout="T")


# -- fused patterns -------------------------------------------------------------------------


@fused("mul_mat_add", needs=("mul_mat", "add"))
def _mul_mat_add(name: str, full: bool) -> Iterator[Case]:
    def one(ta: str, m: int, n: int, k: int, residual: str = "") -> Case:
        """The product plus a bias (one row of m values); with `residual` (a layout), an addend of the product's
        shape (n, m) plus the product (the add's second source), as a decoder's residual stream."""
        def make(inp: Inputs) -> Tensor:
            prod = ops.mul_mat(inp.source((m, k), ta), inp.uniform((n, k)))
            return ops.add(inp.uniform((n, m), layout=residual), prod) if residual else ops.add(prod, inp.uniform((m,)))

        label = f"a={ta} m={m} n={n} k={k}" + (f" residual:{residual}" if residual else "")
        return Case("add", label, make, bound("mul_mat", weight=ta), 2 * m * n * k, fused=name)

    yield one("f16", 16, 1, 64)
    yield one("q8_0", 13, 7, 96)
    yield one("q8_0", 13, 7, 96, "contig")
    yield one("q2_K", 13, 1, 256)
    yield one("iq2_s", 13, 1, 256)
    if full:
        for ta, n in itertools.product(FLOATS + BLOCK_FORMATS, (1, 8, 64)):
            yield one(ta, 64, n, 256)
        for ta, n in itertools.product(_FUSED_WEIGHTS, _FUSED_BATCHES):
            yield one(ta, 77, n, _fused_k(ta))
            yield one(ta, 77, n, _fused_k(ta), "strided" if n == 16 else "contig")


@fused("mul_mat_glu", needs=("mul_mat", "glu"))
def _mul_mat_glu(name: str, full: bool) -> Iterator[Case]:
    def one(ta: str, kind: str, m: int, n: int, k: int) -> Case:
        def make(inp: Inputs) -> Tensor:
            x = inp.uniform((n, k))
            gate, up = (ops.mul_mat(inp.source((m, k), ta), x) for _ in range(2))
            return ops.glu_split(gate, up, kind)

        # twice mul_mat's: the GLU multiplies two products, each off by b's rounding (docs/conformance.md)
        return Case("glu", f"{kind} a={ta} m={m} n={n} k={k}", make, 2 * bound("mul_mat", weight=ta),
                    4 * m * n * k, fused=name)

    yield one("f16", "swiglu", 16, 1, 64)
    yield one("q4_0", "geglu", 13, 3, 96)
    # one column of 61 rows, not 13: over 13 outputs the GLU's NMSE from b's q8_1 rounding alone passed 1e-3 for
    # 0.7% of 300 seeds (iq3_xxs, that rounding applied on the CPU; the H200 sweep hit one); over 61, the worst
    # of 300 seeds was 1.5e-4
    yield one("q3_K", "swiglu", 61, 1, 256)
    yield one("iq3_xxs", "swiglu", 61, 1, 256)
    if full:
        for ta, kind, n in itertools.product(FLOATS + BLOCK_FORMATS, ("swiglu", "geglu"), (1, 8)):
            yield one(ta, kind, 64, n, 256)
        for ta, n in itertools.product(_FUSED_WEIGHTS, _FUSED_BATCHES):
            yield one(ta, "swiglu", 77, n, _fused_k(ta))


def _glu_product(name: str, full: bool, residual: bool) -> Iterator[Case]:
    """glu(gate, up) as the b of a product (+ a residual of the product's shape): a decoder's MLP output. Where the
    product's GEMM takes b as 16-bit rows (cuBLAS, mmq_wgmma: prefill widths) one launch writes act(gate) * up as
    those rows and the GEMM adds the residual; elsewhere the nodes run apart. The product's bound (its b rounded
    once either way)."""
    def one(ta: str, kind: str, m: int, n: int, k: int) -> Case:
        def make(inp: Inputs) -> Tensor:
            y = ops.mul_mat(inp.source((m, k), ta), ops.glu_split(inp.uniform((n, k)), inp.uniform((n, k)), kind))
            return ops.add(y, inp.uniform((n, m))) if residual else y

        return Case("add" if residual else "mul_mat", f"{kind} a={ta} m={m} n={n} k={k}", make,
                    bound("mul_mat", weight=ta), 2 * m * n * k, fused=name)

    yield one("f16", "swiglu", 16, 40, 64)  # cuBLAS
    yield one("q4_0", "geglu", 77, 200, 256)  # mmq_wgmma
    yield one("q5_1", "swiglu_oai", 13, 200, 96)  # dequant_cublas
    if full:
        for ta, n in itertools.product(_FUSED_WEIGHTS, _FUSED_BATCHES):
            yield one(ta, "swiglu", 77, n, _fused_k(ta))


@fused("glu_mul_mat_add", needs=("glu", "mul_mat", "add"))
def _glu_mul_mat_add(name: str, full: bool) -> Iterator[Case]:
    yield from _glu_product(name, full, residual=True)


@fused("glu_mul_mat", needs=("glu", "mul_mat"))
def _glu_mul_mat(name: str, full: bool) -> Iterator[Case]:
    yield from _glu_product(name, full, residual=False)


def _rms_norm_product(name: str, full: bool, glu: bool) -> Iterator[Case]:
    """rms_norm(x) * w before a product (or a gate/up GLU pair): the mat-vecs take the norm (mmvq_stream for
    block formats at whole chunks), the GEMMs in the launch that prepares their b (quantize_q8_1, convert_norm);
    elsewhere cuda_norm's rms_norm -> mul runs it. The normed values are about 1 in size, so the product's bound
    holds (twice it for the GLU, as mul_mat_glu)."""
    def one(ta: str, m: int, n: int, k: int) -> Case:
        def make(inp: Inputs) -> Tensor:
            h = ops.mul(ops.rms_norm(inp.uniform((n, k)), 1e-5), inp.uniform((k,)))
            if not glu:
                return ops.mul_mat(inp.source((m, k), ta), h)
            return ops.glu_split(ops.mul_mat(inp.source((m, k), ta), h), ops.mul_mat(inp.source((m, k), ta), h),
                                 "swiglu")

        return Case("glu" if glu else "mul_mat", f"a={ta} m={m} n={n} k={k}", make,
                    (2 if glu else 1) * bound("mul_mat", weight=ta), (4 if glu else 2) * m * n * k, fused=name)

    yield one("q4_0", 77, 1, 512)
    yield one("q4_K", 45, 3, 512)
    yield one("q6_K", 13, 8, 2048)
    yield one("f16", 16, 1, 64)
    yield one("q4_0", 77, 16, 512)  # the GEMM (its quantize takes the norm; the GLU then runs apart)
    if full:
        for ta, n in itertools.product(FLOATS + BLOCK_FORMATS, (1, 8, 16, 64)):
            yield one(ta, 64, n, whole_k(ta, 512) if ta in BLOCK_FORMATS else 256)


@fused("rms_norm_mul_mat", needs=("rms_norm", "mul", "mul_mat"))
def _rms_norm_mul_mat(name: str, full: bool) -> Iterator[Case]:
    yield from _rms_norm_product(name, full, glu=False)


@fused("rms_norm_mul_mat_glu", needs=("rms_norm", "mul", "mul_mat", "glu"))
def _rms_norm_mul_mat_glu(name: str, full: bool) -> Iterator[Case]:
    yield from _rms_norm_product(name, full, glu=True)


@fused("rms_norm_mul_mat_pair", needs=("rms_norm", "mul", "mul_mat"))
def _rms_norm_mul_mat_pair(name: str, full: bool) -> Iterator[Case]:
    """rms_norm(x) * w read by two products of one weight type on the GEMMs (above 8 columns), both outputs: one
    quantize_q8_1 (or convert_norm) launch rounds the normed values for both; each is held to mul_mat's bound."""
    def one(ta: str, m: int, n: int, k: int) -> Case:
        def make(inp: Inputs) -> list[Tensor]:
            h = ops.mul(ops.rms_norm(inp.uniform((n, k)), 1e-5), inp.uniform((k,)))
            return [ops.mul_mat(inp.source((m, k), ta), h), ops.mul_mat(inp.source((m, k), ta), h)]

        return Case("mul_mat", f"a={ta} m={m} n={n} k={k}", make, bound("mul_mat", weight=ta), 4 * m * n * k,
                    fused=name)

    yield one("q4_0", 77, 16, 512)
    yield one("q4_K", 45, 33, 2048)
    if full:
        for ta, n in itertools.product(_FUSED_WEIGHTS, (9, 16, 64, 512)):
            yield one(ta, 77, n, _fused_k(ta))


@fused("rms_norm_mul_mat_share", needs=("rms_norm", "mul", "mul_mat"))
def _rms_norm_mul_mat_share(name: str, full: bool) -> Iterator[Case]:
    """rms_norm(x) * w read by two products (a decoder's q/k stack and its v, weights of two types), both
    outputs, at one column: the first product's mat-vec takes the norm and writes the normed values for the
    second. Each is held to mul_mat's bound of the coarser weights."""
    def one(ta: str, tb: str, m: int, n: int, k: int) -> Case:
        def make(inp: Inputs) -> list[Tensor]:
            h = ops.mul(ops.rms_norm(inp.uniform((n, k)), 1e-5), inp.uniform((k,)))
            return [ops.mul_mat(inp.source((m, k), ta), h), ops.mul_mat(inp.source((m, k), tb), h)]

        worst = max(bound("mul_mat", weight=ta), bound("mul_mat", weight=tb))
        return Case("mul_mat", f"a={ta} then {tb} m={m} n={n} k={k}", make, worst, 4 * m * n * k, fused=name)

    yield one("q4_K", "q6_K", 77, 1, 512)
    yield one("q4_0", "q8_0", 45, 1, 2048)
    if full:
        for ta in BLOCK_FORMATS:
            yield one(ta, "q6_K", 64, 1, whole_k(ta, 512))


@fused("mul_mat_id_add_id", needs=("mul_mat_id", "add_id"))
def _mul_mat_id_add_id(name: str, full: bool) -> Iterator[Case]:
    def one(ta: str, n_exp: int, used: int, n_tok: int, m: int, k: int) -> Case:
        def make(inp: Inputs) -> Tensor:
            ids = inp.ids((n_tok, used), n_exp)
            y = ops.mul_mat_id(inp.source((n_exp, m, k), ta), inp.uniform((n_tok, 1, k)), ids)
            return ops.add_id(y, inp.uniform((n_exp, m)), ids)

        return Case("add_id", f"as={ta} e={n_exp} used={used} t={n_tok} m={m} k={k}", make,
                    bound("mul_mat_id", weight=ta), 2 * m * k * n_tok * used, fused=name)

    yield one("q8_0", 8, 2, 1, 13, 256)
    yield one("q4_0", 8, 2, 64, 77, 512)  # the quantized GEMM, which adds the bias as it writes
    if full:
        for ta, n_tok in itertools.product(("f16", *WEIGHT_FORMATS), (1, *MOE_TOKENS)):
            yield one(ta, 8, 2, n_tok, 77, whole_k(ta, 2 * K_TILE) if ta in BLOCK_FORMATS else 80)


#: the fused patterns' weights and batches past the mat-vecs (f16 / bf16: mmf's, which fuses up to 16 columns, then
#: cuBLAS; the block formats' GEMMs take the adds and norms, not the GLU)
_FUSED_WEIGHTS = ("f16", "bf16", *WEIGHT_FORMATS)
_FUSED_BATCHES = (9, 16, 64, 512)


def _fused_k(ta: str) -> int:
    """K of the fused patterns' batch cases: odd_k for block formats, 200 (whole 16-byte rows) for floats."""
    return odd_k(ta) if ta in BLOCK_FORMATS else 200

