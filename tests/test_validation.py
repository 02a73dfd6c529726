"""Bad input raises a named error: sizes past 2**63, op params of the wrong type or range, feeds a tensor
cannot take, plans too large for memory, and errors of a cached plan naming the caller's graph."""

from __future__ import annotations

import inspect
import math
import time
from typing import Any, Callable

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cpu import HostBackend
from opdispatch.errors import FeedError, LaunchError, OpdispatchError, OpError, OutOfMemory, PlanKeyError
from opdispatch.hookspecs import Device
from opdispatch.ops import OPS
from opdispatch.tensor import MAX_EXTENT
from toy import ToyPlugin, manager_with


# -- sizes ------------------------------------------------------------------------------------
def test_sizes_are_python_ints_and_bounded_by_2_63() -> None:
    ok = od.input("ok", (2**31, 2**31), "i8")
    assert ok.size == 2**62 and type(ok.size) is int  # numpy's int64 product would be right here, but:
    with pytest.raises(OpError, match=r"tensor 'big': shape \(4611686018427387904, 4\) f32 holds 18446744073709551616 "
                                      r"elements .* 2\*\*63 or more"):
        od.input("big", (2**62, 4))  # 2**64 elements: int64 wraps to 0, and a reshape to (0,) was accepted
    with pytest.raises(OpError, match=r"reshape: cannot reshape 4611686018427387904 elements into \(0,\)"):
        ok.reshape((0,))
    with pytest.raises(OpError, match=r"tensor 'wide': a dimension of shape \(9223372036854775808,\) is 2\*\*63"):
        od.input("wide", (2**63,))
    with pytest.raises(OpError, match=r"tensor 'bytes': shape \(2305843009213693952, 2\) f32 holds .* in "
                                      r"18446744073709551616 bytes"):
        od.input("bytes", (2**61, 2))  # 2**62 elements fit, their 2**64 bytes do not
    x = od.input("x", (1,))
    with pytest.raises(OpError, match=r"^repeat: shape \(4294967296, 4294967296\) f32 holds"):
        ops.repeat(x, (2**32, 2**32))
    with pytest.raises(OpError, match=r"^view: shape \(4294967296, 4294967296\) f32 holds"):
        x.view((2**32, 2**32), (0, 0))  # 4 bytes of storage, 2**64 elements
    with pytest.raises(OpError, match=r"^arange: .* 2\*\*63 or more"):
        ops.arange(0.0, 1e30, 1e10)  # 1e20 values
    assert MAX_EXTENT == 2**63 - 1


def test_leaf_shapes_dtypes_and_values_are_named() -> None:
    for shape, match in (((2.0, 3), r"shape must hold integers, got 2\.0 \(float\) in \(2\.0, 3\)"),
                         ((True, 3), r"shape must hold integers, got True \(bool\)"),
                         (8, "shape must be a sequence of integers, got 8"), ("ab", "shape must be a sequence"),
                         ((2, -1), r"negative dimension in shape \(2, -1\)")):
        with pytest.raises(OpError, match=rf"^tensor 'x': {match}"):
            od.input("x", shape)
    with pytest.raises(OpError, match=r"^tensor 'u': unknown dtype 'f64'"):
        od.input("u", (2,), "f64")
    with pytest.raises(OpError, match="a tensor's name must be a str, got 3"):
        od.input(3, (2,))  # type: ignore[arg-type]
    with pytest.raises(OpError, match=r"^param 'w': values must be numbers, got <U1 values"):
        od.param("w", ["a", "b"])
    with pytest.raises(OpError, match=r"^param 'w': cannot be read as an array"):
        od.param("w", [[1.0], [1.0, 2.0]])  # ragged
    with pytest.raises(OpError, match=r"^tensor 'w': i32 takes integer values, got float64 values"):
        od.param("w", [1.5, 2.0], "i32")  # not truncated to [1, 2]
    with pytest.raises(OpError, match=r"^tensor 'w': values 0\.\.4294967296 do not fit i32"):
        od.param("w", np.array([0, 2**32]), "i32")  # not wrapped
    with pytest.raises(OpError, match=r"^tensor 'kv': values of shape \(3,\) do not broadcast to \(2, 4\)"):
        od.state("kv", (2, 4), init=np.ones(3))
    with pytest.raises(OpError, match=r"^param 'raw': raw data needs a dtype"):
        od.param("raw", np.zeros(4, np.uint8), shape=(4,))
    assert od.param("w", np.array([1, 2]), "f32").data.view(np.float32).tolist() == [1.0, 2.0]  # ints are numbers


