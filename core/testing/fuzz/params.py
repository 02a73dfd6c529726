"""Op params: of the wrong Python type, out of their op's range, or valid in another spelling.

Wrong types are generic, by the kind the builder's annotation gives (a float or NaN where an int
is wanted, strings, None, lists, complex, objects); ranges are per op, from its documented
semantics (docs/ops.md), plus what no kernel argument can hold (an int past int64). The valid
spellings (numpy scalars, an integral int for a float, a list for a tuple) must be accepted.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .calls import Arg, Call
from .catalogue import Base
from .case import Built
from .mutation import Mutation, pick, rebuilt

Choice = tuple[str, Any, str]  # (argument, value, why)


def _wrong_types(a: Arg, v: Any) -> list[tuple[Any, str]]:
    none = [] if a.optional else [(None, "None")]
    if a.kind == "int":
        return none + [(v + 0.5, "a float for an int"), (float(v), "an integral float for an int"),
                       (math.nan, "NaN for an int"), (str(v), "a string for an int"), ([v], "a list for an int")]
    if a.kind == "float":
        return none + [("abc", "a string for a float"), (str(v), "a numeric string for a float"),
                       ([v], "a list for a float"), (complex(v, 1.0), "a complex for a float"),
                       (object(), "an object for a float")]
    if a.kind == "str":
        return none + [(3, "an int for a string"), ([v], "a list for a string")]
    if a.kind == "bool":
        return none + [("yes", "a string for a bool"), ([v], "a list for a bool")]
    seq = list(v)
    if not seq:
        return none + [("abc", f"a string for {a.kind}")]
    if a.kind == "ints":
        return none + [([seq[0] + 0.5, *seq[1:]], "a float in a sequence of ints"),
                       ([math.nan, *seq[1:]], "NaN in a sequence of ints"),
                       (",".join(map(str, seq)), "a string for a sequence of ints"),
                       (seq[0], "an int for a sequence"), ([[n] for n in seq], "nested lists for ints")]
    # pairs
    first = (seq[0][0] + 0.5, seq[0][1])
    return none + [([first, *seq[1:]], "a float in a pair"), ("abc", "a string for pairs"),
                   ([p[0] for p in seq], "ints for pairs"), ([(p[0],) for p in seq], "pairs of one")]


def _settable(call: Call) -> list[Arg]:
    return [a for a in call.args if a.kind != "tensor"]


def param_type(rng: np.random.Generator, base: Base) -> Mutation | None:
    args = _settable(base.call)
    if not args:
        return None
    a = pick(rng, args)
    value, why = pick(rng, _wrong_types(a, base.call.params[a.name]))
    return set_param("param-type", True, a.name, value, why)


def _cols(call: Call, name: str) -> int:
    """The length of tensor `name`'s last axis."""
    return call.t(name).shape[-1]


def _shifted(seq: tuple, i: int, delta: int) -> tuple:
    return tuple(n + delta if j == i else n for j, n in enumerate(seq))


