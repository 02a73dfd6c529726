"""The NCCL communicators of each group of GPUs, and the all-reduce launch on a GPU's stream."""

from __future__ import annotations

import threading
from typing import Any

from opdispatch.hookspecs import Launch
from opdispatch.ops.collective import group_devices
from opdispatch.tensor import Tensor

from .support import CUDA_NAME, nccl_module

_COMMS: dict[tuple[int, ...], list[Any]] = {}
_LOCK = threading.Lock()


def communicator(gpus: tuple[int, ...], rank: int) -> Any:
    """Rank `rank`'s NCCL communicator of the group of GPUs `gpus` (indices, in rank order); the group's
    communicators are made together (ncclCommInitAll) on first use."""
    with _LOCK:
        comms = _COMMS.get(gpus)
        if comms is None:
            nccl, _ = nccl_module()
            comms = _COMMS[gpus] = nccl.NcclCommunicator.initAll(list(gpus))
        return comms[rank]


def bind_all_reduce(ctx: Any, node: Tensor) -> Launch:
    """ncclAllReduce (sum, f32) of the source into the node, on the GPU's stream."""
    nccl, _ = nccl_module()
    names = group_devices(node.op, node.params["group"])
    comm = communicator(tuple(int(CUDA_NAME.fullmatch(n).group(1)) for n in names), node.params["rank"])
    send, recv, count, stream = ctx.ptr(node.srcs[0]), ctx.ptr(node), node.size, ctx.stream.ptr
    f32, total = nccl.NCCL_FLOAT32, nccl.NCCL_SUM

    def launch() -> None:
        comm.allReduce(send, recv, count, f32, total, stream)

    return launch
