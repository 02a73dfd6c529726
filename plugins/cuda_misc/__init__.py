"""The cuda_misc plugin: elementwise, unary, glu, copies, rows, reductions, sorting; multi-add, softcap, top-k MoE
and greedy-pick fusions.

Two halves, each a module exposing `KERNELS` (Kernel records), `FUSIONS`
(FusionRule records) and `KERNEL_SOURCES` ({.cu path: template instances}):

- elementwise.py: add, sub, mul, div, add1, add_id, scale, clamp, leaky_relu,
  sqr, sqrt, log, sin, cos, every unary op, glu; multi-add and softcap fusions.
- rows.py: copies and conversions, rows, reductions, sorting; top-k MoE and greedy-pick
  (argmax -> cpy -> cpy -> set_rows of a greedy decode step) fusions.

The hooks below merge them, for CUDA devices only.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Iterator

from opdispatch.backends.cuda.devices import warp32_gate
from opdispatch.hookspecs import PRIORITY_BUILTIN, Device, FusionRule, Kernel, PluginInfo, hookimpl
from opdispatch.tensor import Tensor

from . import elementwise

try:
    rows = importlib.import_module(f"{__name__}.rows")
except ModuleNotFoundError as exc:  # only while that half is absent: an error inside it still raises
    if exc.name != f"{__name__}.rows":
        raise
    rows = None

HALVES = tuple(m for m in (rows, elementwise) if m is not None)

#: each .cu of this plugin and the template instances launched from it (tests/test_kernels_compile.py)
KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {
    path: names for half in HALVES for path, names in getattr(half, "KERNEL_SOURCES", {}).items()
}


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo("cuda_misc", "0.1.0", PRIORITY_BUILTIN,
                      "elementwise, unary, glu, copies, rows, reductions, sorting; "
                      "multi-add, softcap, top-k MoE, greedy-pick fusions")


@hookimpl
def supports_op(device: Device, node: Tensor) -> bool | str | None:
    """Plugin-wide gate: the kernels assume 32-lane warps."""
    return warp32_gate(device)


@hookimpl
def kernels(device: Device) -> Iterator[Kernel]:
    if device.kind != "cuda":
        return
    for half in HALVES:
        yield from half.KERNELS


@hookimpl
def fusion_rules(device: Device) -> Iterator[FusionRule]:
    """rows.py's rules (longer patterns) first, then elementwise.py's, each longest first."""
    if device.kind != "cuda":
        return
    for half in HALVES:
        yield from half.FUSIONS
