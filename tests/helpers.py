"""Test helpers shared by the op tests."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from opdispatch.dtypes import from_float
from opdispatch.graph import Graph
from opdispatch.reference import REFERENCE
from opdispatch.tensor import VIEW_OPS, Flag, Tensor
from opdispatch.testing.metrics import nmse

__all__ = ["evaluate", "nmse"]


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

