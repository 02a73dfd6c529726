"""Index safety on the device: no kernel dereferences an index outside its range; the first bad one is
recorded in the plan's error word and raised as DeviceIndexError where the plan synchronizes (`run`,
`read`, `check`), naming the op, the node, the index tensor, the value, its position and the range;
the plan stays usable.

Without a GPU: a set word (a fake one, in host memory) decoded into the named error, cleared after,
the plan usable; which kernels take the check; the switch OPDISPATCH_CHECK_INDICES=0. On a GPU
(`gpu`): every index-taking op with an index past its range, a negative one and 2**63 - 1 where the
ids are i64, on the first run (direct launches) and on a CUDA-graph replay, each followed by good runs
that match the reference; a KV cache whose every other byte, and every other buffer of the plan,
is unchanged by a bad write; a bad index of a `submit` raised by `check`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.args import NAN_ROW, NOT_WRITTEN, UNCHECKED, IndexCheck
from opdispatch.backends.cuda.backend import CudaContext
from opdispatch.backends.cuda.devices import H200
from opdispatch.backends.cuda.kernels import KernelSpec, kernel_params
from opdispatch.backends.cuda.scratch import ScratchPool
from opdispatch.errors import DeviceIndexError, OpdispatchError
from opdispatch.errorword import ErrorWord, IndexTable, IndexUse
from opdispatch.graph import Graph
from opdispatch.tensor import Tensor
from opdispatch.testing.cases import Inputs, bound
from opdispatch.testing.metrics import nmse
from helpers import moe
from test_cuda_attention import attn_step, k_cache_write, qkv_step

gpu = pytest.mark.gpu
I64_MAX = 2**63 - 1


def fake_word(address: int = 0xE000_0000) -> ErrorWord:
    return ErrorWord(np.zeros(4, np.uint64), address, None)


def set_word(word: ErrorWord, tag: int, position: int, value: int) -> None:
    """What od::index_ok stores for a bad index."""
    word.host[:] = [tag + 1, position, value % 2**64, 0]


def message(call: Callable[[], Any], *parts: str) -> str:
    """The DeviceIndexError `call` raises; each of `parts` is in its message."""
    with pytest.raises(DeviceIndexError) as info:
        call()
    text = str(info.value)
    for part in parts:
        assert part in text, f"{part!r} not in: {text}"
    return text


# ==================================================================================================
# The error word and the table, without a GPU


@pytest.mark.parametrize("value", [16, -3, I64_MAX])
def test_a_set_word_raises_the_named_error_once(value: int) -> None:
    table = od.input("emb", (16, 8))
    ids = od.input("ids", (2, 3), "i32")
    node = ops.get_rows(table, ids.reshape(6))
    checks = IndexTable()
    word = checks.word("cuda0", fake_word)
    assert checks.word("cuda0", fake_word) is word  # one word a device
    checks.register(IndexUse(node, ids, 99, "something else", NOT_WRITTEN))
    tag = checks.register(IndexUse(node, ids, 16, f"a row of {table.describe()}", NAN_ROW))
    checks.check()  # a clear word: nothing to raise
    set_word(word, tag, 4, value)
    text = message(checks.check, f"get_rows {node.describe()} on cuda0", f"index {value} at 'ids'[1, 1]",
                   ids.describe(), "outside [0, 16)", "a row of 'emb'", NAN_ROW, "the plan stays usable")
    assert "something else" not in text and "[0, 99)" not in text  # the other use's words (not its tag's)
    assert not word.host.any()  # cleared
    checks.check()
    assert issubclass(DeviceIndexError, IndexError) and issubclass(DeviceIndexError, OpdispatchError)


def test_check_reads_the_words_of_the_devices_asked() -> None:
    node = ops.set_rows(od.state("kv", (8, 4)), od.input("s", (2, 4)), idx := od.input("r", (2,), "i64"))
    checks = IndexTable()
    w0, w1 = checks.word("cuda0", fake_word), checks.word("cuda1", fake_word)
    tag = checks.register(IndexUse(node, idx, 8, "a row of 'kv'", NOT_WRITTEN))
    set_word(w1, tag, 1, 8)
    checks.check("cuda0")  # cuda1 may still be running: its word is not read
    assert w1.host[0] == tag + 1 and not w0.host.any()
    message(checks.check, "on cuda1", "index 8 at 'r'[1]", NOT_WRITTEN)


def test_a_plan_raises_at_run_read_and_check_and_stays_usable() -> None:
    """A word the plan's table holds (here a fake one on the host device) is read where the plan
    synchronizes: the error is raised once, then the same plan runs on."""
    x = od.input("x", (4,))
    y = ops.scale(x, 2.0)
    plan = od.compile(y, "cpu")
    feeds = {x: np.arange(4, dtype=np.float32)}
    plan.run(feeds)
    checks = plan._bind().checks
    word = checks.word("cpu", fake_word)
    tag = checks.register(IndexUse(y, x, 4, "a row of 'x'", NOT_WRITTEN))
    for raising in (lambda: plan.run(feeds), plan.check, lambda: plan.read(y)):
        set_word(word, tag, 2, -1)
        plan.submit(feeds)  # a submit does not wait, so it does not check
        message(raising, "index -1 at 'x'[2]")
        assert not word.host.any()
        np.testing.assert_array_equal(plan.run(feeds)[0], 2 * feeds[x])
        plan.check()
    twin = od.compile(ops.scale(od.input("x", (4,)), 2.0), "cpu")  # a cached plan shares the table
    set_word(word, tag, 0, 9)
    message(twin.check, "index 9 at 'x'[0]")


class _Backend:
    """What CudaContext.index_check asks of a backend."""

    def __init__(self) -> None:
        self.made = 0

    def error_word(self) -> ErrorWord:
        self.made += 1
        return fake_word(0xE000_0000 + 0x100 * self.made)


def test_index_check_registers_the_use_or_passes_a_null_word(monkeypatch: pytest.MonkeyPatch) -> None:
    node = ops.get_rows(od.input("t", (16, 8)), ids := od.input("i", (3,), "i32"))
    backend = _Backend()
    ctx = CudaContext(H200, backend, lambda t: None, IndexTable())  # type: ignore[arg-type]
    assert ctx.index_check(node, ids, 16, "a row", NAN_ROW) == IndexCheck(0xE000_0100, 0)
    assert ctx.index_check(node, ids, 16, "a row", NAN_ROW) == IndexCheck(0xE000_0100, 1)  # the same word
    assert backend.made == 1 and ctx.checks.uses == [IndexUse(node, ids, 16, "a row", NAN_ROW)] * 2
    monkeypatch.setenv("OPDISPATCH_CHECK_INDICES", "0")
    ctx = CudaContext(H200, backend, lambda t: None, IndexTable())  # type: ignore[arg-type]
    assert ctx.index_check(node, ids, 16, "a row", NAN_ROW) == UNCHECKED
    assert ctx.checks.uses == [] and ctx.checks.words == {} and backend.made == 1


class _Buffer:
    def __init__(self, ptr: int, nbytes: int = 1 << 20) -> None:
        self.ptr, self.nbytes = ptr, nbytes


class _BindBackend(_Backend):
    """What the CUDA plugins' binds ask of a backend, without a GPU: scratch buffers at made-up addresses."""

    def __init__(self) -> None:
        super().__init__()
        self.cuda_device = contextlib.nullcontext()
        self.stream = None
        self.scratch = ScratchPool(lambda n, what: _Buffer(0x7D00_0000_0000, n), lambda buf, byte: None)


