"""cuda_misc's get_rows and set_rows kernels run on the CPU: rows.cu's real source compiled by g++ against
the host emulation of CUDA (tests/cuda_emu/shim.h, as test_mmvq_stream_emulated runs mmvq_stream), on
the launch specs the plugin binds, with an error word in the emulated memory.

The grid I-quants (quant_iq.cuh) run the decoding kernels too: get_rows, the dequantizing copies and the
same-type strided copy, bit-exact with opdispatch.dtypes.dequantize on random valid blocks.

A row id outside its range is never dereferenced: get_rows gives that output row NaN (0 for i32 rows),
set_rows leaves the destination row as it was; the error word then holds the first bad id's tag + 1,
its position in the index tensor (flat, row-major) and its value; good ids leave the word zero. The
other rows match the CPU reference exactly, as on the H200. A null word (OPDISPATCH_CHECK_INDICES=0)
changes nothing for good ids. Memory the kernels should not write starts poisoned (0xFF).

Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.args import UNCHECKED, Guard
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.dtypes import dequantize, from_float
from opdispatch.graph import Graph
from opdispatch.plugins.cuda_misc.specs import rows
from opdispatch.tensor import Flag, Tensor
from cuda_emu.hostcode import Arena, call, gxx_major, kernel_emulator, write_headers
from helpers import subscaled_blocks

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")

I64_MAX = 2**63 - 1


def _get_rows(dt: str, layout: str = "contig") -> Tensor:
    table = od.input("table", (2, 16, 64), dt) if layout != "T" else od.input("table", (2, 64, 16), dt).transpose()
    return ops.get_rows(table, od.input("ids", (2, 5), "i32"))


def _set_rows(dt: str, idx: str) -> Tensor:
    """Rows of (2, 3, 5, 64) into a (2, 3, 16, 64) destination at ids (1, 3, 5): the ids tile the outer axis."""
    return ops.set_rows(od.state("cache", (2, 3, 16, 64), dt), od.input("src", (2, 3, 5, 64)),
                        od.input("ids", (1, 3, 5), idx))


#: name: (graph, the ids' flat position made bad, the kernel instance expected)
CASES = {
    "get_rows f32": (lambda: _get_rows("f32"), 7, "get_rows<float, float, true>"),
    "get_rows f16 strided": (lambda: _get_rows("f16", "T"), 0, "get_rows<od::f16, float, false>"),
    "get_rows i32": (lambda: _get_rows("i32"), 9, "get_rows<int, int, true>"),
    "get_rows q8_0": (lambda: _get_rows("q8_0"), 3, "get_rows_q<od::quant::q8_0>"),
    "set_rows f32 i64": (lambda: _set_rows("f32", "i64"), 14, "set_rows<float, long long, true>"),
    "set_rows f16 i32": (lambda: _set_rows("f16", "i32"), 5, "set_rows<od::f16, int, true>"),
    "set_rows q8_0 i64": (lambda: _set_rows("q8_0", "i64"), 12, "set_rows_q<od::quant::q8_0, long long, true>"),
}


#: each kernel's argument record (its parameter count)
RECORDS = {"get_rows": rows.GetRowsArgs, "get_rows_q": rows.GetRowsQArgs, "set_rows": rows.SetRowsArgs,
           "set_rows_q": rows.SetRowsQArgs, "dequantize": rows.StridedCopyArgs,
           "convert_strided": rows.StridedCopyArgs}
#: SMs the copies' grid-stride grids are sized for (few blocks: the emulation runs them one by one)
EMU_SMS = 1


def _grid_nodes(dt: str) -> dict[str, Tensor]:
    """The decoding launches of grid format dt: get_rows from a batch of tables, the dequantizing copies
    (contiguous to f32, permuted to f16: both instances) and a permuted same-type copy (Block<N> units)."""
    table = od.input("table", (2, 6, 512), dt)
    w = od.input("w", (3, 2, 256), dt)
    return {"get_rows": ops.get_rows(table, od.input("ids", (2, 4), "i32")),
            "to f32": ops.cpy(w, od.state("y32", (3, 2, 256), "f32")),
            "to f16 permuted": ops.cpy(w.permute(1, 0, 2), od.state("y16", (2, 3, 256), "f16")),
            "cont permuted": ops.cont(w.permute(1, 0, 2))}


def _grid_spec(node: Tensor, arena: Arena) -> KernelSpec:
    if node.op == "get_rows":
        (spec,) = rows.get_rows_specs(node, arena.ptr, arena.guard)
    else:
        (spec,) = rows.copy_specs(node.srcs[0], node, arena.ptr, EMU_SMS)
    return spec


def _grid_arena(node: Tensor, rng: np.random.Generator) -> tuple[Arena, dict[Tensor, np.ndarray]]:
    """An arena holding node's leaves (grid blocks random and valid, ids in range), its result poisoned."""
    graph = Graph.build(node)
    arena = Arena(sum(t.base.nbytes + 256 for t in (*graph.leafs, *graph.nodes)))
    feeds = {}
    for leaf in graph.leafs:
        if leaf.dtype.is_quant:
            raw = subscaled_blocks(rng, leaf.dtype.name, leaf.size // leaf.dtype.block_size)
            feeds[leaf] = raw.reshape(*leaf.shape[:-1], -1)
        elif leaf.dtype.is_int:
            feeds[leaf] = rng.integers(0, node.srcs[0].shape[-2], leaf.shape).astype(np.int32)
        else:  # a copy's destination state: overwritten
            feeds[leaf] = np.zeros(leaf.shape, np.float32)
        arena.place(leaf, feeds[leaf] if leaf.dtype.is_quant or leaf.dtype.is_int else from_float(
            leaf.dtype.name, feeds[leaf]))
    arena.place(node, None)
    return arena, feeds


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """rows.cu and its headers, host-ready, built with a call for each instance CASES launches."""
    build = tmp_path_factory.mktemp("rows_emu")
    write_headers(build)
    for name in ("rows_common.cuh", "index.cuh"):
        (build / name).write_text((rows.KERNELS_DIR / name).read_text())
    src = rows.ROWS_CU.read_text()
    assert "asm" not in src, "rows.cu has inline PTX the emulation does not replace"
    grid_kernels = {_grid_spec(n, _grid_arena(n, np.random.default_rng(0))[0]).kernel
                    for dt in rows.GRID for n in _grid_nodes(dt).values()}
    kernels = sorted({kernel for _, _, kernel in CASES.values()} | grid_kernels)
    return kernel_emulator(build, src, "".join(call(k, len(RECORDS[k.split("<")[0]].names())) for k in kernels))


def _ids(node: Tensor) -> Tensor:
    return node.srcs[1] if node.op == "get_rows" else node.srcs[2]


def _bound(node: Tensor) -> int:
    return node.srcs[0].shape[-2]


def _feeds(node: Tensor, rng: np.random.Generator) -> dict[Tensor, np.ndarray]:
    """Values of every leaf (a set_rows destination's initial rows too): ids valid and distinct along their
    last axis, integers for i32 rows, floats in [-1, 1) else."""
    out = {}
    for t in Graph.build(node).leafs:
        if t is _ids(node):
            order = np.argsort(rng.random((*t.shape[:-1], _bound(node))), axis=-1)[..., :t.shape[-1]]
            out[t] = order.astype(t.dtype.numpy)
        elif t.dtype.is_int:
            out[t] = rng.integers(-1000, 1000, t.shape).astype(np.int32)
        else:
            out[t] = rng.uniform(-1, 1, t.shape).astype(np.float32)
    return out


def _stored(t: Tensor, values: np.ndarray) -> np.ndarray:
    return values if t.dtype.is_int else from_float(t.dtype.name, values)


class Emulated(NamedTuple):
    got: np.ndarray  # the bytes of the node's base after the launch
    arena: Arena  # its memory after the launch
    before: np.ndarray  # the memory before it
    spec: KernelSpec


def _emulate(node: Tensor, feeds: dict, guard: str, emulator: Path, tmp_path: Path) -> Emulated:
    """The one launch the plugin binds for `node`, run by the emulator (guard "checked": with the arena's
    error word, "null": checking off)."""
    graph = Graph.build(node)
    arena = Arena(sum(t.base.nbytes + 256 for t in (*graph.leafs, *graph.nodes)))
    for leaf in graph.leafs:
        arena.place(leaf, _stored(leaf, feeds[leaf]))
    arena.place(node, None)  # get_rows' result poisoned; set_rows' is its destination, placed above
    make = rows.get_rows_specs if node.op == "get_rows" else rows.set_rows_specs
    check: Guard = arena.guard if guard == "checked" else (lambda *a: UNCHECKED)
    (spec,) = make(node, arena.ptr, check)
    mem_file = tmp_path / "mem.bin"
    arena.mem.tofile(mem_file)
    before = arena.mem.copy()
    grid = tuple(spec.grid) if isinstance(spec.grid, tuple) else (spec.grid,)
    cmd = [str(emulator), str(mem_file), spec.kernel, *map(str, (grid + (1, 1))[:3]), str(spec.block),
           *(str(a.item()) for a in spec.arg_values)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    arena.mem = np.fromfile(mem_file, np.uint8)
    return Emulated(arena.bytes_of(node), arena, before, spec)


def _reference(node: Tensor, feeds: dict) -> np.ndarray:
    """The bytes the CPU reference leaves in `node`'s base for (valid) `feeds`."""
    plan = od.compile(node, "cpu")
    for t, v in feeds.items():
        if t.flags & Flag.STATE:
            plan.write(t, v)
    (out,) = plan.run({t: v for t, v in feeds.items() if t.flags & Flag.INPUT})
    return np.ascontiguousarray(out).view(np.uint8).reshape(-1)


def _row_bytes(node: Tensor, raw: np.ndarray) -> np.ndarray:
    """`node`'s base as rows of bytes (the last axis)."""
    return raw.reshape(-1, node.base.strides[-2] if node.base.ndim > 1 else raw.size)


@pytest.mark.parametrize("guard", ["checked", "null"])
@pytest.mark.parametrize("bad", ["past the end", "negative", "huge"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_row_id_is_not_dereferenced_and_is_recorded(case: str, bad: str, guard: str, emulator: Path,
                                                           tmp_path: Path, rng) -> None:  # noqa: ANN001
    """Checked or not (a null word), a bad id touches no memory outside the result; checked, it is recorded."""
    make, at, kernel = CASES[case]
    node = make()
    ids = _ids(node)
    good = _feeds(node, rng)
    value = {"past the end": _bound(node), "negative": -1,
             "huge": I64_MAX if ids.dtype.name == "i64" else -2**31}[bad]
    bad_ids = good[ids].copy()
    good_id = int(bad_ids.reshape(-1)[at])
    bad_ids.reshape(-1)[at] = value
    got, arena, before, spec = _emulate(node, {**good, ids: bad_ids}, guard, emulator, tmp_path)
    assert spec.kernel == kernel
    recorded = [Arena.TAG + 1, at, value, 0] if guard == "checked" else [0, 0, 0, 0]
    assert arena.word() == recorded, f"{case}: the error word"
    written = np.zeros(arena.mem.size, bool)  # what the launch may write: its result's base, the word
    written[arena.word_at:arena.word_at + 32] = True
    written[arena.where[node.base.uid]:arena.where[node.base.uid] + node.base.nbytes] = True
    np.testing.assert_array_equal(arena.mem[~written], before[~written], err_msg=f"{case}: memory outside")
    want = _row_bytes(node, _reference(node, good).copy())
    got = _row_bytes(node, got)
    if node.op == "get_rows":  # the output row of the bad id: NaN (0 for i32 rows)
        row = got[at].view(node.dtype.numpy)
        assert (row == 0).all() if node.dtype.is_int else np.isnan(row).all(), f"{case}: the bad id's row"
        want[at] = got[at]
    else:  # the destination row the good id would have written keeps its bytes, for every batch it tiles
        dst = node.srcs[0]
        (d3, d2, r, _), (_, i1, n) = dst.shape, ids.shape[-3:] if ids.ndim == 3 else (1, *ids.shape)
        initial = _row_bytes(node, np.ascontiguousarray(_stored(dst, good[dst])).view(np.uint8).reshape(-1))
        for j3 in range(d3):
            for j2 in range(d2):
                if j2 % i1 == at // n:
                    flat = (j3 * d2 + j2) * r + good_id
                    want[flat] = initial[flat]
    np.testing.assert_array_equal(got, want, err_msg=f"{case}: the other rows")


@pytest.mark.parametrize("guard", ["checked", "null"])
@pytest.mark.parametrize("case", list(CASES))
def test_good_row_ids_leave_the_word_clear(case: str, guard: str, emulator: Path, tmp_path: Path,
                                           rng) -> None:  # noqa: ANN001
    """Checked or not (a null word: OPDISPATCH_CHECK_INDICES=0), good ids give the reference's bytes."""
    node = CASES[case][0]()
    feeds = _feeds(node, rng)
    got, arena, _, _ = _emulate(node, feeds, guard, emulator, tmp_path)
    assert arena.word() == [0, 0, 0, 0]
    np.testing.assert_array_equal(_row_bytes(node, got), _row_bytes(node, _reference(node, feeds)))


@pytest.mark.parametrize("dt", rows.GRID)
def test_grid_formats_decode_as_dtypes(dt: str, emulator: Path, tmp_path: Path, rng) -> None:  # noqa: ANN001
    """get_rows and the dequantizing copies of a grid I-quant give dtypes.dequantize's values bit for bit (f16:
    those rounded by the CPU reference); the permuted same-type copy moves its blocks as they are."""
    for what, node in _grid_nodes(dt).items():
        arena, feeds = _grid_arena(node, rng)
        spec = _grid_spec(node, arena)
        mem_file = tmp_path / "mem.bin"
        arena.mem.tofile(mem_file)
        grid = tuple(spec.grid) if isinstance(spec.grid, tuple) else (spec.grid,)
        cmd = [str(emulator), str(mem_file), spec.kernel, *map(str, (grid + (1, 1))[:3]), str(spec.block),
               *(str(a.item()) for a in spec.arg_values)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        got = arena.bytes_of(node, np.fromfile(mem_file, np.uint8))
        assert arena.word(np.fromfile(mem_file, np.uint8)) == [0, 0, 0, 0], f"{dt} {what}: the error word"
        src = node.srcs[0]
        raw = feeds[src.base]
        if node.op == "get_rows":
            ids = feeds[node.srcs[1]]
            values = dequantize(dt, raw)
            want = np.stack([values[b][ids[b]] for b in range(2)]).view(np.uint8).reshape(-1)
        elif node.dtype.is_quant:  # the same blocks, moved as the view reads them
            want = np.ascontiguousarray(raw.reshape(3, 2, -1).transpose(1, 0, 2)).reshape(-1)
        else:
            (ref,) = od.compile(node, "cpu").run({t: v for t, v in feeds.items() if t.flags & Flag.INPUT})
            values = dequantize(dt, raw)
            assert node.dtype.name == "f16" or np.array_equal(ref.view(np.uint32), values.view(np.uint32))
            want = np.ascontiguousarray(ref).view(np.uint8).reshape(-1)
        assert np.array_equal(got, want), f"{dt} {what} ({spec.kernel}): {np.sum(got != want)} bytes differ"
