"""cuda_misc and cuda_norm beside torch: GB/s, fraction of the copy bandwidth, ratio to torch.

Bytes are each input read once plus the output written once.
"""

from __future__ import annotations

import numpy as np
import pytest

import opdispatch as od
from bench import ready
from opdispatch import ops

pytestmark = pytest.mark.gpu




def rand(*shape: int, lo: float = -1, hi: float = 1) -> np.ndarray:
    return np.random.default_rng().uniform(lo, hi, shape).astype(np.float32)


def tt(torch, a: np.ndarray):  # noqa: ANN001, ANN201
    return torch.from_numpy(a).cuda()


def test_add_broadcast(measure, torch_cuda) -> None:  # noqa: ANN001
    torch = torch_cuda
    R, C = 8192, 8192
    a, b = od.input("a", (R, C)), od.input("b", (C,))
    fa, fb = rand(R, C), rand(C)
    plan = ready(ops.add(a, b), {a: fa, b: fb}, "cuda_misc")
    ta, tb = tt(torch, fa), tt(torch, fb)
    out = torch.empty_like(ta)
    measure(plan, 4 * (2 * R * C + C), lambda: torch.add(ta, tb, out=out))


def test_add_chain_fused(measure, torch_cuda) -> None:  # noqa: ANN001
    torch = torch_cuda
    R, C = 4096, 8192
    xs = [od.input(f"x{i}", (R, C)) for i in range(4)]
    y = ops.add(ops.add(ops.add(xs[0], xs[1]), xs[2]), xs[3])
    vals = [rand(R, C) for _ in xs]
    plan = ready(y, dict(zip(xs, vals)), "cuda_misc")
    assert plan.fusions, plan.explain()
    t = [tt(torch, v) for v in vals]
    measure(plan, 4 * 5 * R * C, lambda: t[0] + t[1] + t[2] + t[3])


@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "rms_norm_mul"])
def test_rms_norm(measure, torch_cuda, fused: bool) -> None:  # noqa: ANN001
    torch = torch_cuda
    R, C = 16384, 4096
    x = od.input("x", (R, C))
    w = od.param("w", rand(C))
    y = ops.mul(ops.rms_norm(x, 1e-6), w) if fused else ops.rms_norm(x, 1e-6)
    fx = rand(R, C, lo=-10, hi=10)
    plan = ready(y, {x: fx}, "cuda_norm")
    assert bool(plan.fusions) == fused, plan.explain()
    tx, tw = tt(torch, fx), tt(torch, w.data.view(np.float32))
    F = torch.nn.functional
    torch_fn = (lambda: F.rms_norm(tx, (C,), tw, 1e-6)) if fused else (lambda: F.rms_norm(tx, (C,), None, 1e-6))
    measure(plan, 4 * (2 * R * C + (C if fused else 0)), torch_fn)


@pytest.mark.parametrize("dst", ["f16", "q8_0"])
def test_cpy(measure, torch_cuda, dst: str) -> None:  # noqa: ANN001
    torch = torch_cuda
    R, C = 8192, 8192
    x = od.input("x", (R, C))
    out = od.state("out", (R, C), dst)
    fx = rand(R, C)
    plan = ready(ops.cpy(x, out), {x: fx}, "cuda_misc")
    out_bytes = R * C * 2 if dst == "f16" else R * C // 32 * 34
    tx = tt(torch, fx)
    to = torch.empty(R, C, dtype=torch.float16, device="cuda")
    measure(plan, 4 * R * C + out_bytes, (lambda: to.copy_(tx)) if dst == "f16" else None)


@pytest.mark.parametrize("n", [4096, 16384])  # 100 MB and 400 MB moved: the fixed launch cost matters at the first
def test_get_rows(measure, torch_cuda, n: int) -> None:  # noqa: ANN001
    torch = torch_cuda
    V, C = 32000, 4096
    table = od.param("table", rand(V, C), "f16")
    idx = od.input("idx", (n,), "i32")
    ids = np.random.default_rng().integers(0, V, n).astype(np.int32)
    plan = ready(ops.get_rows(table, idx), {idx: ids}, "cuda_misc")
    tt16 = torch.from_numpy(table.data.view(np.float16).reshape(V, C)).cuda()
    tid = torch.from_numpy(ids.astype(np.int64)).cuda()
    measure(plan, n * C * 2 + n * 4 + n * C * 4, lambda: torch.nn.functional.embedding(tid, tt16).float())


def test_set_rows(measure, torch_cuda) -> None:  # noqa: ANN001
    torch = torch_cuda
    R, C, n = 65536, 1024, 8192
    cache = od.state("cache", (R, C), "f16")
    src, idx = od.input("src", (n, C)), od.input("idx", (n,), "i64")
    rows = np.random.default_rng().permutation(R)[:n].astype(np.int64)
    fs = rand(n, C)
    plan = ready(ops.set_rows(cache, src, idx), {src: fs, idx: rows}, "cuda_misc")
    tc = torch.zeros(R, C, dtype=torch.float16, device="cuda")
    ts, ti = tt(torch, fs), torch.from_numpy(rows).cuda()
    measure(plan, n * C * 4 + n * 8 + n * C * 2, lambda: tc.index_copy_(0, ti, ts.half()))


def test_argsort(measure, torch_cuda) -> None:  # noqa: ANN001
    torch = torch_cuda
    R, C = 4096, 1024
    x = od.input("x", (R, C))
    fx = rand(R, C)
    plan = ready(ops.argsort(x, "desc"), {x: fx}, "cuda_misc")
    tx = tt(torch, fx)
    measure(plan, R * C * 8, lambda: torch.argsort(tx, dim=-1, descending=True))
