"""Op sources: mismatched shapes and dtypes, wrong ranks, negative dimensions, and huge tensors.

Which shapes and dtypes each op takes is restated here from its builder's documented semantics
(docs/ops.md), independently of the checks under test: a mutation is bad by this table, and the
library must say so. Huge tensors are states (zero-initialised, never fed) of terabytes, or of more
than 2**63 elements, and in one variant of a product that wraps to 0 in int64; they are placed on an
axis that no other source is tied to, so that only their size is wrong.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ...dtypes import DTYPES, dtype as as_dtype
from ...ops.attention import KV_DTYPES
from ...ops.base import BLOCK_FORMATS, ENCODABLE, FLOATS, pad4
from ...ops.elementwise import UNARY_OPS
from ...tensor import Shape, Tensor, state
from .calls import Call
from .case import Built
from .catalogue import Base
from .mutation import Mutation, pick, rebuilt, replace_tensor
from .params import huge_choices, set_param

VIEWS = ("view", "reshape", "permute", "transpose")
MAPS = (*UNARY_OPS, "sqr", "sqrt", "log", "sin", "cos", "scale", "clamp", "leaky_relu")
BINARY = ("add", "sub", "mul", "div")
F32_ROWS = ("norm", "rms_norm", "l2_norm", "group_norm", "diag_mask_inf", "pad", "pad_reflect_1d", "roll", "diag",
            "tri", "sum_rows", "mean", "cumsum", "argmax", "argsort", "top_k")
F, Q, W = FLOATS, BLOCK_FORMATS, ENCODABLE  # W: the block formats opdispatch writes

#: op -> tensor argument -> the dtypes it takes (arguments of any dtype are left out)
ALLOWED: dict[str, dict[str, tuple[str, ...]]] = {
    "mul_mat": {"a": F + Q, "b": F}, "mul_mat_id": {"as_": F + Q, "b": ("f32",), "ids": ("i32",)},
    "out_prod": {"a": F + Q, "b": ("f32",)},
    **{op: {"a": F, "b": F} for op in (*BINARY, "add1")},
    "add_id": {"a": F, "b": F, "ids": ("i32",)},
    **{op: {"x": F} for op in MAPS}, "glu": {"x": F, "a": F, "b": F},
    **{op: {"x": ("f32",)} for op in F32_ROWS},
    "soft_max": {"a": ("f32",), "mask": ("f16", "f32"), "sinks": ("f32",)},
    "rope": {"x": ("f32", "f16"), "pos": ("i32",), "freq_factors": ("f32",)},
    "flash_attn_ext": {"q": ("f32", "f16"), "k": KV_DTYPES, "v": KV_DTYPES, "mask": ("f16",), "sinks": ("f32",)},
    "get_rows": {"a": F + ("i32",) + Q, "idx": ("i32",)},
    "set_rows": {"dst": F + W, "src": ("f32",), "idx": ("i32", "i64")},
    "cpy": {"a": F + ("i32",) + Q, "b": F + ("i32",) + W},
    "set": {"a": ("f32", "i32"), "b": ("f32", "i32")}, "acc": {"a": ("f32",), "b": ("f32",)},
    "repeat": {"a": ("f32", "f16", "bf16", "i16", "i32")}, "fill": {"x": ("f32", "f16")},
    "timestep_embedding": {"t": ("f32",)}, "sum": {"x": F}, "count_equal": {"a": ("i32",), "b": ("i32",)},
    "all_reduce_sum": {"x": ("f32",)},
}


def _last(shape: Shape, n: int) -> Shape:
    return (*shape[:-1], n)


def _block(t: Tensor) -> int:
    return t.dtype.block_size


def _breaker(op: str, c: Call) -> tuple[str, Shape, str, str] | None:
    """(argument, new shape, its dtype, why): a source shape that breaks the op's shape rules."""
    t = c.tensors
    if op == "mul_mat":
        a, b = c.t("a"), c.t("b")
        return "b", _last(b.shape, a.shape[-1] + 1), b.dtype.name, "K differs"
    if op == "out_prod":
        a, b = c.t("a"), c.t("b")
        return "b", (*b.shape[:-2], a.shape[-2] + 1, b.shape[-1]), b.dtype.name, "K differs"
    if op == "mul_mat_id":
        ids = c.t("ids")
        return "ids", (ids.shape[0] + 1, ids.shape[1]), "i32", "a token more in ids than in b"
    if op in BINARY:
        a, b = c.t("a"), c.t("b")
        return "b", _last(b.shape, a.shape[-1] + 1), b.dtype.name, "b's rows longer than a's"
    if op == "add1":
        return "b", (2,), c.t("b").dtype.name, "b of two elements"
    if op == "add_id":
        ids = c.t("ids")
        return "ids", (ids.shape[0], ids.shape[1] + 1), "i32", "ids of another (T, U) than a"
    if op == "glu":
        name = "b" if c.split else "x"
        x = c.t(name)
        return name, _last(x.shape, x.shape[-1] + 1), x.dtype.name, "odd rows" if name == "x" else "b differs from a"
    if op == "soft_max":
        a = pad4(c.t("a").shape)
        mask = t.get("mask")
        return "mask", (a[2], a[3] + 1), mask.dtype.name if mask is not None else "f16", "a mask column too many"
    if op == "rope":
        return "pos", (pad4(c.t("x").shape)[1] + 1,), "i32", "a position more than tokens"
    if op == "flash_attn_ext":
        k = c.t("k")
        return "k", _last(k.shape, k.shape[-1] + 32), k.dtype.name, "k's head size differs from q's"
    if op == "get_rows":
        a2 = pad4(c.t("a").shape)[1]
        i2, _, n = (1,) * (3 - c.t("idx").ndim) + c.t("idx").shape
        return "idx", (i2, a2 + 1, n), "i32", "idx's batch axes differ from a's"
    if op == "set_rows":
        src = c.t("src")
        return "src", _last(src.shape, src.shape[-1] + 1), src.dtype.name, "src rows longer than dst's"
    if op == "cpy":
        b = c.t("b")
        return "b", _last(b.shape, b.shape[-1] + _block(b)), b.dtype.name, "b holds more elements than a"
    if op in ("set", "acc"):
        a = c.t("a")
        return "b", (a.size + 1,), c.t("b").dtype.name, "b larger than a"
    if op == "concat":
        a, b = c.t("a"), c.t("b")
        if a.ndim == 1:
            return "b", (2, *b.shape), b.dtype.name, "ranks differ"
        j = (c.params["axis"] + 1) % a.ndim
        shape = tuple(n + _block(b) if i == j else n for i, n in enumerate(b.shape))
        return "b", shape, b.dtype.name, f"axis {j} differs"
    if op == "count_equal":
        b = c.t("b")
        return "b", _last(b.shape, b.shape[-1] + 1), "i32", "shapes differ"
    if op == "tri":
        x = c.t("x")
        return "x", _last(x.shape, x.shape[-1] + 1), "f32", "not square"
    if op == "diag":
        x = c.t("x")
        return "x", (*x.shape[:-2], 2, x.shape[-1]), "f32", "two rows per matrix"
    if op == "timestep_embedding":
        return "t", (c.t("t").shape[0], 2), "f32", "timesteps of two axes"
    if op == "argmax":
        return "x", (2, *c.t("x").shape), "f32", "three axes"
    return None


