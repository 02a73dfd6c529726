"""The CUDA backend plugin: brings the GPUs as devices (or an H200's description and
why there is none) and ggml's offload rule."""

from __future__ import annotations

import os

from ...hookspecs import PRIORITY_BUILTIN, AbsentDevice, Device, PluginInfo, hookimpl
from ...tensor import Tensor
from .devices import H200, discover


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda", "0.1.0", PRIORITY_BUILTIN, "CUDA devices through CuPy")


@hookimpl
def devices() -> list[Device]:
    return list(discover()[0])


@hookimpl
def absent_devices() -> list[AbsentDevice]:
    found, why = discover()
    return [] if found else [AbsentDevice(H200, why)]


def offload_min_batch() -> int:
    return int(os.environ.get("OPDISPATCH_OFFLOAD_MIN_BATCH", "32"))


def batch_size(node: Tensor) -> int:
    """Rows processed per weight, in ggml's sense (ggml's ne[1], ne[2] for MoE/rope)."""
    if node.op == "get_rows":
        return 0  # an embedding lookup never pays for copying the table
    if node.op in ("mul_mat_id", "rope"):
        return node.shape[-3] if node.ndim >= 3 else 1
    return node.shape[-2] if node.ndim >= 2 else 1


@hookimpl
def offload_op(device: Device, node: Tensor) -> bool | str | None:
    """ggml's rule: a batch of at least OPDISPATCH_OFFLOAD_MIN_BATCH rows (32) pays for
    copying host weights to the GPU."""
    if device.kind != "cuda":
        return None
    return batch_size(node) >= offload_min_batch() or f"batch {batch_size(node)} below offload threshold"
