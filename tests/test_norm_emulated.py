"""cuda_norm's kernels (kernels/norm.cu: norm_rows_f32 for norm, rms_norm and l2_norm, alone and fused with the mul
and add after them, and group_norm_f32) run on the CPU: their real source compiled by g++ against the host emulation
of CUDA (tests/cuda_emu/shim.h), on the launch specs the plugin binds (specs.row_spec, specs.group_spec).

The cases cross the kernels' paths: float4 rows kept in registers (few rows: the latency configuration; many: the
throughput one) and element rows (lengths not a multiple of 4, strided views), one to several loads a thread, a
weight and a residual broadcast by modulo over the rows, and group norm's last group cut short and one left empty.
Outputs start poisoned (0xFF), so an element left unwritten shows; results are compared with the numpy reference by
NMSE (each op's bound). On the H200 the same kernels run in test_cuda_norm.py.

Skipped without g++ 12 or newer (C++20, _Float16).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.kernels import KernelSpec
from opdispatch.graph import Graph
from opdispatch.plugins.cuda_norm import specs
from opdispatch.tensor import Tensor
from opdispatch.testing.cases import bound
from opdispatch.testing.metrics import nmse
from cuda_emu.hostcode import (ScratchArena, call, fed_arena, gxx_major, host_ready, kernel_emulator,
                              run_launches, write_headers)

pytestmark = pytest.mark.skipif(gxx_major() < 12, reason="needs g++ 12 or newer (C++20, _Float16)")

EPS = {"norm": 1e-5, "rms_norm": 1e-6, "l2_norm": 1e-12}


def _row(op: str, shape: tuple, weight: tuple | None = None, residual: tuple | None = None,
         view: bool = False) -> Tensor:
    """op over x's rows (x a strided view of a wider input when `view`), times a weight of shape `weight` plus a
    residual of shape `residual` when given: the fused groups of fusion.py."""
    if view:
        wide = od.input("x", (*shape[:-1], shape[-1] + 3))
        x = wide.view(shape, wide.strides)
    else:
        x = od.input("x", shape)
    y = getattr(ops, op)(x, EPS[op])
    if weight is not None:
        y = ops.mul(y, od.input("w", weight))
    if residual is not None:
        y = ops.add(y, od.input("r", residual))
    return y


#: name: graph
CASES: dict[str, Callable[[], Tensor]] = {
    "rms_norm 1 row of 2048 (latency configuration)": lambda: _row("rms_norm", (1, 2048)),
    "rms_norm 40 rows of 96 times w plus r": lambda: _row("rms_norm", (40, 96), (96,), (40, 96)),
    "norm 6 rows of 100 (element loads) times w": lambda: _row("norm", (2, 3, 100), (3, 100)),
    "norm 3 rows of 4100 plus r broadcast": lambda: _row("norm", (3, 4100), (4100,), (1, 4100)),
    "l2_norm 5 rows of 64": lambda: _row("l2_norm", (5, 64)),
    "rms_norm strided rows of 33": lambda: _row("rms_norm", (7, 33), view=True),
    "rms_norm 2 rows of 6000 (several loads a thread)": lambda: _row("rms_norm", (2, 6000), (6000,)),
    "group_norm 5 channels in 4 groups (the third short, the last empty)": lambda: ops.group_norm(
        od.input("x", (2, 5, 4, 4)), 4, 1e-6),
    "group_norm 5 channels in 5 groups, 3 x 3 (element loads)": lambda: ops.group_norm(od.input("x", (1, 5, 3, 3)),
                                                                                          5, 1e-6),
}


def _nodes(y: Tensor) -> list[Tensor]:
    return [n for n in Graph.build(y).nodes if n.op not in ("view", "reshape")]


def _spec(y: Tensor, arena: ScratchArena) -> KernelSpec:
    """The one launch the plugin binds for `y`: a norm with the mul and add fused after it, or group norm."""
    norm, *rest = _nodes(y)
    if norm.op == "group_norm":
        return specs.group_spec(norm.srcs[0], y, norm.params["groups"], norm.params["eps"], arena.ptr)
    weight = next((n.srcs[1] for n in rest if n.op == "mul"), None)
    residual = next((n.srcs[1] for n in rest if n.op == "add"), None)
    return specs.row_spec(norm.op, norm.srcs[0], y, norm.params["eps"], arena.ptr, weight, residual)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """norm.cu and its headers, host-ready, built with a call for every instance the cases launch."""
    build = tmp_path_factory.mktemp("norm_emu")
    write_headers(build)
    kernel = host_ready(specs.NORM_CU)
    arity = {}
    for make in CASES.values():
        y = make()
        spec = _spec(y, fed_arena(y))
        arity[spec.kernel] = len(spec.arg_values)
    return kernel_emulator(build, kernel, "".join(call(name, n) for name, n in sorted(arity.items())))


@pytest.mark.parametrize("case", list(CASES))
def test_norm_emulated(case: str, emulator: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    y = CASES[case]()
    feeds = {t: rng.uniform(-2, 2, t.shape).astype(np.float32) for t in Graph.build(y).inputs}
    (ref,) = od.compile(y, "cpu").run(feeds)
    arena = fed_arena(y, feeds)
    spec = _spec(y, arena)
    mem = run_launches([spec], arena, False, emulator, tmp_path)
    got = arena.bytes_of(y, mem)[:y.nbytes].view(np.float32).reshape(y.shape)
    what = f"{case}: {spec.kernel} grid {spec.grid} block {spec.block}"
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten?)"
    assert nmse(got, ref) <= bound(_nodes(y)[0].op), f"{what}: NMSE {nmse(got, ref):.3g}"


def test_cases_cover_the_kernel() -> None:
    """The cases reach each mode, each fusion, float4 and element rows, the latency configuration and the
    throughput one, and group norm's float4 and element paths."""
    seen = set()
    for make in CASES.values():
        y = make()
        name = _spec(y, fed_arena(y)).kernel
        kernel, params = name.split("<")[0], [p.strip() for p in name.split("<")[1].rstrip(">").split(",")]
        if kernel == "norm_rows_f32":
            mode, _, vec, fuse, *per = params
            seen |= {("mode", mode), ("fuse", fuse), ("vec", vec), ("latency", bool(per))}
        else:
            seen.add(("group vec", params[1]))
    modes = {("mode", str(m)) for m in specs.MODES.values()}
    fuses = {("fuse", str(f)) for f in (specs.FUSE_NONE, specs.FUSE_MUL, specs.FUSE_MUL_ADD)}
    assert modes | fuses | {("vec", "true"), ("vec", "false"), ("latency", True), ("latency", False),
                            ("group vec", "true"), ("group vec", "false")} <= seen, seen