def shape(rng: np.random.Generator, base: Base) -> Mutation | None:
    broken = _breaker(base.call.op, base.call)
    if broken is None:
        return None
    name, new, dt, why = broken
    return Mutation("shape", True, f"{name} {new} {dt} ({why})", replace_tensor(name, new, dt), (f"fz_{name}",))


def _first(call: Call) -> tuple[str, Tensor] | None:
    return next(((n, t) for n, t in call.tensors.items() if t is not None), None)


def rank(rng: np.random.Generator, base: Base) -> Mutation | None:
    """Slot 0 with 5 axes or none (every op takes 1 to 4; views are left out: they take any rank)."""
    first = _first(base.call)
    if base.call.op in VIEWS or first is None:
        return None
    name, t = first
    options = [((2,) * (5 - t.ndim) + t.shape, "5 axes")]
    if not t.dtype.is_quant:
        options.append(((), "no axes"))
    new, why = pick(rng, options)
    return Mutation("rank", True, f"{name} {new} ({why})", replace_tensor(name, new, t.dtype.name), (f"fz_{name}",))


def negative_dim(rng: np.random.Generator, base: Base) -> Mutation | None:
    first = _first(base.call)
    if first is None:
        return None
    name, t = first
    new = (-t.shape[0] if t.shape[0] else -1, *t.shape[1:])
    return Mutation("negative-dim", True, f"{name} {new}", replace_tensor(name, new, t.dtype.name), (f"fz_{name}",))


def _wrong_dtypes(t: Tensor, allowed: tuple[str, ...]) -> list[str]:
    last = t.shape[-1] if t.shape else None  # a block format needs whole blocks on the last axis
    return [d for d in DTYPES if d not in allowed
            and (not as_dtype(d).is_quant or (last is not None and last % as_dtype(d).block_size == 0))]