# -- op params ---------------------------------------------------------------------------------
def _sources() -> dict[str, od.Tensor]:
    return {
        "x": od.input("x", (4, 6)), "sq": od.input("sq", (6, 6)), "t": od.input("t", (3,)),
        "x4": od.input("x4", (1, 2, 2, 8)), "pos": od.input("pos", (2,), "i32"),
        "q": od.input("q", (1, 2, 3, 8)), "k": od.input("k", (1, 2, 5, 8)), "v": od.input("v", (1, 2, 5, 8)),
        "g": od.input("g", (2, 4, 3, 3)), "b": od.input("b", (2, 6)), "up": od.input("up", (4, 6)),
    }


#: per op (and glu_split, a second builder of glu): a valid call, as (positional sources, keyword params)
VALID: dict[str, Callable[[dict[str, od.Tensor]], tuple[tuple, dict[str, Any]]]] = {
    "view": lambda s: ((s["x"],), {"shape": (2, 3), "strides": (24, 4), "offset": 4}),
    "reshape": lambda s: ((s["x"],), {"shape": (6, 4)}),
    "permute": lambda s: ((s["x"],), {"axes": (1, 0)}),
    "scale": lambda s: ((s["x"],), {"s": 2.0, "bias": 0.5}),
    "clamp": lambda s: ((s["x"],), {"min": -1.0, "max": 1.0}),
    "leaky_relu": lambda s: ((s["x"],), {"negative_slope": 0.1}),
    "glu": lambda s: ((s["x"],), {"kind": "swiglu_oai", "swapped": True, "alpha": 1.5, "limit": 7.0}),
    "glu_split": lambda s: ((s["x"], s["up"]), {"kind": "geglu", "alpha": 1.5, "limit": 7.0}),
    "norm": lambda s: ((s["x"],), {"eps": 1e-5}),
    "rms_norm": lambda s: ((s["x"],), {"eps": 1e-6}),
    "l2_norm": lambda s: ((s["x"],), {"eps": 1e-12}),
    "group_norm": lambda s: ((s["g"],), {"groups": 2, "eps": 1e-6}),
    "soft_max": lambda s: ((s["x"],), {"scale": 0.5, "max_bias": 0.0}),
    "rope": lambda s: ((s["x4"], s["pos"]), {"n_dims": 8, "mode": "neox", "freq_base": 10000.0, "freq_scale": 0.5,
                                             "ext_factor": 1.0, "attn_factor": 1.0, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "n_ctx_orig": 4096}),
    "flash_attn_ext": lambda s: ((s["q"], s["k"], s["v"]), {"scale": 0.3, "max_bias": 0.0, "softcap": 5.0}),
    "diag_mask_inf": lambda s: ((s["x"],), {"n_past": 1}),
    "cont": lambda s: ((s["x"],), {"shape": (24,)}),
    "set": lambda s: ((s["x"], s["b"]), {"offset": 24, "strides": (24, 4)}),
    "acc": lambda s: ((s["x"], s["b"]), {"offset": 24, "strides": (24, 4)}),
    "concat": lambda s: ((s["x"], s["x"]), {"axis": -1}),
    "repeat": lambda s: ((s["x"],), {"shape": (8, 6)}),
    "pad": lambda s: ((s["x"],), {"pads": ((1, 0), (0, 2))}),
    "pad_reflect_1d": lambda s: ((s["x"],), {"p0": 1, "p1": 2}),
    "roll": lambda s: ((s["x"],), {"shifts": (1, -2)}),
    "arange": lambda s: ((), {"start": 0.0, "stop": 5.0, "step": 1.5}),
    "fill": lambda s: ((s["x"],), {"value": 2.5}),
    "tri": lambda s: ((s["sq"],), {"kind": "lower"}),
    "timestep_embedding": lambda s: ((s["t"],), {"dim": 8, "max_period": 100}),
    "argsort": lambda s: ((s["x"],), {"order": "desc"}),
    "top_k": lambda s: ((s["x"],), {"k": 2}),
    "all_reduce_sum": lambda s: ((s["x"],), {"group": "cpu0,cpu1", "rank": 1}),
}


