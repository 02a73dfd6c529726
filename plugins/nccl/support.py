"""Which all_reduce_sum nodes NCCL takes on a CUDA device, and why not; whether NCCL is there at all."""

from __future__ import annotations

import functools
import re
from typing import Any

from opdispatch.hookspecs import Device
from opdispatch.ops.collective import group_devices
from opdispatch.tensor import Tensor

#: a CUDA device's name and its GPU index
CUDA_NAME = re.compile(r"cuda(\d+)")


@functools.cache
def nccl_module() -> tuple[Any, str]:
    """(cupy.cuda.nccl, "") where NCCL is usable, else (None, why not)."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc})"
    if not getattr(nccl, "available", False):
        return None, "CuPy found no NCCL library (install nvidia-nccl for your CUDA, or a CuPy built with NCCL)"
    return nccl, ""


def all_reduce_ok(device: Device, node: Tensor) -> bool | str:
    """NCCL takes the node on its own rank's GPU. On a device description (no backend: planning only, as
    the support matrix is made) NCCL is taken to be there, as every other fact of the described GPU."""
    nccl, why = nccl_module()
    if nccl is None and device.backend_factory is not None:
        return why
    names = group_devices(node.op, node.params["group"])
    rank = node.params["rank"]
    if names[rank] != device.name:
        return f"rank {rank} of group {node.params['group']} is {names[rank]}, not {device.name}"
    if not all(CUDA_NAME.fullmatch(n) for n in names):
        return f"group {node.params['group']} holds devices that are not CUDA GPUs"
    if not node.srcs[0].is_contiguous():
        return "its source is not contiguous"
    return True
