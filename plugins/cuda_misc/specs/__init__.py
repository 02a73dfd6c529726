"""cuda_misc's kernel instances and pure launch specs, one module per .cu family.

`elementwise` (elementwise.cu), `unary` (unary.cu and glu.cu), `rows` (rows.cu's
copies, conversions, get_rows/set_rows and the layout-argument record), `layout`
(layout.cu), `reduce` (reduce.cu), `sort` (sort.cu). Each `*_spec(s)`
function picks kernel instances, grids, blocks and `KernelArgs` records from shapes,
strides and addresses only, so tests check them without a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from opdispatch.tensor import Tensor

#: the plugin's .cu files; set before the family modules below are imported, since they read it
KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
#: a tensor's first byte's device address: the bind context's `ptr`, or made-up addresses in tests
Ptr = Callable[[Tensor], int]

from . import elementwise, layout, reduce, rows, sort, unary  # noqa: E402


def _merged(*families: object) -> dict[Path, tuple[str, ...]]:
    """The families' KERNEL_SOURCES, the instances of a .cu file two families launch from put together."""
    out: dict[Path, tuple[str, ...]] = {}
    for family in families:
        for path, names in family.KERNEL_SOURCES.items():  # type: ignore[attr-defined]
            out[path] = out.get(path, ()) + names
    return out


#: each .cu file and the template instances launched from it (tests/test_kernels_compile.py compiles them)
KERNEL_SOURCES: dict[Path, tuple[str, ...]] = _merged(elementwise, unary, rows, layout, reduce, sort)