def _builder(name: str) -> Callable[..., od.Tensor]:
    return ops.glu_split if name == "glu_split" else OPS[name].build


def _params(name: str) -> dict[str, inspect.Parameter]:
    """The builder's parameters that are not tensors."""
    sig = inspect.signature(_builder(name))
    return {p: v for p, v in sig.parameters.items() if "Tensor" not in str(v.annotation)}


def test_every_param_of_every_op_is_in_the_table() -> None:
    with_params = {name for name in OPS if _params(name)} | {"glu_split"}
    assert with_params == set(VALID)
    for name, call in VALID.items():
        assert set(call(_sources())[1]) == set(_params(name)), name


def _junk(p: inspect.Parameter) -> list[Any]:
    """Values no param takes, and those its kind refuses: floats for ints, bools for numbers, NaN."""
    kind = str(p.annotation)
    junk: list[Any] = ["2", [1.5], object(), {"a": 1}]
    if p.default is not None:
        junk.append(None)
    if kind == "int":
        junk += [1.5, 2.0, np.float64(1.0), True, np.True_, 2**64, -2**63 - 1]
    elif kind == "float":
        junk += [True, math.nan, np.float32("nan"), 1j]
    elif kind == "bool":
        junk += [1, 0, "True"]
    elif kind == "str":
        junk += [1, b"lower"]
    elif "Sequence" in kind:
        junk += [(1.5,) * 2, (True, 1), (np.float64(4.0), 4), 3]
    return junk


@pytest.mark.parametrize("name", sorted(VALID))
def test_every_builder_refuses_bad_params_naming_op_and_param(name: str) -> None:
    src = _sources()
    args, good = VALID[name](src)
    _builder(name)(*args, **good)  # the valid call builds
    op_name = "glu" if name == "glu_split" else name
    for param, p in _params(name).items():
        for bad in _junk(p):
            with pytest.raises(OpError) as err:
                _builder(name)(*args, **{**good, param: bad})
            msg = str(err.value)
            assert msg.startswith(f"{op_name}: "), (param, bad, msg)
            assert param in msg, (param, bad, msg)


