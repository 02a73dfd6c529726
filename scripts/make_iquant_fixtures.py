"""Regenerate tests/fixtures/iquants/ggml.npz: ggml's own bytes for iq4_nl, iq4_xs and mxfp4 (not run by the tests).

Needs llama.cpp's peer build (`. /work/peer/env.sh`: llama-quantize, libggml-base.so) and
/work/shared/peer/make_gguf.py. Steps:
1. make_gguf.py writes a small random f32 Llama GGUF (rows of 256); the rows of one weight
   are overwritten with hand-made edge cases (zero and sub-1e-15 sub-blocks, values on a
   coarse grid that tie between levels, powers of two and values just below them, a wide
   dynamic range) followed by random normal rows of scales 1e-6 .. 1e3.
2. `llama-quantize --pure IN OUT TYPE` for IQ4_NL, IQ4_XS and MXFP4_MOE; gguf.GGUFReader
   reads that weight's bytes back (llama-quantize writes IQ4_NL with ggml's quantize_iq4_nl,
   i.e. ntry = 7, and IQ4_XS with quantize_iq4_xs = quantize_row_iq4_xs_ref).
3. ggml's reference rows quantize_row_iq4_nl_ref and quantize_row_mxfp4_ref are called from
   libggml-base.so through ctypes on the same rows, after a few extreme ones (f16 overflow,
   mxfp4 exponents that wrap) that llama-quantize's validation would refuse.
The .npz holds the input rows x_file (the GGUF's, first --rows) and x_ref (3 extreme rows, then
x_file), float32 (rows, 256), and per producer the rows' bytes (rows, row bytes) uint8:
iq4_nl_file, iq4_xs, mxfp4_file (llama-quantize) of x_file; iq4_nl, mxfp4 (the *_ref rows) of x_ref.
Reruns give the same bytes except iq4_nl's codes in blocks whose |x| < 1e-15: quantize_row_iq4_nl_ref
leaves them as its uninitialised stack array held (the tests compare only d there).

Usage: . /work/peer/env.sh && python scripts/make_iquant_fixtures.py [--rows 48]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "iquants" / "ggml.npz"
MAKE_GGUF = Path("/work/shared/peer/make_gguf.py")
TENSOR = "blk.0.ffn_up.weight"  # (ffn rows, hidden 256 columns)
COLS = 256


def edge_rows(rng: np.random.Generator) -> np.ndarray:
    """Rows that reach the encoders' corner cases, one kind a row."""
    f = np.float32
    rows = []
    r = rng.standard_normal(COLS).astype(f)
    r[:32] = 0  # a zero iq4_nl / mxfp4 block and a zero iq4_xs sub-block
    r[32:64] = rng.standard_normal(32) * 1e-17  # below GROUP_MAX_EPS
    r[64:96] *= -1e-30
    rows.append(r)
    rows.append(np.zeros(COLS, f))  # an all-zero iq4_xs super-block (d = -0)
    rows.append(rng.integers(-8, 9, COLS).astype(f) / 4)  # a coarse grid: ties between levels
    rows.append(rng.integers(-127, 128, COLS).astype(f))  # the levels' own scale
    p2 = 2.0 ** rng.integers(-20, 20, COLS)
    rows.append((p2 * rng.choice([-1, 1], COLS)).astype(f))  # powers of two: mxfp4's octave edges
    rows.append(np.nextafter((p2 * rng.choice([-1, 1], COLS)).astype(f), f(0)))  # just below them
    rows.append((rng.standard_normal(COLS) * 10.0 ** rng.integers(-12, 5, COLS)).astype(f))  # wide range
    return np.stack(rows)