def dtype(rng: np.random.Generator, base: Base) -> Mutation | None:
    c = base.call
    options = [(n, d) for n, allowed in ALLOWED.get(c.op, {}).items() if c.tensors.get(n) is not None
               for d in _wrong_dtypes(c.t(n), allowed)]
    if c.op == "concat":  # any dtype, but both the same
        options += [("b", d) for d in _wrong_dtypes(c.t("b"), (c.t("a").dtype.name,))]
    if not options:
        return None
    name, dt = pick(rng, options)
    t = c.t(name)
    return Mutation("dtype", True, f"{name} {dt} for {t.dtype.name}", replace_tensor(name, t.shape, dt),
                    (f"fz_{name}",))


#: op -> (tensor argument, axis) where a huge extent keeps every other shape rule
_HUGE_AXIS: dict[str, tuple[str, int]] = {
    **{op: ("x", 0) for op in (*MAPS, "norm", "rms_norm", "l2_norm", "group_norm", "diag_mask_inf", "pad",
                               "pad_reflect_1d", "roll", "fill", "sum", "sum_rows", "mean", "cumsum", "argmax",
                               "argsort", "top_k", "tri", "all_reduce_sum")},
    **{op: ("a", 0) for op in (*BINARY, "add1", "dup", "set", "acc", "permute", "transpose", "view", "reshape")},
    "glu": ("x", 0), "soft_max": ("a", 0), "rope": ("x", -2), "get_rows": ("a", -2), "set_rows": ("dst", -2),
    "diag": ("x", -1), "timestep_embedding": ("t", 0), "mul_mat": ("b", -2), "out_prod": ("b", -1),
    "add_id": ("b", 0), "mul_mat_id": ("as_", 0), "cont": ("a", 0), "concat": ("a", 0),
}
#: params that follow a huge source: cont keeps a's shape; reshape asks for the count an int64 product gives
_HUGE_PARAMS = {"cont": {"shape": None}, "reshape": {"shape": (0,)}}


def _huge_axis(c: Call) -> tuple[str, int] | None:
    got = _HUGE_AXIS.get(c.op)
    if got is None:
        return None
    if (c.op == "glu" and c.split) or (c.op == "soft_max" and (c.tensors["mask"] or c.tensors["sinks"])):
        return None
    if c.op == "cont" and c.params["shape"] != c.t("a").shape:
        return None  # a new shape is tied to a's count
    if c.op == "tri" and c.t("x").ndim < 3:
        return None
    if c.op == "concat":
        return "a", c.params["axis"]
    return got


WRAPS = "a product that wraps to 0 in int64"
#: regimes of huge: the factor one axis of a tensor of `total` elements of `itemsize` bytes is scaled by
_REGIMES: dict[str, Callable[[int, float], int]] = {
    "4 TiB or more": lambda total, itemsize: 1 << max(0, math.ceil(math.log2(2**42 / (total * itemsize)))),
    "just over 2**63 elements": lambda total, itemsize: 2**63 // total + 1,
    WRAPS: lambda total, itemsize: 2**64 >> ((total & -total).bit_length() - 1),
}


def huge(rng: np.random.Generator, base: Base) -> Mutation | None:
    """A source of terabytes or of more than 2**63 elements (a state, never fed), or params asking for a
    result that large. A reshape gets a source whose element count wraps to 0, reshaped to (0,)."""
    c = base.call
    placed = _huge_axis(c)
    choices = huge_choices(c)
    if placed is None and not choices:
        return None
    if placed is None or (choices and rng.random() < 0.5):
        name, value, why = pick(rng, choices)
        return set_param("huge", True, name, value, why)
    name, axis = placed
    t = c.t(name)
    regime = WRAPS if c.op == "reshape" else pick(rng, list(_REGIMES))
    factor = _REGIMES[regime](max(t.size, 1), t.dtype.block_bytes / t.dtype.block_size)
    new = tuple(n * factor if i == axis % t.ndim else n for i, n in enumerate(t.shape))
    dt = t.dtype.name
    follow = _HUGE_PARAMS.get(c.op, {})

    def apply(built: Built, call: Call, rng: np.random.Generator) -> Built:
        call = call.with_tensor(name, state("fz_huge", new, dt))
        for k, v in follow.items():
            call = call.with_param(k, v)
        return rebuilt(built, call.invoke())

    then = "".join(f", {k} = {v}" for k, v in follow.items() if v is not None)
    return Mutation("huge", True, f"{name} a state {new} {dt} ({regime}){then}", apply, ("fz_huge",))
