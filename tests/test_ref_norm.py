"""Reference kernels of the norm ops vs per-row / per-group formulas in Python floats.

Expected values use math.fsum over Python lists (exactly rounded sums), one
row or group at a time; the f32 output is held to NMSE <= 1e-12.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import pytest
from helpers import evaluate, nmse
from test_ref_elementwise import LAYOUTS, assert_close, source, stored

import opdispatch as od
from opdispatch import ops
from opdispatch.errors import OpError

BOUND = 1e-12


def _norm_row(row: list[float], eps: float) -> list[float]:
    mean = math.fsum(row) / len(row)
    var = math.fsum((v - mean) ** 2 for v in row) / len(row)
    return [(v - mean) / math.sqrt(var + eps) for v in row]


def _rms_norm_row(row: list[float], eps: float) -> list[float]:
    rms = math.sqrt(math.fsum(v * v for v in row) / len(row) + eps)
    return [v / rms for v in row]


def _l2_norm_row(row: list[float], eps: float) -> list[float]:
    length = math.sqrt(math.fsum(v * v for v in row))
    return [v / max(length, eps) for v in row]


ROW_NORMS: dict[str, Callable[[list[float], float], list[float]]] = {
    "norm": _norm_row, "rms_norm": _rms_norm_row, "l2_norm": _l2_norm_row,
}


def _per_row(fn: Callable[[list[float], float], list[float]], x: np.ndarray, eps: float) -> np.ndarray:
    rows = x.reshape(-1, x.shape[-1]).tolist()
    return np.array([fn(row, eps) for row in rows], np.float64).reshape(x.shape)


def _run(build: Callable, x: np.ndarray, layout: str, gen: np.random.Generator) -> tuple[od.Tensor, np.ndarray]:
    tx, feed = source("x", x, "f32", layout, gen)
    y = build(tx)
    assert y.shape == x.shape and y.dtype.name == "f32"
    (out,) = evaluate(y, feed)
    return y, out.astype(np.float64)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 5, 4097])
@pytest.mark.parametrize("name", list(ROW_NORMS))
def test_row_norms(name, n, layout, rng, seed):
    gen = rng
    x = stored(gen.uniform(-10, 10, (2, 3, n)), "f32")
    y, out = _run(getattr(ops, name), x, layout, gen)
    eps = y.params["eps"]
    assert y.op == name and eps == {"norm": 1e-5, "rms_norm": 1e-6, "l2_norm": 1e-12}[name]
    assert_close(out, _per_row(ROW_NORMS[name], x, eps), BOUND, seed, f"{name} rows of {n}, {layout}")


@pytest.mark.parametrize(
    "name, magnitude, eps",
    [
        ("norm", 1e-3, 1e-5),  # var ~ 3e-7 < eps
        ("norm", 1.0, 2.0),
        ("rms_norm", 1e-4, 1e-6),  # mean square ~ 3e-9 < eps
        ("rms_norm", 1.0, 0.5),
        ("l2_norm", 1e-14, 1e-12),  # ||x|| < eps: x / eps
        ("l2_norm", 1.0, 0.0),
    ],
)
def test_row_norms_eps(name, magnitude, eps, rng, seed):
    """eps is used as given: where it dominates, the result differs from the eps-free formula."""
    gen = rng
    x = stored(gen.uniform(-magnitude, magnitude, (4, 37)), "f32")
    y, out = _run(lambda t: getattr(ops, name)(t, eps=eps), x, "permuted", gen)
    assert y.params["eps"] == eps
    want = _per_row(ROW_NORMS[name], x, eps)
    assert_close(out, want, BOUND, seed, f"{name} magnitude {magnitude} eps {eps}")
    if magnitude < 1:
        tiny = 1e-30 if name != "l2_norm" else 0.0
        assert nmse(_per_row(ROW_NORMS[name], x, tiny), want) > 1e-2, "eps has no visible effect in this case"


def _group_norm_expected(x: np.ndarray, groups: int, eps: float) -> np.ndarray:
    """Channel c belongs to group c // ceil(C / groups), as ggml assigns them; explicit loops."""
    x4 = x.reshape((1,) * (4 - x.ndim) + x.shape)
    n_batch, n_channels = x4.shape[:2]
    per_group = math.ceil(n_channels / groups)
    want = np.zeros_like(x4)
    for n in range(n_batch):
        for g in range(groups):
            channels = [c for c in range(n_channels) if c // per_group == g]
            if not channels:
                continue
            values = [v for c in channels for v in x4[n, c].ravel().tolist()]
            mean = math.fsum(values) / len(values)
            var = math.fsum((v - mean) ** 2 for v in values) / len(values)
            for c in channels:
                want[n, c] = (x4[n, c] - mean) / math.sqrt(var + eps)
    return want.reshape(x.shape)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "shape, groups",
    [
        ((2, 6, 3, 5), 3),  # C % groups == 0
        ((2, 6, 3, 5), 6),
        ((1, 6, 4, 7), 1),
        ((2, 5, 3, 5), 2),  # C % groups != 0: slices [0:3], [3:5]
        ((2, 10, 2, 3), 4),  # [0:3], [3:6], [6:9], [9:10]
        ((3, 7, 3, 3), 3),  # [0:3], [3:6], [6:7]
        ((2, 3, 2, 5), 4),  # more groups than channels: the 4th is empty
        ((7, 3, 5), 2),  # 3-D: (C, H, W), N = 1
    ],
)
def test_group_norm(shape, groups, layout, rng, seed):
    gen = rng
    x = stored(gen.uniform(-10, 10, shape), "f32")
    eps = float(gen.choice([1e-6, 1e-2, 5.0]))
    y, out = _run(lambda t: ops.group_norm(t, groups, eps), x, layout, gen)
    assert y.op == "group_norm" and y.params == {"eps": eps, "groups": groups}
    want = _group_norm_expected(x, groups, eps)
    assert_close(out, want, BOUND, seed, f"group_norm {shape} groups {groups} eps {eps} {layout}")


