"""A torch/transformers state dict -> params (load_state_dict) or numpy arrays (state_dict_arrays).

Torch tensors come to the host from any device, bf16 bit for bit; both
functions split transformers 5's fused MoE experts into the stacked names
LlamaModel takes.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from ...dtypes import dtype as as_dtype
from ...tensor import Tensor, param


def _host_array(name: str, value: Any) -> np.ndarray:
    """A numpy array of a torch tensor (bf16 bit for bit, any device) or an array-like."""
    if type(value).__module__.split(".")[0] == "torch":
        import ml_dtypes
        import torch

        t = value.detach().to("cpu")
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        try:
            return t.numpy()
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"state dict tensor '{name}': {t.dtype} has no numpy equivalent ({e})") from None
    return np.asarray(value)


#: transformers 5's fused MoE experts (Mixtral and others): "experts.gate_up_proj" (E, 2 * ffn, hidden), the
#: gate's rows first, and "experts.down_proj" (E, hidden, ffn), parameters without a ".weight" suffix
_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")


def _unfused(name: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(name, array) pairs under LlamaModel's stacked expert names for a fused expert tensor, else [(name, arr)]."""
    m = _FUSED_EXPERTS.fullmatch(name)
    if m is None:
        return [(name, arr)]
    stem = m.group(1) + "mlp.experts."
    if arr.ndim != 3 or (m.group(2) == "gate_up_proj" and arr.shape[1] % 2):
        raise ValueError(f"state dict tensor '{name}' has shape {arr.shape}; fused experts are (experts, "
                         f"{'2 * ffn, hidden' if m.group(2) == 'gate_up_proj' else 'hidden, ffn'})")
    if m.group(2) == "down_proj":
        return [(stem + "down_proj.weight", arr)]
    f = arr.shape[1] // 2
    return [(stem + "gate_proj.weight", np.ascontiguousarray(arr[:, :f])),
            (stem + "up_proj.weight", np.ascontiguousarray(arr[:, f:]))]


def state_dict_arrays(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A torch/transformers state dict -> {name: numpy array} (host copies of torch tensors, bf16 bit for bit).

    Names are kept, except transformers 5's fused MoE experts
    (``model.layers.{i}.mlp.experts.gate_up_proj`` and ``...down_proj``),
    which become the stacked ``mlp.experts.{gate,up,down}_proj.weight`` that
    `LlamaModel` takes (gate_up split in two). Give the result to LlamaModel
    to have it convert float weights to its config's dtype.
    """
    return {n: a for name, value in state_dict.items() for n, a in _unfused(name, _host_array(name, value))}


def load_state_dict(state_dict: Mapping[str, Any], *, copy: bool = True) -> dict[str, Tensor]:
    """A torch/transformers state dict (or {name: numpy array}) -> {name: param}, names kept.

    f32, f16, bf16 (torch.bfloat16 or ml_dtypes.bfloat16) and integer tensors
    keep their type; float64 becomes f32 (rounded). With copy=False the params
    share the memory of contiguous CPU tensors (mutating those changes the
    weights); the default copies. transformers 5's fused MoE experts are
    renamed and split as `state_dict_arrays` does (the split halves are copies).
    """
    out: dict[str, Tensor] = {}
    for name, arr in (pair for n, v in state_dict.items() for pair in _unfused(n, _host_array(n, v))):
        if arr.dtype == np.float64:
            out[name] = param(name, arr, "f32")
            continue
        try:
            dt = as_dtype(arr.dtype)
        except ValueError:
            raise ValueError(f"state dict tensor '{name}' has dtype {arr.dtype}; opdispatch loads float32, "
                             f"float16, bfloat16, float64 (as f32) and int8/16/32/64") from None
        if copy:
            arr = np.array(arr, order="C", copy=True)
        out[name] = param(name, arr, dt, shape=arr.shape)
    return out
