"""When scale -> leaky_relu runs as one kernel: the scale reads contiguous f32 and adds no bias."""

from __future__ import annotations

from typing import Sequence

from opdispatch.hookspecs import Device
from opdispatch.graph import Graph
from opdispatch.tensor import Tensor

from . import support


def check(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    scale, leaky = nodes
    if scale.params["bias"] != 0.0:
        return "the scale adds a bias"
    ok = support.leaky(device, leaky)
    return ok if ok is not True else support.leaky(device, scale)
