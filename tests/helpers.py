"""Test helpers shared by the op tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import attrs
import numpy as np
import pytest

from opdispatch import Plan
from opdispatch import input as new_input
from opdispatch import ops
from opdispatch.backends.cuda.args import IndexCheck
from opdispatch.backends.cuda.devices import discover
from opdispatch.dtypes import from_float, to_host_float
from opdispatch.graph import Graph
from opdispatch.quants.samples import HALVES, IQ1M_SCALES
from opdispatch.reference import REFERENCE
from opdispatch.tensor import VIEW_OPS, Flag, Tensor
from opdispatch.testing.metrics import nmse

__all__ = ["FAKE_WORD", "FakeGuard", "SUBSCALED_HALVES", "assert_close", "edge_cases", "evaluate", "nmse",
           "SUBSCALED_SIZES", "stored", "subscaled_blocks", "uniform"]


def evaluate(outputs: Tensor | Sequence[Tensor], feeds: dict[Tensor, Any] | None = None) -> list[np.ndarray]:
    """Run a graph with the reference kernels and return the outputs as host arrays.

    (Interim: a direct walk over the graph; to be replaced by compile(graph, "cpu").run.)
    """
    graph = Graph.build(outputs)
    feeds = feeds or {}
    storage: dict[Tensor, np.ndarray] = {}
    for t in graph.leafs:
        buf = np.zeros(t.nbytes, np.uint8)
        if t.data is not None:
            buf[:] = t.data
        elif t.flags & Flag.INPUT:
            vals = np.asarray(feeds[t])
            host = from_float(t.dtype, vals) if not t.dtype.is_int else vals.astype(t.dtype.numpy)
            buf[:] = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
        storage[t] = buf
    for n in graph.nodes:
        if n.view_src is None:
            storage[n] = np.zeros(n.nbytes, np.uint8)
    def arr(t: Tensor) -> np.ndarray:
        return t.host_view(storage[t.base], t.view_offset)
    for n in graph.nodes:
        if n.op in VIEW_OPS:
            continue
        REFERENCE[n.op](n, arr(n), *[arr(s) if s is not None else None for s in n.srcs])
    return [np.array(arr(o)) for o in graph.outputs]


def edge_cases(*groups: str, full: bool = False) -> list[Any]:
    """pytest params of the sweep's edge-value cases (label "edges ...") of `groups`, named by case."""
    import pytest

    from opdispatch.testing.cases import cases

    return [pytest.param(c, id=c.name) for g in groups for c in cases(g, full) if c.label.startswith("edges")]