def test_group_norm_uneven_groups_differ_from_floor_split(rng, seed):
    """C=5, groups=2 must use ceil(5/2)=3 channels for group 0 (ggml), not 2."""
    gen = rng
    x = stored(gen.uniform(-10, 10, (1, 5, 2, 3)), "f32")
    _, out = _run(lambda t: ops.group_norm(t, 2), x, "contig", gen)
    floor_split = np.concatenate([_group_norm_expected(x[:, :2], 1, 1e-6), _group_norm_expected(x[:, 2:], 1, 1e-6)], 1)
    assert nmse(out, floor_split) > 1e-3, f"group_norm used floor(C/groups) channels per group (seed {seed})"


def test_norm_build_errors():
    for name in ("norm", "rms_norm", "l2_norm"):
        with pytest.raises(OpError, match=rf"{name}: x dtype f16 .*\(3, 5\) f16"):
            getattr(ops, name)(od.input("x", (3, 5), "f16"))
        with pytest.raises(OpError, match=rf"{name}: eps must be >= 0"):
            getattr(ops, name)(od.input("x", (3, 5)), eps=-1.0)
        with pytest.raises(OpError, match=rf"{name}: expected 1..4 dimensions.*\(1, 2, 3, 4, 5\)"):
            getattr(ops, name)(od.input("x", (1, 2, 3, 4, 5)))
    x = od.input("x", (2, 6, 3, 5))
    with pytest.raises(OpError, match=r"group_norm: groups must be >= 1, got 0 .*\(2, 6, 3, 5\)"):
        ops.group_norm(x, 0)
    with pytest.raises(OpError, match=r"group_norm: groups must be an integer, got 2.5"):
        ops.group_norm(x, 2.5)
    with pytest.raises(OpError, match=r"group_norm: x dtype bf16"):
        ops.group_norm(od.input("x", (2, 6, 3, 5), "bf16"), 2)
