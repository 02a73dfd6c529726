"""ggml's I-quant and mxfp4 lookup tables (opdispatch.quants.iq_grids) against gguf-py's copies, and the
generated CUDA header iq_grids.cuh: equal to what the generator writes now, and compiled by nvcc."""

from __future__ import annotations

from pathlib import Path

import gguf.quants as gq
import numpy as np
import pytest

from opdispatch.quants import iq_grids as G
from test_kernels_compile import INCLUDE, needs_nvcc, nvcc

HEADER = INCLUDE / "iq_grids.cuh"

# our grid name: gguf's class holding the same grid
GGUF_GRIDS = {
    "iq2xxs_grid": gq.IQ2_XXS, "iq2xs_grid": gq.IQ2_XS, "iq2s_grid": gq.IQ2_S,
    "iq3xxs_grid": gq.IQ3_XXS, "iq3s_grid": gq.IQ3_S, "iq1s_grid": gq.IQ1_S,
}


@pytest.mark.parametrize("name", list(GGUF_GRIDS))
def test_grid_equals_gguf(name):
    theirs = GGUF_GRIDS[name]
    theirs.init_grid()
    ours = G.GRIDS[name]
    assert ours.shape == tuple(theirs.grid_shape)
    np.testing.assert_array_equal(ours.astype(np.float32), theirs.grid.reshape(ours.shape))
    assert sorted(set(ours.ravel().tolist())) == sorted(theirs.grid_map)


def test_small_tables_equal_gguf():
    np.testing.assert_array_equal(G.KSIGNS_IQ2XS, np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8))
    np.testing.assert_array_equal(G.KVALUES_IQ4NL, np.array(gq.IQ4_NL.kvalues, np.int8))
    np.testing.assert_array_equal(G.KVALUES_MXFP4, np.array(gq.MXFP4.kvalues, np.int8))
    np.testing.assert_array_equal(G.KMASK_IQ2XS, [1, 2, 4, 8, 16, 32, 64, 128])
    # the 8th sign bit keeps the count of set bits even, which is what lets ggml store 7
    assert all(bin(int(s)).count("1") % 2 == 0 for s in G.KSIGNS_IQ2XS)


def test_header_is_what_the_generator_writes():
    """Regenerate with `python scripts/gen_iq_grids.py` when the tables or the generator change."""
    assert HEADER.read_text() == G.cuda_header()


def test_iq1_nibbles_are_the_grid_plus_one():
    """iq1s_nibbles, the device's iq1s_grid: entry i's byte k holds value k + 1 low and value 4 + k + 1 high."""
    nib = G.IQ1S_NIBBLES.astype(np.int16)
    np.testing.assert_array_equal(nib & 15, G.IQ1S_GRID[:, :4] + 1)
    np.testing.assert_array_equal(nib >> 4, G.IQ1S_GRID[:, 4:] + 1)
    assert "iq1s_grid" not in G.TABLES and "iq1s_nibbles" in G.TABLES


def test_header_holds_ggml_words():
    """The header spells the grids as ggml does: entry i's bytes, low first, are TABLES[name][i]."""
    text = G.cuda_header()
    for name, grid in ((n, t) for n, t in G.TABLES.items() if t.ndim == 2):
        width = grid.shape[1]
        word = int.from_bytes(grid[-1].astype(np.uint8).tobytes(), "little")
        ctype = "unsigned long long" if width == 8 else "unsigned int"
        assert f"__device__ const {ctype} {name}[{len(grid)}] = {{" in text
        assert f"0x{word:0{2 * width}x},\n}};" in text


PROBE = r"""
#include "iq_grids.cuh"

__global__ void probe(const int* i, unsigned long long* out) {
    const int k = *i;
    out[0] = od::quant::iq2xxs_grid[k] + od::quant::iq2xs_grid[k] + od::quant::iq2s_grid[k] +
             od::quant::iq1s_nibbles[k];
    out[1] = od::quant::iq3xxs_grid[k] + od::quant::iq3s_grid[k] + od::quant::ksigns_iq2xs[k % 128];
    out[2] = od::quant::kmask_iq2xs[k % 8] + od::quant::kvalues_iq4nl[k % 16] + od::quant::kvalues_mxfp4[k % 16];
}
"""


@needs_nvcc
def test_header_compiles(tmp_path: Path):
    source = tmp_path / "probe.cu"
    source.write_text(PROBE)
    nvcc(source, tmp_path, INCLUDE)
