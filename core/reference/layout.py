"""Reference kernels of the layout ops: concat, repeat, pad, pad_reflect_1d, roll, arange, fill, diag, tri,
timestep_embedding."""

from __future__ import annotations

import numpy as np

from ..tensor import Tensor
from . import load, reference, store


@reference("concat")
def _concat(node: Tensor, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    # Host storage as it is (raw bytes for block formats: blocks never straddle the join).
    out[...] = np.concatenate((a, b), axis=node.params["axis"])


@reference("repeat")
def _repeat(node: Tensor, out: np.ndarray, a: np.ndarray) -> None:
    shape = node.params["shape"]
    a = a[(np.newaxis,) * (len(shape) - a.ndim)]
    out[...] = np.tile(a, tuple(n // m for n, m in zip(shape, a.shape)))


@reference("pad")
def _pad(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    out[...] = np.pad(x, node.params["pads"])


@reference("pad_reflect_1d")
def _pad_reflect_1d(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    pads = [(0, 0)] * (x.ndim - 1) + [(node.params["p0"], node.params["p1"])]
    out[...] = np.pad(x, pads, mode="reflect")


@reference("roll")
def _roll(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    out[...] = np.roll(x, node.params["shifts"], axis=tuple(range(x.ndim)))


@reference("arange")
def _arange(node: Tensor, out: np.ndarray) -> None:
    p = node.params
    # float32 arithmetic, as ggml's start + step * i
    out[...] = np.float32(p["start"]) + np.float32(p["step"]) * np.arange(out.shape[0], dtype=np.float32)


@reference("fill")
def _fill(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    store(out, np.float32(node.params["value"]), node)


@reference("diag")
def _diag(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    rows = load(x, node.srcs[0])
    n = rows.shape[-1]
    values = np.zeros(node.shape, np.float32)
    i = np.arange(n)
    values[..., i, i] = rows.reshape(node.shape[:-2] + (n,))
    store(out, values, node)


@reference("tri")
def _tri(node: Tensor, out: np.ndarray, x: np.ndarray) -> None:
    kind = node.params["kind"]
    keep = {"lower": lambda v: np.tril(v, -1), "lower_diag": np.tril,
            "upper": lambda v: np.triu(v, 1), "upper_diag": np.triu}[kind]
    out[...] = keep(x)


@reference("timestep_embedding")
def _timestep_embedding(node: Tensor, out: np.ndarray, t: np.ndarray) -> None:
    dim, max_period = node.params["dim"], node.params["max_period"]
    half = dim // 2
    freq = np.exp(-np.log(max_period) * np.arange(half) / half)
    arg = t.astype(np.float64)[:, None] * freq
    values = np.zeros(node.shape, np.float64)
    values[:, :half] = np.cos(arg)
    values[:, half:2 * half] = np.sin(arg)
    store(out, values, node)