@pytest.mark.parametrize("build, match", [
    (lambda s: ops.concat(s["x"], s["x"], axis=0.5), r"concat: axis must be an integer, got 0\.5 \(float\)"),
    (lambda s: s["x"].view((2,), (64.5,)), r"view: strides must hold integers, got 64\.5"),
    (lambda s: s["x"].view((2,), (-4,), offset=8), r"view: strides \(-4,\) must be >= 0"),
    (lambda s: s["x"].view((2,), offset=-4), r"view: offset must be >= 0, got -4"),
    (lambda s: s["x"].permute(2, 0), r"permute: axes \(2, 0\) out of range for 2 axes"),  # was 2 % 2 = 0
    (lambda s: s["x"].reshape(-2, -12), r"reshape: negative dimension in shape \(-2, -12\)"),
    (lambda s: ops.rms_norm(s["x"], eps="1e-6"), r"rms_norm: eps must be a real number, got '1e-6' \(str\)"),
    (lambda s: ops.rms_norm(s["x"], eps=math.inf), r"rms_norm: eps must be finite, got inf"),
    (lambda s: ops.rms_norm(s["x"], eps=-1e-6), r"rms_norm: eps must be >= 0\.0, got -1e-06"),
    (lambda s: ops.scale(s["x"], None), r"scale: s must be a real number, got None"),
    (lambda s: ops.soft_max(s["x"], scale=[1.0]), r"soft_max: scale must be a real number, got \[1\.0\] \(list\)"),
    (lambda s: ops.clamp(s["x"], math.nan, 1.0), r"clamp: min must be a number, not NaN, got nan"),
    (lambda s: ops.rope(s["x4"], s["pos"], 8, freq_base=0.0), r"rope: freq_base must be > 0, got 0\.0"),
    (lambda s: ops.rope(s["x4"], s["pos"], 8, ext_factor=1.0, freq_scale=0.0),
     r"rope: freq_scale must be > 0 with YaRN"),
    (lambda s: ops.top_k(s["x"], True), r"top_k: k must be an integer, got True \(bool\)"),
    (lambda s: ops.glu(s["x"], "swiglu", swapped=1), r"glu: swapped must be True or False, got 1 \(int\)"),
    (lambda s: ops.arange(0, 2**200, 1), r"arange: start, stop and step must be finite in float32"),
    (lambda s: ops.fill(s["x"], math.nan), r"fill: value must be a number, not NaN"),
])
def test_param_errors_say_what_is_wrong(build: Callable, match: str) -> None:
    with pytest.raises(OpError, match=match):
        build(_sources())


def test_params_take_what_their_kind_means() -> None:
    s = _sources()
    assert ops.scale(s["x"], 2).params["s"] == 2.0  # an int is a real number
    assert ops.scale(s["x"], np.float32(0.5)).params["s"] == 0.5
    assert ops.top_k(s["x"], np.int64(3)).params["k"] == 3 and type(ops.top_k(s["x"], np.int64(3)).params["k"]) is int
    assert ops.clamp(s["x"], -math.inf, 1.0).params["min"] == -math.inf  # one-sided clamp
    assert ops.fill(s["x"], -math.inf).params["value"] == -math.inf
    assert ops.glu(s["x"], "swiglu_oai", limit=math.inf).params["limit"] == math.inf
    assert ops.glu(s["x"], "reglu", swapped=np.True_).params["swapped"] is True
    assert ops.concat(s["x"], s["x"], np.int32(-2)).params["axis"] == 0


def test_signed_zero_params_do_not_share_a_plan() -> None:
    x = od.input("x", (3,))
    neg, pos = (od.compile(ops.fill(x, v), "cpu") for v in (-0.0, 0.0))  # -0.0 == 0.0, but not the same fill
    assert neg.steps is not pos.steps
    feed = {x: np.ones(3, np.float32)}
    assert np.signbit(neg.run(feed)[0]).all() and not np.signbit(pos.run(feed)[0]).any()


# -- feeds ---------------------------------------------------------------------------------------
def _rows_plan() -> tuple[od.Tensor, od.Tensor, od.Tensor, Any]:
    table = od.input("table", (5, 4))
    idx = od.input("idx", (3,), "i32")
    kv = od.state("kv", (2, 4))
    plan = od.compile([ops.get_rows(table, idx), ops.add(kv, kv)], "cpu")
    return table, idx, kv, plan


