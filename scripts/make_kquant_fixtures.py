"""Regenerate tests/fixtures/kquants/*.npz: K-quant bytes written by llama.cpp's own llama-quantize.

gguf-py has no K-quant quantizer, so the oracle for opdispatch's encoders is
llama-quantize itself (quantize_row_q*_K_ref: --pure, no --imatrix):
1. make_gguf.py writes a small random f32 Llama GGUF (rows of 256 or 512);
2. every row of its matrices is refilled, one super-block at a time, from
   one of KINDS (normal, uniform, heavy-tailed, constant, zero, tiny, huge,
   outliers, ties on a grid...), so that the searches take their branches;
3. llama-quantize --pure writes one file per K-quant; every quantized block
   is compared with opdispatch's encoder (the counts are printed: the target
   is 0 differing bytes), and 2 rows of each kind of token_embd (one block
   a row) are kept as the fixture: x (rows, 256) float32, raw (rows, bytes)
   uint8, kind (rows,) str.
4. q8_K, which no GGUF holds, comes from ggml's quantize_row_q8_K_ref itself,
   called in the peer build's libggml-base.so (--ggml-lib) on the same rows;
   the output buffer starts zeroed, so the bsums ggml leaves unwritten in an
   all-zero block read 0, as opdispatch writes them.

Needs llama-quantize and libggml-base.so (`. /work/peer/env.sh`) and gguf; the tests need only the .npz files.
Usage: python scripts/make_kquant_fixtures.py [--out tests/fixtures/kquants] [--make-gguf PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from opdispatch import dtypes as D

QK_K = 256
#: opdispatch's name -> llama-quantize's ftype whose default type it is (with --pure every matrix gets it)
FTYPES = {"q2_K": "Q2_K", "q3_K": "Q3_K_M", "q4_K": "Q4_K_M", "q5_K": "Q5_K_M", "q6_K": "Q6_K"}
ROWS_PER_KIND = 2

Gen = Callable[[np.random.Generator], np.ndarray]


def _scaled(gen: Gen) -> Gen:
    """gen's values times a random magnitude from 1e-3 to 1e2."""
    return lambda r: gen(r) * 10.0 ** r.uniform(-3, 2)


