"""Perf mode's cases: shapes sized for a GPU, where bandwidth and FLOPs show, after ggml's make_test_cases_perf."""

from __future__ import annotations

from typing import Callable

import attrs

from ... import ops
from .attention import fa_case, rope_case, soft_max_case
from .base import Case
from .elementwise import binary_case, glu_case, map_case, multi_add_case
from .matmul import mul_mat_case
from .norm import rms_norm_mul_case
from .registry import available
from .rows import cpy_case, get_rows_case, set_rows_case


def _bytes_only(case: Case) -> Case:
    """`case` measured in bytes/s: mat-vec and decode attention are bound by memory, not FLOPs."""
    return attrs.evolve(case, flops=0)


#: group -> its perf cases; a group without any is timed on its test cases
PERF: dict[str, Callable[[], list[Case]]] = {
    "add": lambda: [binary_case("add", "f32", (16384, 4096), (1, 1)), binary_case("add", "f32", (4096,), (16384, 1))],
    "mul": lambda: [binary_case("mul", "f32", (4096,), (16384, 1)), binary_case("mul", "bf16", (16384, 4096), (1, 1))],
    "scale": lambda: [map_case("scale", "f32", (16384, 4096), "contig", -1.0, 1.0, s=0.5, bias=0.0)],
    "silu": lambda: [map_case("silu", dt, (16384, 4096), "contig", -10.0, 10.0) for dt in ("f32", "bf16")],
    "gelu": lambda: [map_case("gelu", "f32", (16384, 4096), "contig", -10.0, 10.0)],
    "glu": lambda: [glu_case("swiglu", dt, True, False, "contig", (4096,), 14336) for dt in ("f32", "bf16")],
    "norm": lambda: [Case("norm", "16384x4096", lambda inp: ops.norm(inp.uniform((16384, 4096), lo=-10, hi=10)))],
    "rms_norm": lambda: [Case("rms_norm", "16384x4096",
                              lambda inp: ops.rms_norm(inp.uniform((16384, 4096), lo=-10, hi=10)))],
    "fused:rms_norm_mul": lambda: [rms_norm_mul_case(False, (16384, 4096), (4096,))],
    "fused:rms_norm_mul_add": lambda: [rms_norm_mul_case(True, (16384, 4096), (4096,))],
    "fused:multi_add": lambda: [multi_add_case(4, (8192, 4096), (8192, 4096))],
    "soft_max": lambda: [soft_max_case((1, 32, 512, 4096), "f16", 0.088)],
    "rope": lambda: [rope_case(dt, "neox", (1, 4096, 32, 128), 128) for dt in ("f32", "f16")],
    "cpy": lambda: [cpy_case("f32", dst, (16384, 4096)) for dst in ("f16", "bf16", "q8_0")],
    "dup": lambda: [Case("dup", "f32 16384x4096", lambda inp: ops.dup(inp.uniform((16384, 4096))))],
    "get_rows": lambda: [attrs.evolve(get_rows_case(dt, (32000, 4096), 512), nbytes=512 * (row + 4096 * 4))
                         for dt, row in (("f32", 4096 * 4), ("q8_0", 4096 // 32 * 34))],
    "set_rows": lambda: [attrs.evolve(set_rows_case("f16", (8192, 1024), 512), nbytes=512 * 1024 * (4 + 2))],
    "mul_mat": lambda: [
        *(mul_mat_case(dt, 8192, 8192, 8192, tb=dt) for dt in ("f16", "bf16")),
        mul_mat_case("bf16", 4096, 512, 4096, tb="bf16"),
        *(_bytes_only(mul_mat_case(dt, 32768, 1, 4096)) for dt in ("bf16", "q8_0", "q4_0")),
    ],
    "flash_attn_ext": lambda: [
        _bytes_only(fa_case(128, 8192, 32, 8, 1, mask=False)),
        fa_case(128, 4096, 32, 8, 4096),
    ],
    "argsort": lambda: [Case("argsort", "64x4096 desc", lambda inp: ops.argsort(inp.uniform((64, 4096)), "desc"))],
}


def perf_cases(group: str) -> list[Case]:
    """Perf mode's cases of `group`; [] when it has none."""
    return PERF[group]() if group in PERF and available(group) else []