@pytest.mark.parametrize("feed, match", [
    ("table", r"input 'table' \(5, 4\) f32: f32 takes float or integer values, got <U5 values"),
    (object(), r"input 'table' \(5, 4\) f32: f32 takes float or integer values, got object values"),
    ([[1.0], [1.0, 2.0]], r"input 'table' \(5, 4\) f32: cannot be read as an array"),
    (np.ones((4, 5), np.float32), r"input 'table' \(5, 4\) f32: got shape \(4, 5\)"),
    (np.ones((5, 4), bool), r"f32 takes float or integer values, got bool values"),
    (np.ones((5, 4), np.complex64), r"f32 takes float or integer values, got complex64 values"),
])
def test_float_feeds_of_the_wrong_kind_or_shape_are_named(feed: Any, match: str) -> None:
    table, idx, kv, plan = _rows_plan()
    with pytest.raises(FeedError, match=match):
        plan.run({table: feed, idx: np.zeros(3, np.int32), kv: np.zeros((2, 4))})


@pytest.mark.parametrize("feed, match", [
    (np.array([0.0, 1.0, 2.0]), r"input 'idx' \(3,\) i32: i32 takes integer values, got float64 values"),
    (np.array([0, 1, 2**31]), r"input 'idx' \(3,\) i32: values 0\.\.2147483648 do not fit i32 "
                              r"\(-2147483648\.\.2147483647\)"),
    (np.array([-2**40, 0, 1]), r"values -1099511627776\.\.1 do not fit i32"),
    (np.array([0, 1, 2], np.uint64) + np.uint64(2**63), r"do not fit i32"),
    ([0, 1, 2.5], r"i32 takes integer values"),
    (np.array([True, False, True]), r"i32 takes integer values, got bool values"),
])
def test_integer_feeds_must_be_integers_that_fit(feed: Any, match: str) -> None:
    table, idx, kv, plan = _rows_plan()
    with pytest.raises(FeedError, match=match):
        plan.run({table: np.zeros((5, 4)), idx: feed, kv: np.zeros((2, 4))})
    got = plan.run({table: np.arange(20).reshape(5, 4), idx: np.array([4, 0, 2], np.int64), kv: np.ones((2, 4))})
    np.testing.assert_array_equal(got[0], np.arange(20).reshape(5, 4)[[4, 0, 2]])  # int64 that fits: fine


def test_float_feeds_of_a_dequantize_only_format_are_refused_by_name() -> None:
    """iq3_xxs has no quantizer: floats written to such an input get a FeedError naming it (the fuzzer's
    case: a NotImplementedError from inside dtypes); its raw blocks are written as they are."""
    from opdispatch.dtypes import dequantize
    from opdispatch.quants.samples import random_blocks

    x, y = od.input("x", (2, 256), "iq3_xxs"), od.input("y", (2, 256), "f32")
    plan = od.compile([ops.cpy(x, y)], "cpu")
    with pytest.raises(FeedError, match=r"^input 'x' \(2, 256\) iq3_xxs: opdispatch only dequantizes iq3_xxs"):
        plan.write(x, np.random.default_rng(0).uniform(-1, 1, (2, 256)))
    raw = random_blocks(np.random.default_rng(1), "iq3_xxs", 2).reshape(2, -1)
    (got,) = plan.run({x: raw, y: np.zeros((2, 256))})
    np.testing.assert_array_equal(got, dequantize("iq3_xxs", raw))