def _bind_all(outputs: list[Tensor], monkeypatch: pytest.MonkeyPatch) -> tuple[od.Plan, IndexTable]:
    """Every launch of `outputs`' plan on the H200 description bound as on cuda0 (the launches themselves
    stubbed), into one table of index uses."""
    monkeypatch.setattr(KernelSpec, "launch", lambda self, stream: lambda: None)
    plan = od.compile(outputs, H200)
    checks, backend = IndexTable(), _BindBackend()
    where = lambda t: (_Buffer(0x7F00_0000_0000 + (t.base.uid % 997) * 2**24), t.view_offset)  # noqa: E731
    for s in plan.steps:
        if s.kind in ("kernel", "fused"):
            assert s.device.kind == "cuda", plan.explain()
            ctx = CudaContext(H200, backend, where, checks)  # type: ignore[arg-type]
            s.bind(ctx, s.nodes[0] if s.kind == "kernel" else s.nodes)
    return plan, checks


#: per index-taking op: the index operand and the range of its values
INDEX_OPS = {"get_rows": (1, lambda n: n.srcs[0].shape[-2]), "set_rows": (2, lambda n: n.srcs[0].shape[-2]),
             "add_id": (2, lambda n: n.srcs[1].shape[0]), "mul_mat_id": (2, lambda n: n.srcs[0].shape[0])}