def _ranges(call: Call) -> list[Choice]:
    """Per op: values of its params outside the range its semantics allow."""
    op, p = call.op, call.params
    t = call.tensors
    out: list[Choice] = []
    if op == "concat":
        nd = call.t("a").ndim
        out += [("axis", nd, "axis = ndim"), ("axis", -nd - 1, "axis < -ndim")]
    elif op == "group_norm":
        out += [("groups", 0, "no groups"), ("groups", -2, "negative groups")]
    elif op == "top_k":
        c = _cols(call, "x")
        out += [("k", 0, "k = 0"), ("k", c + 1, "k past the row length"), ("k", -1, "negative k")]
    elif op == "rope":
        out += [("n_dims", 0, "n_dims = 0"), ("n_dims", p["n_dims"] - 1, "odd n_dims"),
                ("n_dims", _cols(call, "x") + 2, "n_dims past the head size")]
    elif op == "all_reduce_sum":
        n = len(p["group"].split(","))
        out += [("rank", n, "rank past the group"), ("rank", -1, "a negative rank"),
                ("group", f"{p['group']},{p['group']}", "a device twice"), ("group", "", "no device")]
    elif op == "diag_mask_inf":
        out += [("n_past", -1, "negative n_past")]
    elif op == "timestep_embedding":
        out += [("dim", 0, "dim = 0"), ("dim", -4, "negative dim"), ("max_period", 0, "max_period = 0")]
    elif op == "pad_reflect_1d":
        out += [("p0", -1, "negative padding"), ("p1", _cols(call, "x"), "padding = the axis length")]
    elif op == "roll":
        s = p["shifts"]
        out += [("shifts", s[:-1] + (call.t("x").shape[-1],), "|shift| = the axis length")]
    elif op == "permute":
        axes, nd = p["axes"], call.t("a").ndim
        out += [("axes", (axes[0],) * nd, "a repeated axis"), ("axes", (axes[0] + nd, *axes[1:]), "an axis >= ndim"),
                ("axes", axes[:-1], "too few axes")]
    elif op == "view":
        a = call.t("a")
        out += [("offset", -a.dtype.block_bytes, "a negative offset"), ("offset", a.nbytes, "an offset at the end"),
                ("shape", (-1, *p["shape"][1:]), "a negative dimension")]
    elif op == "reshape":
        s = p["shape"]
        out += [("shape", (-1,) * max(len(s), 2), "two -1s"), ("shape", _shifted(s, 0, 1), "one element more"),
                ("shape", (-2, *s[1:]), "a dimension of -2")]
    elif op == "cont":
        s = p["shape"]
        out += [("shape", _shifted(s, 0, 1), "one row more"), ("shape", (-call.t("a").size,), "a negative dimension")]
    elif op == "repeat":
        s = p["shape"]
        if call.t("a").shape[-1] > 1:
            out += [("shape", _shifted(s, len(s) - 1, 1), "not a multiple of a's shape")]
        out += [("shape", (1,) * (5 - len(s)) + s, "5 axes")]
    elif op == "pad":
        pads = p["pads"]
        out += [("pads", ((-1, pads[0][1]), *pads[1:]), "negative padding"), ("pads", pads[:-1], "a pair short")]
    elif op in ("set", "acc"):
        a = call.t("a")
        out += [("offset", -4, "a negative offset"), ("offset", p["offset"] + 2, "an offset inside an element"),
                ("offset", a.size * 4, "an offset at a's end"), ("strides", p["strides"][:-1] + (8,),
                                                                     "a last stride of two elements")]
    elif op == "arange":
        out += [("step", 0.0, "step = 0"), ("step", -1.0, "a negative step"), ("stop", p["start"] - 1, "stop < start"),
                ("start", math.nan, "a NaN start")]
    elif op in ("soft_max", "flash_attn_ext") and t.get("mask") is None:
        out += [("max_bias", 1.0, "ALiBi without a mask")]
    if op in ("norm", "rms_norm", "l2_norm", "group_norm"):
        out += [("eps", -1e-5, "a negative eps"), ("eps", math.nan, "a NaN eps")]
    for a in _settable(call):
        if a.kind == "int":
            out.append((a.name, 2**64, "an int past int64"))
        elif a.kind == "ints" and p[a.name]:
            out.append((a.name, (2**64, *p[a.name][1:]), "an entry past int64"))
        elif a.kind == "str":
            out.append((a.name, "no-such-choice", f"an unknown {a.name}"))
    return out


def param_range(rng: np.random.Generator, base: Base) -> Mutation | None:
    choices = _ranges(base.call)
    if not choices:
        return None
    name, value, why = pick(rng, choices)
    return set_param("param-range", True, name, value, why)


def _valid_spellings(a: Arg, v: Any) -> list[tuple[Any, str]]:
    if a.kind == "int":
        return [(np.int64(v), "a numpy int64"), (np.int32(v), "a numpy int32")]
    if a.kind == "float":
        integral = [(int(v), "an int for an integral float")] if float(v).is_integer() else []
        return [(np.float64(v), "a numpy float64"), *integral]
    if a.kind == "ints":
        return [(list(v), "a list for a tuple"), (np.asarray(v, np.int64), "a numpy array of ints"),
                (tuple(np.int64(n) for n in v), "numpy ints")]
    if a.kind == "pairs":
        return [([list(q) for q in v], "lists for pairs")]
    if a.kind == "str":
        return [(np.str_(v), "a numpy string")]
    return []


def valid_param(rng: np.random.Generator, base: Base) -> Mutation | None:
    options = [(a, *s) for a in _settable(base.call) if base.call.params[a.name] is not None
               for s in _valid_spellings(a, base.call.params[a.name])]
    if not options:
        return None
    a, value, why = pick(rng, options)
    return set_param("valid-param", False, a.name, value, why)


def set_param(kind: str, bad: bool, name: str, value: Any, why: str) -> Mutation:
    def apply(built: Built, call: Call, rng: np.random.Generator) -> Built:
        return rebuilt(built, call.with_param(name, value).invoke())

    shown = f"<{type(value).__name__}>" if type(value).__repr__ is object.__repr__ else repr(value)
    return Mutation(kind, bad, f"{name} = {shown} ({why})", apply)


def huge_choices(call: Call) -> list[Choice]:
    """Params that make the result alone (not an input) need terabytes."""
    op, p = call.op, call.params
    if op == "repeat":
        s = p["shape"]
        return [("shape", (s[0] * 2**40, *s[1:]), "2**40 times the rows")]
    if op == "pad":
        pads = p["pads"]
        return [("pads", ((2**42, pads[0][1]), *pads[1:]), "2**42 leading pads")]
    if op == "timestep_embedding":
        return [("dim", 2**40, "dim = 2**40")]
    if op == "arange":
        return [("stop", p["start"] + 2.0**45, "2**45 values or more")]
    return []