def _outliers(per: int) -> Gen:
    """Normal values with one value in each run of `per` made 30..1000 times larger."""

    def gen(r: np.random.Generator) -> np.ndarray:
        x = r.standard_normal(QK_K)
        at = np.arange(0, QK_K, per) + r.integers(0, per, QK_K // per)
        x[at] *= r.uniform(30, 1000, len(at)) * r.choice([-1, 1], len(at))
        return x

    return gen


def _zero_subs(r: np.random.Generator) -> np.ndarray:
    """Normal values with a random half of the 16-value sub-blocks zeroed."""
    x = r.standard_normal((16, 16))
    x[r.random(16) < 0.5] = 0
    return x.reshape(QK_K)


KINDS: dict[str, Gen] = {
    "normal": _scaled(lambda r: r.standard_normal(QK_K)),
    "uniform": _scaled(lambda r: r.uniform(-1, 1, QK_K)),
    "student_t3": _scaled(lambda r: r.standard_t(3, QK_K)),
    "cauchy": _scaled(lambda r: r.standard_cauchy(QK_K)),
    "laplace": _scaled(lambda r: r.laplace(0, 1, QK_K)),
    "lognormal": _scaled(lambda r: r.lognormal(0, 1, QK_K)),
    "bimodal": _scaled(lambda r: r.choice([-1.0, 1.0], QK_K) + 0.05 * r.standard_normal(QK_K)),
    "positive": _scaled(lambda r: r.uniform(0.5, 1.5, QK_K)),
    "negative": _scaled(lambda r: r.uniform(-1.5, -0.5, QK_K)),
    "sparse": _scaled(lambda r: r.standard_normal(QK_K) * (r.random(QK_K) < 0.1)),
    "f16_values": lambda r: (r.standard_normal(QK_K) * 0.02).astype(np.float16).astype(np.float64),
    "grid": lambda r: r.integers(-8, 8, QK_K) * 0.25,  # exact halves: ties in nearest_int
    "outlier": _outliers(QK_K),
    "outlier_per_32": _outliers(32),
    "zero_subs": _zero_subs,
    "zeros": lambda r: np.zeros(QK_K),
    "neg_zeros": lambda r: np.full(QK_K, -0.0),
    "const_pos": lambda r: np.full(QK_K, r.uniform(0.1, 10)),
    "const_neg": lambda r: np.full(QK_K, -r.uniform(0.1, 10)),
    "const_subs": lambda r: np.repeat(r.uniform(-2, 2, 16), 16),
    "tiny": lambda r: r.standard_normal(QK_K) * 1e-20,  # below ggml's GROUP_MAX_EPS (1e-15)
    "small": lambda r: r.standard_normal(QK_K) * 1e-9,  # scales below f16's range
    # larger values give f16 scales of inf, which llama-quantize refuses to write ("validation failed")
    "huge": lambda r: r.standard_normal(QK_K) * 1e4,
}
NAMES = list(KINDS)


def fill(path: Path, rng: np.random.Generator) -> np.ndarray:
    """Refill every matrix of the f32 GGUF at path in place, row r of each from kind (r + offset) % len(KINDS).

    Returns the kind index of each row of token_embd.weight.
    """
    reader = gguf.GGUFReader(path, "r+")
    kinds = None
    for offset, t in enumerate(reader.tensors):
        if len(t.data.shape) != 2:
            continue
        rows, cols = t.data.shape
        which = (np.arange(rows) + offset) % len(NAMES)
        for r in range(rows):
            gen = KINDS[NAMES[which[r]]]
            t.data[r] = np.concatenate([gen(rng) for _ in range(cols // QK_K)]).astype(np.float32)
        if t.name == "token_embd.weight":
            kinds = which
    reader.data.flush()
    assert kinds is not None, "make_gguf.py wrote no token_embd.weight"
    return kinds


def ggml_q8_k(lib: Path, x: np.ndarray) -> np.ndarray:
    """ggml's own quantize_row_q8_K_ref on rows x (R, 256) -> (R, 292) bytes."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((len(x), D.dtype("q8_K").block_bytes), np.uint8)
    ctypes.CDLL(str(lib)).quantize_row_q8_K_ref(
        x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size)
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/fixtures/kquants")
    p.add_argument("--make-gguf", type=Path, default=Path("/work/shared/peer/make_gguf.py"))
    p.add_argument("--llama-quantize", default="llama-quantize")
    p.add_argument("--ggml-lib", type=Path, default=Path("/work/peer/lib/libggml-base.so"))
    p.add_argument("--seed", type=int, default=20261202)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "m"
        dims = "--hidden 256 --layers 1 --heads 4 --kv-heads 2 --ffn 512 --vocab 512".split()
        cmd = [sys.executable, str(a.make_gguf), str(prefix), "--types", "f32", "--seed", str(a.seed), *dims]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        src = Path(f"{prefix}-f32.gguf")
        kinds = fill(src, rng)
        values = {t.name: np.array(t.data) for t in gguf.GGUFReader(src).tensors}
        keep = np.concatenate([np.flatnonzero(kinds == k)[:ROWS_PER_KIND] for k in range(len(NAMES))])
        for name, ftype in FTYPES.items():
            out = Path(tmp) / f"m-{name}.gguf"
            cmd = [a.llama_quantize, "--pure", str(src), str(out), ftype]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode:
                sys.exit(f"llama-quantize {ftype} failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
            bb, blocks, bad_blocks, bad_bytes = D.dtype(name).block_bytes, 0, 0, 0
            for t in gguf.GGUFReader(out).tensors:
                if len(t.data.shape) != 2:
                    continue
                assert t.tensor_type == gguf.GGMLQuantizationType[name.upper()], (name, t.name, t.tensor_type)
                theirs = np.array(t.data).reshape(-1, bb)
                diff = D.quantize(name, values[t.name]).reshape(-1, bb) != theirs
                blocks, bad_blocks = blocks + len(diff), bad_blocks + diff.any(1).sum()
                bad_bytes += diff.sum()
                if t.name == "token_embd.weight":
                    raw = theirs[keep]
            print(f"{name}: {bad_blocks} of {blocks} blocks and {bad_bytes} bytes differ from llama-quantize's")
            x = values["token_embd.weight"][keep]
            np.savez_compressed(a.out / f"{name}.npz", x=x, raw=raw, kind=np.array([NAMES[k] for k in kinds[keep]]))
        x = values["token_embd.weight"][keep]
        raw = ggml_q8_k(a.ggml_lib, x)
        print(f"q8_K: {(D.quantize('q8_K', x) != raw).any(1).sum()} of {len(x)} blocks differ from ggml's")
        np.savez_compressed(a.out / "q8_K.npz", x=x, raw=raw, kind=np.array([NAMES[k] for k in kinds[keep]]))


if __name__ == "__main__":
    main()