@pytest.mark.parametrize("case", ["get_rows", "set_rows", "add_id", "mul_mat_id", "moe", "greedy_pick",
                                  "rope_set_rows", "rope_qkv_set_rows", "rope_qkv_flash_attn_ext"])
def test_every_index_a_bind_reads_is_registered(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The binds of every index-taking op, alone and in each fusion that takes one in, register each index
    tensor they read with its range (what the error names), on the plan's one word."""
    rng = np.random.default_rng(0)
    if case == "get_rows":
        outputs = [ops.get_rows(od.input(f"t{dt}", (16, 64), dt), od.input(f"i{dt}", (5,), "i32"))
                   for dt in ("f32", "f16", "i32", "q8_0")]
    elif case == "set_rows":
        outputs = [ops.set_rows(od.state(f"c{dt}{it}", (16, 64), dt), od.input(f"s{dt}{it}", (3, 64)),
                                od.input(f"r{dt}{it}", (3,), it))
                   for dt in ("f32", "f16", "q8_0") for it in ("i32", "i64")]
    elif case == "add_id":
        outputs = [ops.add_id(od.input("a", (2, 3, 32)), od.input("b", (4, 32)), od.input("ids", (2, 3), "i32"))]
    elif case == "mul_mat_id":
        outputs = [_mul_mat_id_case(kind, n, rng)[0] for kind in ("f16", "q4_0 mmvq_id", "q4_0 stream") for n in (1, 4)]
    elif case == "moe":
        outputs = [moe("q4_0", 8, 40, 256, n, 3, glu, True) for n in (1, 4) for glu in (False, True)]
    elif case == "greedy_pick":
        outputs = list(_greedy_tail("i64")[:2])
    else:
        outputs = _fused_cache_case(case, "i64", rng)[0]
    plan, checks = _bind_all(outputs, monkeypatch)
    if case.startswith(("greedy", "rope")):
        assert case in [s.kernel for s in plan.fusions], plan.explain()
    graph = Graph.build(outputs)
    index_nodes = [n for n in graph.nodes if n.op in INDEX_OPS]
    assert index_nodes
    registered = {(id(u.index), u.bound) for u in checks.uses}
    for n in index_nodes:
        operand, bound = INDEX_OPS[n.op]
        assert (id(n.srcs[operand]), bound(n)) in registered, (n.describe(), plan.explain())
    assert list(checks.words) == ["cuda0"]
    if case in ("get_rows", "set_rows"):
        assert len(checks.uses) == len(index_nodes)  # one a launch
        for u in checks.uses:
            assert u.node in index_nodes and u.instead == (NOT_WRITTEN if u.node.op == "set_rows" else
                                                           "its output row is filled with 0" if u.node.dtype.is_int
                                                           else NAN_ROW)


#: the kernels that read indices from data, each taking OD_INDEX_CHECK_PARAMS last
CHECKED = {"get_rows", "get_rows_q", "set_rows", "set_rows_q", "add_id", "argmax_split", "mmv_id", "mmvq_id",
           "moe_route", "mmvq_stream", "rope_set_rows", "rope_qkv_set_rows", "fattn_decode"}


def test_the_index_reading_kernels_take_the_check_last() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "plugins"
    taking = {name for cu in root.glob("*/kernels/*.cu") for name, params in kernel_params(cu.resolve()).items()
              if "err_word" in params}
    assert taking == CHECKED
    for cu in root.glob("*/kernels/*.cu"):
        for name, params in kernel_params(cu.resolve()).items():
            if name in CHECKED:
                assert params[-2:] == ("err_word", "err_tag"), (cu.name, name)


# ==================================================================================================
# On the GPU


def bad_then_good(plan: od.Plan, bad: dict, good: dict, parts: tuple[str, ...], check_good: Callable[[list], None],
                  after_bad: Callable[[Any], None] = lambda before: None,
                  snapshot: Callable[[], Any] = lambda: None) -> None:
    """A bad run raises the named error (`parts` in its message) and leaves what `after_bad(snapshot taken
    before it)` checks; two good runs pass `check_good`. Twice: the first bad run binds and launches
    directly, the second is a CUDA-graph replay (the good runs between captured the graph)."""
    for _ in range(2):
        before = snapshot()
        message(lambda: plan.run(bad), *parts, "the plan stays usable")
        after_bad(before)
        for _ in range(2):
            check_good(plan.run(good))


def taken(plan: od.Plan, op: str, plugin: str, kernel: str | None = None) -> None:
    """The steps computing an `op` node run on the GPU by `plugin` (one of them as `kernel`)."""
    steps = [s for s in plan.steps if s.kind in ("kernel", "fused") and any(n.op == op for n in s.nodes)]
    assert steps and all(s.plugin == plugin and s.device.kind == "cuda" for s in steps), plan.explain()
    if kernel is not None:
        assert kernel in [s.kernel for s in steps], plan.explain()


def rows_equal(got: np.ndarray, want: np.ndarray, rows: list[int] | np.ndarray) -> None:
    np.testing.assert_array_equal(np.asarray(got)[rows], np.asarray(want)[rows])


@gpu
@pytest.mark.parametrize("bad", [16, -1, -2**31])
@pytest.mark.parametrize("dt", ["f32", "f16", "q8_0"])
def test_get_rows_bad_row_id(dt: str, bad: int, rng) -> None:  # noqa: ANN001
    table, ids = od.input("table", (16, 64), dt), od.input("ids", (5,), "i32")
    y = ops.get_rows(table, ids)
    plan = od.compile(y, "cuda0")
    taken(plan, "get_rows", "cuda_misc")
    good = {table: rng.uniform(-1, 1, (16, 64)).astype(np.float32), ids: np.array([3, 0, 15, 7, 3], np.int32)}
    bad_feeds = {**good, ids: np.array([3, 0, bad, 7, 3], np.int32)}
    (ref,) = od.compile(y, "cpu").run(good)

    def after_bad(_: Any) -> None:
        out = plan.read(y)
        assert np.isnan(out[2]).all()
        rows_equal(out, ref, [0, 1, 3, 4])

    bad_then_good(plan, bad_feeds, good, (f"get_rows {y.describe()}", f"index {bad} at 'ids'[2]", "outside [0, 16)",
                                          NAN_ROW), lambda out: np.testing.assert_array_equal(out[0], ref), after_bad)


@gpu
@pytest.mark.parametrize(("idx_dt", "bad"), [("i64", 16), ("i64", -1), ("i64", I64_MAX), ("i32", 16),
                                             ("i32", -2**31)])
@pytest.mark.parametrize("dt", ["f32", "f16", "q8_0"])
def test_set_rows_bad_row_id_writes_nothing_for_it(dt: str, idx_dt: str, bad: int, rng) -> None:  # noqa: ANN001
    cache = od.state("cache", (16, 64), dt, init=rng.uniform(-1, 1, (16, 64)))
    src, idx = od.input("src", (3, 64)), od.input("idx", (3,), idx_dt)
    y = ops.set_rows(cache, src, idx)
    plan = od.compile(y, "cuda0")
    taken(plan, "set_rows", "cuda_misc")
    itype = np.int64 if idx_dt == "i64" else np.int32
    good = {src: rng.uniform(-1, 1, (3, 64)).astype(np.float32), idx: np.array([2, 9, 13], itype)}
    bad_feeds = {**good, idx: np.array([2, bad, 13], itype)}
    (ref,) = od.compile(y, "cpu").run(good)
    untouched = [r for r in range(16) if r not in (2, 13)]

    def after_bad(before: np.ndarray) -> None:
        after = plan.read(cache)
        rows_equal(after, before, untouched)  # row 9 too: the bad row's write was dropped, nothing else moved
        rows_equal(after, ref, [2, 13])

    bad_then_good(plan, bad_feeds, good, (f"set_rows {y.describe()}", f"index {bad} at 'idx'[1]", "outside [0, 16)",
                                          f"a row of {cache.describe()}", NOT_WRITTEN),
                  lambda out: np.testing.assert_array_equal(out[0], ref), after_bad, lambda: plan.read(cache))


@gpu
@pytest.mark.parametrize("bad", [4, -1])
def test_add_id_bad_bias_row(bad: int, rng) -> None:  # noqa: ANN001
    a, b, ids = od.input("a", (2, 3, 32)), od.input("b", (4, 32)), od.input("ids", (2, 3), "i32")
    y = ops.add_id(a, b, ids)
    plan = od.compile(y, "cuda0")
    taken(plan, "add_id", "cuda_misc")
    good = {a: rng.uniform(-1, 1, (2, 3, 32)).astype(np.float32), b: rng.uniform(-1, 1, (4, 32)).astype(np.float32),
            ids: np.array([[0, 3, 1], [2, 2, 0]], np.int32)}
    bad_ids = good[ids].copy()
    bad_ids[1, 2] = bad
    (ref,) = od.compile(y, "cpu").run(good)

    def after_bad(_: Any) -> None:
        out = plan.read(y)
        assert np.isnan(out[1, 2]).all()
        rows_equal(out.reshape(6, 32), ref.reshape(6, 32), [0, 1, 2, 3, 4])

    bad_then_good(plan, {**good, ids: bad_ids}, good, ("add_id", f"index {bad} at 'ids'[1, 2]", "outside [0, 4)",
                                                       NAN_ROW),
                  lambda out: np.testing.assert_array_equal(out[0], ref), after_bad)


def _mul_mat_id_case(kind: str, n_tok: int, rng: np.random.Generator) -> tuple[Tensor, Tensor, dict]:
    """A mul_mat_id graph (alone, or fused with add_id biases and a GLU: helpers.moe), its ids and good feeds."""
    if kind == "fused":
        y = moe("q4_0", 8, 40, 256, n_tok, 3, True, True)
    else:
        dt, k = {"f16": ("f16", 64), "q4_0 mmvq_id": ("q4_0", 96), "q4_0 stream": ("q4_0", 256)}[kind]
        y = ops.mul_mat_id(od.input("experts", (8, 40, k), dt), od.input("b", (n_tok, 1, k)),
                           od.input("ids", (n_tok, 3), "i32"))
    graph = Graph.build(y)
    ids = next(t for t in graph.inputs if t.dtype.is_int)
    feeds = {t: rng.integers(0, 8, t.shape).astype(np.int32) if t is ids
             else rng.uniform(-1, 1, t.shape).astype(np.float32) for t in graph.inputs}
    return y, ids, feeds


@gpu
@pytest.mark.parametrize("bad", [8, -1])
@pytest.mark.parametrize("n_tok", [1, 4])  # one (token, slot) a block; several tokens: moe_route's table
@pytest.mark.parametrize("kind", ["f16", "q4_0 mmvq_id", "q4_0 stream", "fused"])
def test_mul_mat_id_bad_expert(kind: str, n_tok: int, bad: int, rng) -> None:  # noqa: ANN001
    y, ids, good = _mul_mat_id_case(kind, n_tok, rng)
    plan = od.compile(y, "cuda0")
    taken(plan, "mul_mat_id", "cuda_matmul")
    bad_ids = good[ids].copy()
    bad_ids[n_tok - 1, 1] = bad
    (ref,) = od.compile(y, "cpu").run(good)
    mm = next(n for n in Graph.build(y).nodes if n.op == "mul_mat_id")
    slots = [(t, u) for t in range(n_tok) for u in range(3) if (t, u) != (n_tok - 1, 1)]

    def after_bad(_: Any) -> None:
        out = plan.read(y)
        assert np.isnan(out[n_tok - 1, 1]).all()
        keep = np.array([out[t, u] for t, u in slots]), np.array([ref[t, u] for t, u in slots])
        assert nmse(*keep) <= 5e-4

    def check_good(out: list) -> None:
        assert np.isfinite(out[0]).all() and nmse(out[0], ref) <= 5e-4, nmse(out[0], ref)

    bad_then_good(plan, {**good, ids: bad_ids}, good,
                  (f"mul_mat_id {mm.describe()}", f"index {bad} at 'ids'[{n_tok - 1}, 1]", "outside [0, 8)", NAN_ROW),
                  check_good, after_bad)


def _greedy_tail(idx_dt: str, b: int = 3, vocab: int = 32000, log_rows: int = 40
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The end of LlamaModel.build(greedy=True)'s step (cuda_misc's greedy_pick fusion): argmax of the
    logits -> cpy into an i32 state -> cpy into a view of an f32 state (rows 1..b) -> set_rows of that into
    a log at kv_idx. (the i32 copy, the set_rows, the logits, kv_idx)"""
    logits, kv_idx = od.input("logits", (b, vocab)), od.input("kv_idx", (b,), idx_dt)
    picked = ops.argmax(logits)
    nf = od.state("next_f32", (b + 1, 1), "f32")
    as_f32 = ops.cpy(picked, nf.view((b, 1), (4, 4), 4))
    tokens = ops.cpy(picked, od.state("next", (b,), "i32"))
    return tokens, ops.set_rows(od.state("log", (log_rows, 1), "f32"), as_f32, kv_idx), logits, kv_idx


@gpu
@pytest.mark.parametrize(("idx_dt", "bad"), [("i64", 40), ("i64", -1), ("i64", I64_MAX), ("i32", 40)])
def test_greedy_pick_bad_log_row(idx_dt: str, bad: int, rng) -> None:  # noqa: ANN001
    tokens, log, logits, kv_idx = _greedy_tail(idx_dt)
    plan = od.compile([tokens, log], "cuda0")
    taken(plan, "argmax", "cuda_misc", "greedy_pick")
    itype = np.int64 if idx_dt == "i64" else np.int32
    good = {logits: rng.uniform(-1, 1, logits.shape).astype(np.float32), kv_idx: np.array([5, 17, 39], itype)}
    bad_feeds = {**good, kv_idx: np.array([5, bad, 39], itype)}
    ref = od.compile([tokens, log], "cpu").run(good)
    log_state = log.srcs[0]

    def after_bad(before: np.ndarray) -> None:
        np.testing.assert_array_equal(plan.read(tokens), ref[0])  # the argmax is written all the same
        after = plan.read(log_state)
        rows_equal(after, before, [r for r in range(40) if r not in (5, 39)])
        rows_equal(after, ref[1], [5, 39])

    def check_good(out: list) -> None:
        for got, want in zip(out, ref):
            np.testing.assert_array_equal(got, want)

    expected = (f"set_rows {log.describe()}", f"index {bad} at 'kv_idx'[1]", "outside [0, 40)", NOT_WRITTEN)
    bad_then_good(plan, bad_feeds, good, expected, check_good, after_bad, lambda: plan.read(log_state))


def _fused_cache_case(kind: str, idx_dt: str, rng: np.random.Generator) -> tuple[list[Tensor], dict, str]:
    """The graphs cuda_attention fuses with their cache writes (test_cuda_attention's), their feeds and the
    fusion expected."""
    inp = Inputs(rng)
    if kind == "rope_set_rows":
        out = k_cache_write("f16", idx_dt, n_tok=5, rows=32)
        graph = Graph.build(out)
        for t in graph.inputs:
            inp.feeds[t] = (rng.permutation(32)[:5] if t.dtype.is_int and t.name == "idx"
                            else rng.integers(0, 512, t.shape) if t.dtype.is_int
                            else rng.uniform(-1, 1, t.shape)).astype(t.dtype.numpy)
        return [out], inp.feeds, "rope_set_rows"
    if kind == "rope_qkv_set_rows":
        return qkv_step(inp, "f16", idx_dt, "neox", rows=3, ctx=64), inp.feeds, "rope_qkv_set_rows"
    return attn_step(inp, "f16", idx_dt, "neox", seqs=3, d=64, ctx=320), inp.feeds, "rope_qkv_flash_attn_ext"


@gpu
@pytest.mark.parametrize(("idx_dt", "bad"), [("i64", "rows"), ("i64", -1), ("i64", I64_MAX), ("i32", "rows")])
@pytest.mark.parametrize("kind", ["rope_set_rows", "rope_qkv_set_rows", "rope_qkv_flash_attn_ext"])
def test_fused_cache_writes_bad_row_id(kind: str, idx_dt: str, bad: int | str, rng) -> None:  # noqa: ANN001
    outputs, good, fused = _fused_cache_case(kind, idx_dt, rng)
    plan = od.compile(outputs, "cuda0")
    taken(plan, "set_rows", "cuda_attention", fused)
    writes = [n for n in Graph.build(outputs).nodes if n.op == "set_rows"]
    caches = [w.srcs[0] for w in writes]
    idx = writes[0].srcs[2]
    rows = min(c.shape[0] for c in caches)
    bad = rows if bad == "rows" else bad
    bad_idx = good[idx].copy()
    bad_idx[1] = bad
    written = [int(r) for r in good[idx]]
    refs = od.compile(outputs, "cpu").run(good)  # both plans' caches start from their initial rows

    def snapshot() -> list[np.ndarray]:
        return [plan.read(c) for c in caches]

    def after_bad(before: list[np.ndarray]) -> None:
        for c, b in zip(caches, before):
            after = plan.read(c)
            good_rows = {r for i, r in enumerate(written) if i != 1}  # every id but the bad one writes
            rows_equal(after, b, [r for r in range(c.shape[0]) if r not in good_rows])

    def check_good(out: list) -> None:
        for got, want in zip(out, refs):
            got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
            assert nmse(got, want) <= max(bound("set_rows", "f16"), bound("flash_attn_ext")), nmse(got, want)

    bad_then_good(plan, {**good, idx: bad_idx}, good,
                  (f"set_rows {writes[0].describe()}", f"index {bad} at '{idx.name}'[1]", f"outside [0, {rows})",
                   NOT_WRITTEN), check_good, after_bad, snapshot)


@gpu
@pytest.mark.parametrize("bad", [64, -1, 3 * 64, I64_MAX])
@pytest.mark.parametrize("dt", ["f16", "q8_0"])
def test_a_bad_kv_cache_write_changes_no_other_byte(dt: str, bad: int, rng) -> None:  # noqa: ANN001
    """The KV cache is rows [R, 2R) of a state of 3R rows, so a write one row past either end would land in
    the rows around it; every byte of every buffer of the plan but the rows the good ids write (the
    cache's other rows, the rows around it, the V cache, another state, the weights, the inputs) is
    read back unchanged after a run with a bad row id."""
    r, c = 64, 128
    store = od.state("kv_store", (3 * r, c), dt, init=rng.uniform(-1, 1, (3 * r, c)))
    k_cache = store.view((r, c), store.strides, r * store.strides[0])
    v_cache = od.state("v_cache", (r, c), dt, init=rng.uniform(-1, 1, (r, c)))
    other = od.state("other", (8, c), "f32", init=rng.uniform(-1, 1, (8, c)))
    w = od.param("w", rng.uniform(-1, 1, (c, c)), "f16")
    x, idx, pick = od.input("x", (3, c)), od.input("idx", (3,), "i64"), od.input("pick", (2,), "i32")
    outputs = [ops.set_rows(k_cache, ops.mul_mat(w, x), idx), ops.set_rows(v_cache, x, idx),
               ops.get_rows(other, pick)]
    plan = od.compile(outputs, "cuda0")
    good = {x: rng.uniform(-1, 1, (3, c)).astype(np.float32), idx: np.array([0, 31, r - 1], np.int64),
            pick: np.array([7, 0], np.int32)}
    plan.run(good)
    leafs = Graph.build(outputs).leafs
    before = {t: plan.read(t) for t in leafs}
    bad_idx = np.array([0, bad, r - 1], np.int64)
    message(lambda: plan.run({**good, idx: bad_idx}), f"index {bad} at 'idx'[1]", f"outside [0, {r})", NOT_WRITTEN,
            "the plan stays usable")
    for t in leafs:
        after = plan.read(t)
        if t is idx:
            np.testing.assert_array_equal(after, bad_idx)
        else:  # rows 0 and r - 1 are rewritten with the values they already hold: every byte as before
            np.testing.assert_array_equal(after, before[t], err_msg=t.describe())
    plan.run(good)
    for t in leafs:
        np.testing.assert_array_equal(plan.read(t), before[t], err_msg=t.describe())


@gpu
def test_a_bad_index_of_a_submit_is_raised_by_check_or_read(rng) -> None:  # noqa: ANN001
    cache = od.state("cache", (16, 64), "f16")
    src, idx = od.input("src", (2, 64)), od.input("idx", (2,), "i64")
    y = ops.set_rows(cache, src, idx)
    plan = od.compile(y, "cuda0")
    good = {src: rng.uniform(-1, 1, (2, 64)).astype(np.float32), idx: np.array([1, 2], np.int64)}
    bad = {**good, idx: np.array([1, 16], np.int64)}
    plan.run(good)
    plan.submit(bad)
    plan.submit(good)  # the error of the submit before is kept for the check
    message(plan.check, "index 16 at 'idx'[1]")
    plan.check()
    plan.submit(bad)
    message(lambda: plan.read(cache), "index 16 at 'idx'[1]")
    plan.read(cache)
    (ref,) = od.compile(y, "cpu").run(good)
    np.testing.assert_array_equal(plan.run(good)[0], ref)


@gpu
def test_checking_off_passes_null_words(monkeypatch: pytest.MonkeyPatch, rng) -> None:  # noqa: ANN001
    """OPDISPATCH_CHECK_INDICES=0: no word, nothing registered, the same results for good indices."""
    monkeypatch.setenv("OPDISPATCH_CHECK_INDICES", "0")
    y, ids, good = _mul_mat_id_case("q4_0 stream", 1, rng)
    rows = ops.get_rows(od.input("t", (16, 64)), od.input("i", (3,), "i32"))
    outputs = [y, rows]
    feeds = {**good, rows.srcs[0]: rng.uniform(-1, 1, (16, 64)).astype(np.float32),
             rows.srcs[1]: np.array([1, 15, 0], np.int32)}
    plan = od.compile(outputs, "cuda0")
    got = plan.run(feeds)
    assert plan._bind().checks.uses == [] and plan._bind().checks.words == {}
    ref = od.compile(outputs, "cpu").run(feeds)
    assert nmse(got[0], ref[0]) <= 5e-4
    np.testing.assert_array_equal(got[1], ref[1])
