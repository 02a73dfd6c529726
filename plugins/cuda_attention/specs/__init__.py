"""cuda_attention's launch specs: one module per kernel family (softmax.cu, rope.cu, the flash attention
kernels), each with its instance names, argument records and pure `*_specs` functions of nodes, shapes and
addresses (tested without a GPU). `KERNEL_SOURCES` gathers every file's launched instances
(tests/test_kernels_compile.py compiles them)."""

from __future__ import annotations

from pathlib import Path

from . import flash, rope, softmax

KERNEL_SOURCES: dict[Path, tuple[str, ...]] = {**softmax.KERNEL_SOURCES, **rope.KERNEL_SOURCES,
                                               **flash.KERNEL_SOURCES}