def extreme_rows(rng: np.random.Generator) -> np.ndarray:
    """Rows whose f16 scales overflow or whose mxfp4 exponent wraps: ggml's row functions take them,
    llama-quantize's validation refuses them (an inf/NaN d, e = 255), so only the *_ref fixtures hold them."""
    f = np.float32
    wide = rng.standard_normal(COLS) * 10.0 ** rng.integers(-30, 30, COLS)
    tiny = rng.standard_normal(COLS) * 10.0 ** rng.integers(-45, -36, COLS)  # amax < 2**-125: e wraps
    return np.stack([wide, tiny, np.repeat(10.0 ** np.arange(-40.0, 40.0, 10.0), COLS // 8)]).astype(f)


def row_fn(lib: ctypes.CDLL, name: str, block_bytes: int, block_size: int) -> Callable[[np.ndarray], np.ndarray]:
    """ggml's `void name(const float *x, block *y, int64_t k)`, called row by row."""
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None

    def run(x: np.ndarray) -> np.ndarray:
        out = np.zeros((x.shape[0], x.shape[1] // block_size * block_bytes), np.uint8)
        for i, row in enumerate(np.ascontiguousarray(x, np.float32)):
            fn(row.ctypes.data, out[i].ctypes.data, row.size)
        return out

    return run


def weight(reader: gguf.GGUFReader) -> gguf.ReaderTensor:
    return next(t for t in reader.tensors if t.name == TENSOR)


def quantized(src: Path, work: Path, qtype: str) -> tuple[np.ndarray, str] | tuple[None, str]:
    """TENSOR's raw bytes after llama-quantize --pure, or None and what llama-quantize did."""
    dst = work / f"{qtype}.gguf"
    done = subprocess.run(["llama-quantize", "--pure", str(src), str(dst), qtype], capture_output=True, text=True)
    if done.returncode:
        return None, f"llama-quantize {qtype} failed: " + " / ".join(done.stderr.strip().splitlines()[-4:])
    t = weight(gguf.GGUFReader(dst))
    return np.array(t.data).reshape(int(t.shape[-1]), -1), t.tensor_type.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=48, help="rows kept per fixture (edge rows first)")
    ap.add_argument("--seed", type=int, default=20261)
    args = ap.parse_args()
    if shutil.which("llama-quantize") is None:
        sys.exit("llama-quantize is not on PATH: source /work/peer/env.sh first")
    lib_dir = Path(shutil.which("llama-quantize")).resolve().parent.parent / "lib"
    lib = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    rng = np.random.default_rng(args.seed)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, str(MAKE_GGUF), str(work / "m"), "--types", "f32", "--hidden", str(COLS),
                        "--layers", "1", "--heads", "4", "--kv-heads", "2", "--ffn", "512", "--vocab", "300",
                        "--seed", str(args.seed)], check=True, env=os.environ)
        src = next(work.glob("m*f32*.gguf"))
        editor = gguf.GGUFReader(src, "r+")
        data = weight(editor).data.reshape(-1, COLS)  # a writable view of the file
        edges = edge_rows(rng)
        scales = 10.0 ** rng.integers(-6, 4, (data.shape[0] - len(edges), 1))
        data[: len(edges)] = edges
        data[len(edges):] = (rng.standard_normal((data.shape[0] - len(edges), COLS)) * scales).astype(np.float32)
        editor.data.flush()
        del editor, data
        x = np.array(weight(gguf.GGUFReader(src)).data, np.float32).reshape(-1, COLS)[: args.rows]
        produced = {}
        for qtype, name in (("IQ4_NL", "iq4_nl_file"), ("IQ4_XS", "iq4_xs"), ("MXFP4_MOE", "mxfp4_file")):
            q, what = quantized(src, work, qtype)
            print(f"{qtype}: {TENSOR} written as {what}" if q is not None else what)
            if q is not None and what.lower() == name.split("_file")[0]:
                produced[name] = q[: args.rows]
        xr = np.concatenate([extreme_rows(rng), x])
        for name, bb in (("iq4_nl", 18), ("mxfp4", 17)):
            produced[name] = row_fn(lib, f"quantize_row_{name}_ref", bb, 32)(xr)
    np.savez_compressed(FIXTURE, x_file=x, x_ref=xr, **produced)
    print(f"wrote {FIXTURE}: {', '.join(f'{k} {v.shape}' for k, v in produced.items())}")


if __name__ == "__main__":
    main()