def uniform(gen: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return gen.uniform(-1.0, 1.0, shape)


def stored(values: np.ndarray, dt: str) -> np.ndarray:
    """What a tensor of dtype `dt` holds for `values`, as float64 (quantized: dequantized)."""
    return to_host_float(dt, from_float(dt, values)).astype(np.float64)


def assert_close(out: np.ndarray, ref: np.ndarray, seed: int, tol: float = 1e-7) -> None:
    assert out.shape == ref.shape, f"shape {out.shape} != {ref.shape} (seed {seed})"
    err = nmse(out, ref)
    assert err <= tol, f"nmse {err:.3g} > {tol:g} (seed {seed})"
    # evaluate() starts outputs at zero: every entry the formula makes nonzero must be written.
    assert np.all((out != 0) | (ref == 0)), f"output entries left unwritten (seed {seed})"


def moe(dt: str, n_exp: int, m: int, k: int, n_tok: int, used: int, glu: bool, bias: bool) -> Tensor:
    """mul_mat_id of (n_exp, m, k) experts of type dt for x (n_tok, 1, k) and ids (n_tok, used), with
    add_id biases if `bias`, and if `glu` the gate/up pair under swiglu_oai (gpt-oss's alpha and limit):
    the fused MoE patterns."""
    x = new_input("x", (n_tok, 1, k))
    ids = new_input("ids", (n_tok, used), "i32")

    def proj(name: str) -> Tensor:
        y = ops.mul_mat_id(new_input(f"w{name}", (n_exp, m, k), dt), x, ids)
        return ops.add_id(y, new_input(f"b{name}", (n_exp, m)), ids) if bias else y

    return ops.glu_split(proj("g"), proj("u"), "swiglu_oai", alpha=1.702, limit=7.0) if glu else proj("g")


def gate_up_glu(dt: str, m: int, k: int, n: int, bias: bool, kind: str) -> Tensor:
    """glu(gate (m, k) . x, up (m, k) . x) for x (n, k), weights of type dt, optional biases: the
    fused gate/up mat-vec pattern (swiglu_oai with gpt-oss's alpha and limit)."""
    x = new_input("x", (n, k))
    g, u = ops.mul_mat(new_input("wg", (m, k), dt), x), ops.mul_mat(new_input("wu", (m, k), dt), x)
    if bias:
        g, u = ops.add(g, new_input("bg", (m,))), ops.add(u, new_input("bu", (m,)))
    if kind == "swiglu_oai":
        return ops.glu_split(g, u, kind, alpha=1.702, limit=7.0)
    return ops.glu_split(g, u, kind)


def biased(dt: str, m: int, k: int, n: int) -> Tensor:
    """add(mul_mat(w, x), bias): a (m, k) weight of type dt, x (n, k), one bias row: the fused bias pattern."""
    return ops.add(ops.mul_mat(new_input("w", (m, k), dt), new_input("x", (n, k))), new_input("bias", (m,)))


def residual(dt: str, m: int, k: int, n: int, batch: tuple = (), pad: int = 0) -> Tensor:
    """add(r, mul_mat(w, x)): r of the product's shape (*batch, n, m), rows m + pad floats apart (a view when pad)."""
    wide = new_input("r", (*batch, n, m + pad))
    r = wide.view((*batch, n, m), wide.strides) if pad else wide
    return ops.add(r, ops.mul_mat(new_input("w", (m, k), dt), new_input("x", (*batch, n, k))))


def assert_graph_segments(plan: Plan, disabled: str) -> None:
    """`plan`'s CUDA segments ran as OPDISPATCH_DISABLE_CUDA_GRAPHS = `disabled` says: launched directly, never
    captured ("1"), or captured once and replayed since ("0")."""
    from opdispatch.backends.cuda.backend import Segment  # CuPy's: only the GPU tests call this

    segments = [s for s in plan._bind().runners if isinstance(s, Segment)]
    assert segments
    for s in segments:
        if disabled == "1":
            assert s.runner.capture is None and s.runner.captures == 0
        else:
            assert s.runner.captures == 1 and not s.runner.disabled, s.runner.disabled


#: the error word's device address a FakeGuard hands out
FAKE_WORD = 0x7E00_0000_0000


@attrs.define
class FakeGuard:
    """A bind's `ctx.index_check` for spec tests without a GPU: call k gets IndexCheck(FAKE_WORD, k), and
    `uses` records each call's (node, index tensor, bound, what, instead)."""

    uses: list[tuple[Tensor, Tensor, int, str, str]] = attrs.field(factory=list)

    def __call__(self, node: Tensor, index: Tensor, bound: int, what: str, instead: str) -> IndexCheck:
        self.uses.append((node, index, bound, what, instead))
        return IndexCheck(FAKE_WORD, len(self.uses) - 1)


#: block (values, bytes) of the sub-scaled formats, as ggml: quant_k.cuh's, then quant_iq.cuh's grid I-quants
SUBSCALED_SIZES = {"q2_K": (256, 84), "q3_K": (256, 110), "q4_K": (256, 144), "q5_K": (256, 176), "q6_K": (256, 210),
                   "iq4_nl": (32, 18), "iq4_xs": (256, 136), "mxfp4": (32, 17),
                   "iq2_xxs": (256, 66), "iq2_xs": (256, 74), "iq2_s": (256, 82), "iq3_xxs": (256, 98),
                   "iq3_s": (256, 110), "iq1_s": (256, 50), "iq1_m": (256, 56)}
#: byte offsets of the f16 fields (d, dmin) of each sub-scaled format's block (ggml-common.h); mxfp4 has
#: none (its scale is an e8m0 byte), iq1_m's d is the top nibbles of its 4 scale words (IQ1M_SCALES)
SUBSCALED_HALVES = {q: HALVES.get(q, ()) for q in SUBSCALED_SIZES}


def _halves(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    """n f16 bit patterns: any finite half (zeros and subnormals among them) when scale is 1, else
    uniform(-1, 1) * scale."""
    if scale == 1.0:
        bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
        return np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # inf/NaN exponent -> subnormal
    return (rng.uniform(-1, 1, n) * scale).astype(np.float16).view(np.uint16)


def subscaled_blocks(rng: np.random.Generator, name: str, nblocks: int, e_range: tuple[int, int] = (0, 256),
                  scale: float = 1.0) -> np.ndarray:
    """nblocks random valid blocks (nblocks, block bytes) of sub-scaled format `name` (the K-quants, iq4_nl,
    iq4_xs, mxfp4, the grid I-quants): any code and sub-scale bytes, f16 d and dmin finite (zeros and
    subnormals among them; magnitudes about `scale` when it is not 1, else any finite half), mxfp4's
    exponent bytes from e_range."""
    raw = rng.integers(0, 256, (nblocks, SUBSCALED_SIZES[name][1]), dtype=np.uint8)
    for at in SUBSCALED_HALVES[name]:
        raw[:, at:at + 2] = _halves(rng, nblocks, scale).astype("<u2").view(np.uint8).reshape(nblocks, 2)
    if name == "iq1_m":
        d = _halves(rng, nblocks, scale).astype(np.uint32)
        for k in range(4):  # nibble k of d on top of scale word k
            raw[:, IQ1M_SCALES + 2 * k + 1] = (raw[:, IQ1M_SCALES + 2 * k + 1] & 0x0F) | (((d >> (4 * k)) & 0xF) << 4)
    if name == "mxfp4":
        raw[:, 0] = rng.integers(*e_range, nblocks)
    return raw


def _needs_two_gpus() -> pytest.MarkDecorator:
    gpus, why = discover()
    return pytest.mark.skipif(len(gpus) < 2, reason=f"needs two CUDA GPUs, found {len(gpus)}" + (f" ({why})" if why else ""))


#: the marker of the tests that run a split over two GPUs (the layer and the tensor split)
needs_two_gpus = _needs_two_gpus()


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py imported as a module (the scripts folder is no package)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