def test_feeds_are_checked_before_any_is_written() -> None:
    table, idx, kv, plan = _rows_plan()
    plan.write(kv, np.full((2, 4), 7.0))
    with pytest.raises(FeedError, match="input 'idx'"):
        plan.run({kv: np.zeros((2, 4)), table: np.zeros((5, 4)), idx: np.array([0.5, 1, 2])})
    np.testing.assert_array_equal(plan.read(kv), np.full((2, 4), 7.0))  # the state fed first kept its bytes
    with pytest.raises(FeedError, match=r"^state 'kv' \(2, 4\) f32: got shape \(4, 2\)"):
        plan.write("kv", np.zeros((4, 2)))
    with pytest.raises(FeedError, match=r"feeds must be a mapping of inputs \(tensors or names\) to values, got list"):
        plan.run([np.zeros((5, 4))])  # type: ignore[arg-type]
    with pytest.raises(FeedError, match=r"feeds are keyed by input tensors or their names, got 3 \(int\)"):
        plan.submit({3: np.zeros((5, 4))})  # type: ignore[dict-item]
    with pytest.raises(PlanKeyError, match=r"'w' \(2,\) f32 is not an input or state of this plan"):
        plan.write(od.input("w", (2,)), np.zeros(2))  # another graph's input
    with pytest.raises(PlanKeyError, match=r"is not a tensor of this plan"):
        plan.read(od.input("w", (2,)))
    plan.submit({table: np.ones((5, 4)), idx: np.array([1, 1, 1], np.int32), kv: np.ones((2, 4))})
    np.testing.assert_array_equal(plan.read(kv), np.ones((2, 4)))  # usable after every refusal


def test_compile_refuses_host_params_that_are_not_tensors() -> None:
    x = od.input("x", (2,))
    with pytest.raises(OpError, match=r"compile: host_params must be tensors \(params\), got \(\[1\],\)"):
        od.compile(ops.neg(x), "cpu", host_params=[[1]])


# -- a cached plan names the caller's graph -----------------------------------------------------
def _gather(tag: str) -> tuple[od.Tensor, od.Tensor, od.Tensor]:
    table, idx = od.input(f"table_{tag}", (4, 2)), od.input(f"idx_{tag}", (2,), "i32")
    return table, idx, ops.neg(ops.get_rows(table, idx))


def test_a_cached_plan_names_the_tensors_of_the_graph_it_was_asked_for() -> None:
    t1, i1, y1 = _gather("first")
    t2, i2, y2 = _gather("second")
    p1, p2 = od.compile(y1, "cpu"), od.compile(y2, "cpu")
    assert p2.steps is p1.steps  # one plan, shared
    with pytest.raises(PlanKeyError, match=r"no value for input 'table_second' \(4, 2\) f32, 'idx_second'"):
        p2.run({})
    with pytest.raises(FeedError, match=r"^input 'idx_second' \(2,\) i32: i32 takes integer values"):
        p2.run({t2: np.zeros((4, 2)), i2: np.zeros(2)})
    table = np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(p2.run({"table_second": table, "idx_second": np.array([3, 1])})[0], -table[[3, 1]])
    with pytest.raises(PlanKeyError, match='no input or state is named "idx_first"'):
        p2.run({"table_second": table, "idx_first": np.array([3, 1])})  # the first graph's names are not this one's
    with pytest.raises(LaunchError) as err:
        p2.run({t2: table, i2: np.array([0, 9])})  # a row index past the table: the reference raises
    msg = str(err.value)
    assert "row index 9" in msg and f"'{y2.srcs[0].name}'" in msg and "'table_second'" in msg, msg
    assert "first" not in msg and f"'{y1.srcs[0].name}'" not in msg, msg
    assert f"'{y2.name}'" in p2.explain() and f"'{y1.name}'" not in p2.explain()
    with pytest.raises(LaunchError, match="'table_first'"):
        p1.run({t1: table, i1: np.array([0, 9])})  # the first graph's plan keeps its own names
    np.testing.assert_array_equal(p1.run({t1: table, i1: np.array([2, 0])})[0], -table[[2, 0]])  # still usable


def test_renaming_is_one_pass_when_the_graphs_trade_names() -> None:
    def build(table: str, idx: str) -> tuple[od.Tensor, od.Tensor, od.Tensor]:
        t, i = od.input(table, (4, 2)), od.input(idx, (2,), "i32")
        return t, i, ops.get_rows(t, i)

    *_, y1 = build("p", "q")
    t2, i2, y2 = build("q", "r")  # the second graph's table is named as the first's idx
    od.compile(y1, "cpu")
    plan = od.compile(y2, "cpu")
    with pytest.raises(PlanKeyError, match=r"no value for input 'q' \(4, 2\) f32, 'r' \(2,\) i32"):
        plan.run({})
    with pytest.raises(FeedError, match=r"^input 'r' \(2,\) i32: got shape \(3,\)"):
        plan.run({"q": np.zeros((4, 2)), "r": np.zeros(3, np.int32)})


