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

from opdispatch.backends.cuda.hooks import cuda_op_hooks
from opdispatch.hookspecs import PRIORITY_BUILTIN, Kernel, PluginInfo

from . import bind, support

KERNELS: tuple[Kernel, ...] = (Kernel("all_reduce_sum", bind.bind_all_reduce, support.all_reduce_ok, name="nccl"),)

plugin_info, supports_op, kernels, fusion_rules = cuda_op_hooks(
    PluginInfo("nccl", "0.1.0", PRIORITY_BUILTIN, "collectives of a tensor split over CUDA GPUs, by NCCL (CuPy)"),
    lambda: KERNELS)
