"""The nccl plugin: the collectives of a tensor split over CUDA GPUs (all_reduce_sum), by NCCL through CuPy.

One process drives every GPU of the split: the communicators are made at once by ncclCommInitAll
(cupy.cuda.nccl.NcclCommunicator.initAll), on the first bind, from the binding thread; then each rank's
plan runs on a thread of its own (core/group.py), which calls ncclAllReduce for its rank only, on its
GPU's stream, as NCCL wants one thread per rank when the calls are not grouped. The call is queued on
the stream like a kernel, so a segment holding it is captured into the rank's CUDA graph (NCCL >= 2.9
supports stream capture); the GPUs then meet in NCCL's kernels, without the host.

Without CuPy, or a CuPy without NCCL, the plugin declines with the reason, and the collective falls back
to the CPU reference (a host rendezvous: correct, slow). torch's NCCL is not a fallback: torch.distributed
wants a process per rank, and opdispatch drives the ranks from one.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

from opdispatch.backends.cuda.hooks import cuda_op_hooks
from opdispatch.hookspecs import PRIORITY_BUILTIN, Device, Kernel, Launch, PluginInfo
from opdispatch.ops.collective import group_devices
from opdispatch.tensor import Tensor

#: a CUDA device's name and its GPU index
_CUDA_NAME = re.compile(r"cuda(\d+)")


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


_COMMS: dict[tuple[int, ...], list[Any]] = {}
_LOCK = threading.Lock()


def communicator(gpus: tuple[int, ...], rank: int) -> Any:
    """Rank `rank`'s NCCL communicator of the group of GPUs `gpus` (indices, in rank order); the group's
    communicators are made together on first use."""
    with _LOCK:
        comms = _COMMS.get(gpus)
        if comms is None:
            nccl, _ = nccl_module()
            comms = _COMMS[gpus] = nccl.NcclCommunicator.initAll(list(gpus))
        return comms[rank]


def all_reduce_ok(device: Device, node: Tensor) -> bool | str:
    nccl, why = nccl_module()
    if nccl is None:
        return why
    names = group_devices(node.op, node.params["group"])
    rank = node.params["rank"]
    if names[rank] != device.name:
        return f"rank {rank} of group {node.params['group']} is {names[rank]}, not {device.name}"
    if not all(_CUDA_NAME.fullmatch(n) for n in names):
        return f"group {node.params['group']} holds devices that are not CUDA GPUs"
    if not node.srcs[0].is_contiguous():
        return "its source is not contiguous"
    return True


def bind_all_reduce(ctx: Any, node: Tensor) -> Launch:
    """ncclAllReduce (sum, f32) of the source into the node, on the GPU's stream."""
    nccl, _ = nccl_module()
    names = group_devices(node.op, node.params["group"])
    comm = communicator(tuple(int(_CUDA_NAME.fullmatch(n).group(1)) for n in names), node.params["rank"])
    send, recv, count, stream = ctx.ptr(node.srcs[0]), ctx.ptr(node), node.size, ctx.stream.ptr
    f32, total = nccl.NCCL_FLOAT32, nccl.NCCL_SUM

    def launch() -> None:
        comm.allReduce(send, recv, count, f32, total, stream)

    return launch


KERNELS: tuple[Kernel, ...] = (Kernel("all_reduce_sum", bind_all_reduce, all_reduce_ok, name="nccl"),)

plugin_info, supports_op, kernels, fusion_rules = cuda_op_hooks(
    PluginInfo("nccl", "0.1.0", PRIORITY_BUILTIN, "collectives of a tensor split over CUDA GPUs, by NCCL (CuPy)"),
    lambda: KERNELS)