# -- memory ----------------------------------------------------------------------------------------
def test_a_graph_of_terabytes_raises_out_of_memory_naming_a_tensor_without_allocating(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    real = HostBackend.alloc
    monkeypatch.setattr(HostBackend, "alloc", lambda self, n, what: asked.append(n) or real(self, n, what))
    x = od.input("x", (1,))
    big = ops.repeat(x, (2**20, 2**20))  # 4 TiB of f32
    plan = od.compile(ops.sum_rows(big), "cpu")
    start = time.monotonic()
    with pytest.raises(OutOfMemory) as err:
        plan.run({x: np.ones(1, np.float32)})
    assert time.monotonic() - start < 2.0
    msg = str(err.value)
    assert isinstance(err.value, MemoryError) and isinstance(err.value, OpdispatchError)
    assert msg.startswith("host: the plan needs ") and " bytes (" in msg and " are free" in msg, msg
    assert f"its largest slot {big.describe()}" in msg, msg
    assert asked == [], "allocated before refusing"
    kv = od.state("kv", (2**20, 2**20))
    with pytest.raises(OutOfMemory, match=r"'kv' \(1048576, 1048576\) f32: 4398046511104 bytes \(4096\.00 GiB\)"):
        od.compile(ops.scale(kv, 2.0), "cpu").launch()
    assert asked == []
    with pytest.raises(OutOfMemory, match=r"^cpu: cannot allocate 1000000000000000 bytes \(931322\.57 GiB\) for "
                                          r"a buffer far too large: \d+ bytes \(.*\) of host memory free"):
        real(HostBackend(od.manager().cpu()), 10**15, "a buffer far too large")
    a = od.input("a", (3,))  # the backend, and the process, carry on
    np.testing.assert_array_equal(od.compile(ops.neg(a), "cpu").run({a: np.arange(3.0)})[0], -np.arange(3.0))


class FakeBackend(HostBackend):
    """A device backend that reports `free` bytes and records what it allocates."""

    free = 0
    asked: list[tuple[int, str]] = []

    def free_memory(self) -> tuple[str, int | None]:
        return self.device.name, type(self).free

    def alloc(self, nbytes: int, what: str) -> Any:
        type(self).asked.append((nbytes, what))
        return super().alloc(nbytes, what)


def test_a_device_without_room_refuses_the_plan_before_allocating_and_stays_usable() -> None:
    fake = Device("fake0", "toy", "a device of 32 KiB", backend_factory=FakeBackend)
    mgr = manager_with(ToyPlugin(device=fake))
    a, b = od.input("a", (64, 64)), od.input("b", (64, 64))
    y = ops.mul(ops.add(a, b), b)
    plan = od.compile(y, fake, plugins=mgr, fusion=False)
    FakeBackend.free, FakeBackend.asked = 32 << 10, []  # a and b alone take 32 KiB
    feeds = {a: np.ones((64, 64)), b: np.full((64, 64), 2.0)}
    with pytest.raises(OutOfMemory) as err:
        plan.run(feeds)
    msg = str(err.value)
    assert msg.startswith("fake0: the plan needs ") and "fake0 memory and 32768 bytes (0.00 GiB) are free" in msg, msg
    assert "the arena of fake0, its largest slot" in msg and "'a' (64, 64) f32: 16384 bytes" in msg, msg
    assert FakeBackend.asked == []
    FakeBackend.free = 1 << 30  # room now: the same plan binds and runs
    np.testing.assert_array_equal(plan.run(feeds)[0], np.full((64, 64), 6.0))
    assert FakeBackend.asked
