"""What a conformance case is: `Case`, the `Inputs` that draw its values, and the NMSE `bound`.

Bounds and input layouts are the standard of docs/conformance.md. Building a
case touches no device: it only makes tensors and numpy values.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import attrs
import numpy as np

from ...dtypes import DType, dtype as as_dtype
from ...ops.base import BLOCK_FORMATS, QUANTS
from ...quants.samples import random_blocks
from ...tensor import Tensor, input as new_input, param

#: ops whose bound is not the 1e-7 default (docs/conformance.md)
OP_BOUNDS: dict[str, float] = {
    "mul_mat": 5e-4, "mul_mat_id": 5e-4, "out_prod": 5e-4, "flash_attn_ext": 5e-4, "soft_max": 1e-6,
}
HALF_BOUND = 1e-4  # f16/bf16 results
#: the expected NMSE of a product whose f32 b is rounded to q8_1 (int8 codes, d = max|b| / 127 a 32 values), as
#: GPU kernels and ggml's CPU round it, for b uniform in [-1, 1): error variance d^2 / 12 over b's 1/3
Q8_1_NMSE = 1 / (4 * 127**2)
#: one code step of each block format opdispatch writes, on values uniform in [-1, 1]: 2 / levels, the widest
#: gap between levels for the non-linear iq4_nl / iq4_xs (kvalues) and mxfp4 (e2m1)
CODE_STEPS: dict[str, float] = {
    "q4_0": 1 / 8, "q4_1": 1 / 8, "q5_0": 1 / 16, "q5_1": 1 / 16, "q8_0": 1 / 64, "q2_K": 1 / 2, "q3_K": 1 / 4,
    "q4_K": 1 / 8, "q5_K": 1 / 16, "q6_K": 1 / 32, "q8_K": 1 / 64, "iq4_nl": 1 / 4, "iq4_xs": 1 / 4, "mxfp4": 1 / 3,
}
#: matrix products' bounds by weight format, where wider than the op's: 256 * Q8_1_NMSE for the K-quants with
#: a min, whose random blocks have sub-blocks of one sign, so that the rows' products share b's sums over
#: sub-blocks and the NMSE, a ratio of few terms, has a long tail (docs/conformance.md derives both)
WEIGHT_BOUNDS: dict[str, float] = {q: 256 * Q8_1_NMSE for q in ("q2_K", "q4_K", "q5_K")}
#: block formats whose sources are random valid blocks (`Inputs.blocks`): those past the legacy five, which
#: keep values quantized from uniform ones
SAMPLED = tuple(q for q in BLOCK_FORMATS if q not in QUANTS)
#: the source layouts of `Inputs.uniform`
LAYOUTS = ("contig", "perm", "T", "strided")
#: edge values the sweep mixes into inputs (docs/ops.md, "Edge values")
NON_FINITE = (float("inf"), float("-inf"), float("nan"))
ZEROS = (0.0, -0.0)
#: f32 subnormals (bf16 keeps most of them; f16 rounds them to zero)
SUBNORMALS = (2.0**-149, -(2.0**-149), 1e-40, -1e-40, 1.1e-38, -1.1e-38)
EDGES = NON_FINITE + ZEROS + SUBNORMALS


def bound(op: str, out: str | DType = "f32", n: int = 1, src: str | DType = "f32", weight: str = "") -> float:
    """The NMSE bound of `op` writing `out`; `n` values quantized from `src` for block formats; `weight`
    the dtype of a matrix product's weight, whose format may widen it (`WEIGHT_BOUNDS`).

    Quantized results: ggml's estimate of one code off by one in n values
    uniform in [-1, 1] (test_cpy), since a last-place tie may round either way;
    a block format copied to itself is bit-exact, held to the op's bound.
    """
    base = max(OP_BOUNDS.get(op, 1e-7), WEIGHT_BOUNDS.get(weight, 0.0))
    dt = as_dtype(out)
    if dt.is_quant and as_dtype(src) != dt:
        step = CODE_STEPS[dt.name]
        err = step * step * (16 if as_dtype(src).name == "f16" else 1)
        return max(base, err / (0.25 * max(n, 1)))
    if dt.name in ("f16", "bf16"):
        return max(base, HALF_BOUND)
    return base


def block(dt: str, blocks: int = 1) -> int:
    """The values of `blocks` blocks of block format `dt` (32 or 256 each): a row length it takes."""
    return as_dtype(dt).block_size * blocks


def dims(shape: Sequence[int]) -> str:
    """A shape as labels write it: 2x3x5."""
    return "x".join(str(n) for n in shape)


@attrs.define
class Inputs:
    """Makes a case's input tensors and draws their values; `feeds` maps each leaf to them."""

    rng: np.random.Generator
    feeds: dict[Tensor, np.ndarray] = attrs.field(factory=dict)

    def _leaf(self, shape: Sequence[int], dt: str, values: np.ndarray) -> Tensor:
        t = new_input(f"in{len(self.feeds)}", shape, dt)
        self.feeds[t] = values
        return t

    def uniform(self, shape: Sequence[int], dtype: str = "f32", lo: float = -1.0, hi: float = 1.0,
                layout: str = "contig") -> Tensor:
        """A tensor of `shape` with values uniform in [lo, hi), laid out as `layout`:

        contig; perm: axes -3 and -2 of the storage swapped (rows contiguous, out
        of order); T: the last two axes swapped (rows not contiguous); strided: a
        window on rows padded by a block at each end, at a byte offset.
        """
        return self._laid_out(shape, dtype, layout, lambda s: self.rng.uniform(lo, hi, s))

    def blocks(self, shape: Sequence[int], dtype: str, layout: str = "contig") -> Tensor:
        """A block-format tensor of random valid blocks (`quants.samples.random_blocks`: every code and
        sub-scale drawn, block scales of one octave), fed as raw bytes; layouts as `uniform`'s."""
        dt = as_dtype(dtype)

        def draw(s: tuple[int, ...]) -> np.ndarray:
            raw = random_blocks(self.rng, dt.name, math.prod(s) // dt.block_size)
            return raw.reshape(*s[:-1], dt.row_bytes(s[-1]))

        return self._laid_out(shape, dtype, layout, draw)

    def source(self, shape: Sequence[int], dtype: str = "f32", layout: str = "contig", lo: float = -1.0,
               hi: float = 1.0) -> Tensor:
        """A float or block-format source: uniform in [lo, hi) for floats and the legacy formats (quantized
        from those values), random valid blocks (`blocks`) for the formats after them."""
        return self.blocks(shape, dtype, layout) if dtype in SAMPLED else self.uniform(shape, dtype, lo, hi, layout)

    def _laid_out(self, shape: Sequence[int], dtype: str, layout: str,
                  draw: Callable[[tuple[int, ...]], np.ndarray]) -> Tensor:
        """A leaf fed `draw(its shape)`, viewed as `shape` in `layout` (see `uniform`)."""
        shape, dt = tuple(shape), as_dtype(dtype)
        if layout == "contig":
            return self._leaf(shape, dt.name, draw(shape))
        if layout == "perm" and len(shape) >= 3:
            axes = list(range(len(shape)))
            axes[-3], axes[-2] = axes[-2], axes[-3]
            leaf_shape = tuple(shape[a] for a in axes)
            return self._leaf(leaf_shape, dt.name, draw(leaf_shape)).permute(*axes)
        if layout == "T" and len(shape) >= 2 and not dt.is_quant:
            leaf_shape = shape[:-2] + (shape[-1], shape[-2])
            return self._leaf(leaf_shape, dt.name, draw(leaf_shape)).transpose()
        if layout == "strided":
            leaf_shape = shape[:-1] + (shape[-1] + 2 * dt.block_size,)
            leaf = self._leaf(leaf_shape, dt.name, draw(leaf_shape))
            return leaf.view(shape, leaf.strides, dt.block_bytes)
        raise ValueError(f"layout {layout!r} does not apply to {dt.name} {shape} (layouts: {', '.join(LAYOUTS)})")

    def special(self, shape: Sequence[int], dtype: str = "f32", values: Sequence[float] = (), share: float = 0.25,
                lo: float = -1.0, hi: float = 1.0, rows: Sequence[Sequence[float]] = ()) -> Tensor:
        """Edge values: uniform in [lo, hi) with a `share` of the elements drawn from `values` (zeros,
        infinities, NaN, subnormals) at random places; row i (of the last axis) is `rows[i]`
        repeated to fill it, where given (a zero row, a row of -inf)."""
        shape = tuple(shape)
        draw = self.rng.uniform(lo, hi, shape)
        if values:
            hit = self.rng.random(shape) < share
            draw[hit] = self.rng.choice(np.asarray(values, np.float64), int(hit.sum()))
        flat = draw.reshape(-1, shape[-1]) if shape else draw.reshape(1, 1)
        for i, row in enumerate(rows):
            flat[i] = np.resize(np.asarray(row, np.float64), shape[-1])
        return self.given(flat.reshape(shape), dtype)

    def given(self, values: np.ndarray, dtype: str = "f32") -> Tensor:
        """A tensor of `values`' shape holding them (converted to `dtype` when fed)."""
        return self._leaf(values.shape, as_dtype(dtype).name, values)

    def ints(self, shape: Sequence[int], lo: int, hi: int, dtype: str = "i32") -> Tensor:
        """Integers uniform in [lo, hi)."""
        return self._leaf(shape, dtype, self.rng.integers(lo, hi, tuple(shape)))

    def ids(self, shape: Sequence[int], n: int, dtype: str = "i32") -> Tensor:
        """Indices in [0, n), distinct along the last axis (set_rows rows, experts per token)."""
        shape = tuple(shape)
        if shape[-1] > n:
            raise ValueError(f"{shape[-1]} distinct indices out of {n}")
        order = np.argsort(self.rng.random(shape[:-1] + (n,)), axis=-1)
        return self._leaf(shape, dtype, order[..., : shape[-1]])

    def mask(self, shape: Sequence[int], dtype: str = "f16", empty_rows: bool = False,
             hidden: tuple[int, int] = (0, 0)) -> Tensor:
        """An attention mask: values in [-1, 1) with a random block of -inf in each row.

        Column 0 stays finite so no row is fully masked, unless `empty_rows`
        masks every other row completely (their result is defined as 0).
        Columns [hidden[0], hidden[1]) are -inf in every row: keys no query sees.
        """
        shape = tuple(shape)
        values = self.rng.uniform(-1.0, 1.0, shape)
        cols = shape[-1]
        start = self.rng.integers(1, max(cols, 2), shape[:-1])[..., None]
        end = self.rng.integers(start, cols + 1)
        c = np.arange(cols)
        values[(c >= start) & (c < end)] = -np.inf
        values[..., hidden[0]:hidden[1]] = -np.inf
        if empty_rows:
            values[..., ::2, :] = -np.inf
        return self._leaf(shape, dtype, values)

    def weight(self, shape: Sequence[int], dtype: str, lo: float = -1.0, hi: float = 1.0) -> Tensor:
        """A param (weights fixed at build time), for plugins that prepare weights when binding; random
        valid blocks for the formats `source` draws so."""
        shape, dt = tuple(shape), as_dtype(dtype)
        name = f"w{len(self.feeds)}"
        if dt.name in SAMPLED:
            raw = random_blocks(self.rng, dt.name, math.prod(shape) // dt.block_size)
            return param(name, raw, dt.name, shape=shape)
        return param(name, self.rng.uniform(lo, hi, shape), dtype)


Make = Callable[[Inputs], "Tensor | Sequence[Tensor]"]


@attrs.frozen
class Case:
    """One conformance case: `make` builds the graph, its first output is the node under test."""

    op: str
    label: str
    make: Make = attrs.field(repr=False)
    bound: float = 1e-7
    #: FLOPs of one run for compute-bound ops; 0: perf mode counts bytes
    flops: int = 0
    #: bytes one run moves, where inputs + outputs overstate it (a gather reads only its rows); 0: those
    nbytes: int = 0
    #: name of the fused pattern this case exercises ("" for a single op)
    fused: str = ""
    #: maps an output's values to a comparable form (top_k returns its k indices in any order)
    canon: Callable[[np.ndarray], np.ndarray] | None = attrs.field(default=None, repr=False)

    @property
    def group(self) -> str:
        """What the summary lists it under: the op, or 'fused:<pattern>'."""
        return f"fused:{self.fused}" if self.fused else self.op

    @property
    def name(self) -> str:
        return f"{self.group}[{self.label}]"

    def build(self, rng: np.random.Generator | None = None) -> tuple[list[Tensor], dict[Tensor, np.ndarray]]:
        """(outputs, feeds): a fresh graph and fresh random values for each of its inputs."""
        inp = Inputs(rng if rng is not None else np.random.default_rng())
        got = self.make(inp)
        outputs = [got] if isinstance(got, Tensor) else list(got)
        if outputs[0].op != self.op:
            raise ValueError(f"case {self.name}: first output is a {outputs[0].op} node, not {self.op}")
        return outputs, inp.feeds


def pick(full: bool, default: Iterable, every: Iterable) -> Iterable:
    """The whole sweep's variants with `full`, else the default set's."""
    return every if full else default
