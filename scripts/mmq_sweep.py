#!/usr/bin/env python3
"""Time every mmq configuration the sweep lists (specs/mmq.py's CANDIDATES) on one GPU, in one call.

For each format (q4_0, q8_0 by default; any of specs/mmq.MMQ_FORMATS, e.g. --formats q4_K,q5_K,q6_K) at M=4096, K=14336 and each N (16, 32, 64, 128, 512), the
launches (quantize_q8_1, then mmq) are built straight from specs/mmq.py's mmq_specs with each candidate
configuration (the weights marked constant, as a model's are: PDL preload on), captured into a CUDA graph
of several instances and timed by its replays. N <= 64 is memory-bound: the instances rotate over enough
weight copies (>= 4, >= 200 MB) that the 50 MB L2 holds none of them, as in a decode step. torch.matmul
in bf16 of the same shape (cold the same way) is timed in the same run.

Each configuration's output is checked: every element written (the output poisoned with NaN first),
rows 0..63 against a float64 numpy reference (NMSE < 5e-4), and the whole output against the first
configuration's (NMSE < 1e-8: they differ only in f32 summation order). A configuration that fails to
compile, launch or verify is reported and the sweep goes on (a kernel fault that breaks the CUDA context
fails the rest: the table says so).

The instances compile first, in parallel processes (NVRTC; CuPy's disk cache then serves the main
process). Prints one table (us an instance, weight GB/s, % of 4.2 TB/s, TFLOP/s, torch bf16 us, NMSE),
the best configuration per format and N, and the lines of each format's table (specs/mmq.py: TABLE for the
legacy formats, TABLE_K for the sub-scaled ones) the measurements suggest.

    python3 -m pip install -q --no-deps --no-build-isolation -e .   # as scripts/gpu-check does
    python3 scripts/mmq_sweep.py [--formats q4_0,q8_0] [--ns 16,32,64,128,512] [--jobs 16]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any, Callable

import attrs
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench import device_seconds, torch_graph  # noqa: E402 - the benchmarks' timing, shared


def seconds(replay: Callable[[], None], sync: Callable[[], None]) -> float:
    """Median seconds of one replay: 7 rounds of 3 replays and one synchronize."""
    return device_seconds(replay, sync, reps=3, rounds=7)

M, K = 4096, 14336
COPY_BW = 4.2e12  # bytes/s: the H200's measured device copy bandwidth (docs), the ceiling for the weights
COLD_BYTES = 200 << 20  # weight copies a cold sweep rotates over: four times the 50 MB L2 at least
COLD_MAX_N = 64
REF_ROWS = 64
NMSE_REF, NMSE_SAME = 5e-4, 1e-8
#: byte offsets of a block's f16 scales (d, and m / dmin): random bytes elsewhere are valid codes and
#: sub-scales; mxfp4's scale is the e8m0 byte at 0 (set to 2^-8 .. 2^-1)
F16_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q2_K": (80, 82),
              "q3_K": (108,), "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,), "iq4_nl": (0,), "iq4_xs": (0,),
              "mxfp4": ()}


def _compile(name: str) -> float:
    """NVRTC-compiles one instance of mmq.cu or mmv.cu (into CuPy's disk cache): seconds taken."""
    from opdispatch.backends.cuda.kernels import load_module
    from opdispatch.plugins.cuda_matmul.specs import MMQ_CU, MMV_CU

    t0 = time.perf_counter()
    load_module(MMV_CU if name.startswith("quantize") else MMQ_CU, (name,))
    return time.perf_counter() - t0


def nmse(got: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    return float(np.sum((got.astype(np.float64) - ref) ** 2) / max(np.sum(ref**2), 1e-300))


@attrs.define
class Row:
    fmt: str
    n: int
    cfg: str
    us: float = math.nan
    gbs: float = math.nan
    pct: float = math.nan
    tflops: float = math.nan
    err: float = math.nan
    same: float = math.nan
    status: str = "ok"
    table: bool = False


class Sweep:
    """Device buffers and timing for one format: weight copies, b, outputs, scratch."""

    def __init__(self, cp: Any, fmt: str) -> None:
        import opdispatch as od
        from opdispatch import ops

        self.cp, self.fmt = cp, fmt
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.a = od.input("a", (M, K), fmt)
        self.row_bytes = self.a.nbytes // M
        self.copies = max(4, math.ceil(COLD_BYTES / self.a.nbytes))
        qk = self.a.dtype.block_size
        block = self.row_bytes * qk // K
        nb = K // qk
        self.weights = []
        for _ in range(self.copies):
            raw = cp.random.randint(0, 256, size=(M, nb, block), dtype=cp.int32).astype(cp.uint8)
            for at in F16_FIELDS[fmt]:
                scales = cp.random.uniform(1e-3, 1e-2, size=(M, nb, 1)).astype(cp.float16)
                raw[:, :, at:at + 2] = scales.view(cp.uint8).reshape(M, nb, 2)
            if fmt == "mxfp4":
                raw[:, :, 0] = cp.random.randint(119, 127, size=(M, nb), dtype=cp.int32).astype(cp.uint8)
            self.weights.append(raw.reshape(M, self.row_bytes))
        self.ref_a = dequant_rows(fmt, cp.asnumpy(self.weights[0][:REF_ROWS]))
        self.ops, self.od = ops, od
        self.scratch_bufs: dict[str, Any] = {}

    def scratch(self, role: str, nbytes: int, zeroed: bool = False) -> int:
        buf = self.scratch_bufs.get(role)
        if buf is None or buf.nbytes < nbytes:
            buf = self.scratch_bufs[role] = self.cp.zeros(max(nbytes, 1 << 20), self.cp.uint8)
        return buf.data.ptr

    def graph(self, n: int, cfg: Any, x: Any, outs: list) -> tuple[Callable[[], None], int]:
        """A CUDA graph of the op's instances with configuration cfg: (its replay, instances)."""
        from opdispatch.backends.cuda.graphs import stream_capture
        from opdispatch.plugins.cuda_matmul.specs import mmq

        b = self.od.input("x", (n, K))
        y = self.ops.mul_mat(self.a, b)
        for role, buf in self.scratch_bufs.items():  # a failed configuration may have left counters set
            if "counters" in role:
                buf.fill(0)
        # the weights, outputs and counters were written on CuPy's default stream; ours does not wait for it
        self.cp.cuda.Device().synchronize()
        launches = []
        for i in range(len(outs)):
            w = self.weights[i % self.copies]
            where = {id(self.a): w.data.ptr, id(b): x.data.ptr, id(y): outs[i].data.ptr}
            specs = mmq.mmq_specs(y, lambda t: where[id(t)], self.scratch, cfg)
            quant, main = specs
            main = attrs.evolve(main, args=attrs.evolve(main.args, preload=1))  # a model's weights are constant
            launches += [s.launch(self.stream) for s in (quant, main)]
        for go in launches:  # warm-up, outside the capture
            go()
        self.stream.synchronize()
        replay = stream_capture(self.stream)(lambda: [go() for go in launches])
        return replay, len(outs)


def dequant_rows(fmt: str, raw: np.ndarray) -> np.ndarray:
    from opdispatch.dtypes import dequantize

    return dequantize(fmt, raw).astype(np.float64)


def torch_us(torch: Any, n: int, copies: int, instances: int) -> float:
    """torch.matmul bf16 (n, K) x (K, M) per instance, instances over `copies` weights, in a CUDA graph."""
    ws = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(n, K, device="cuda", dtype=torch.bfloat16)
    replay = torch_graph(torch, lambda: [torch.matmul(x, ws[i % copies].T) for i in range(instances)])
    secs = seconds(replay, torch.cuda.synchronize)
    del ws, replay
    return secs / instances * 1e6


def sweep_format(cp: Any, fmt: str, ns: list[int], torch: Any, rows: list[Row], torch_times: dict) -> None:
    from opdispatch.plugins.cuda_matmul.specs import mmq

    sw = Sweep(cp, fmt)
    rng = np.random.default_rng(0)
    for n in ns:
        table_cfg = mmq.mmq_config(fmt, n)
        cands = list(dict.fromkeys([table_cfg, *mmq.candidates(n)]))
        cold = n <= COLD_MAX_N
        instances = 2 * sw.copies if cold else 8
        xv = rng.uniform(-1, 1, (n, K)).astype(np.float32)
        x = cp.asarray(xv)
        ref = xv.astype(np.float64) @ sw.ref_a.T  # (n, REF_ROWS)
        outs = [cp.empty((n, M), cp.float32) for _ in range(instances)]
        first = None
        if torch is not None and (n, cold) not in torch_times:
            try:
                torch_times[(n, cold)] = torch_us(torch, n, sw.copies if cold else 1, instances)
            except Exception as exc:  # noqa: BLE001 - report and go on
                torch_times[(n, cold)] = math.nan
                print(f"torch n={n}: {type(exc).__name__}: {exc}", file=sys.stderr)
        for cfg in cands:
            row = Row(fmt, n, str(cfg), table=cfg == table_cfg)
            rows.append(row)
            try:
                if not mmq.mmq_fits(fmt, n, None, cfg):
                    row.status = "smem"
                    continue
                for o in outs:
                    o.fill(cp.nan)
                replay, count = sw.graph(n, cfg, x, outs)
                replay()
                sw.stream.synchronize()
                got = cp.asnumpy(outs[0])
                if not np.isfinite(got).all():
                    row.status = "UNWRITTEN/NaN"
                row.err = nmse(got[:, :REF_ROWS], ref)
                if first is None:
                    first = got
                row.same = nmse(got, first)
                if row.err > NMSE_REF or row.same > NMSE_SAME:
                    row.status = "WRONG"
                secs = seconds(replay, sw.stream.synchronize) / count
                row.us = secs * 1e6
                row.gbs = sw.a.nbytes / secs / 1e9
                row.pct = 100 * sw.a.nbytes / secs / COPY_BW
                row.tflops = 2 * M * n * K / secs / 1e12
            except Exception as exc:  # noqa: BLE001 - report and go on
                row.status = f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
                traceback.print_exc(file=sys.stderr)
        del outs
    del sw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="q4_0,q8_0")
    ap.add_argument("--ns", default="16,32,64,128,512")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    t_start = time.perf_counter()
    import cupy as cp

    from opdispatch.plugins.cuda_matmul.specs import mmq, quantize_name

    fmts, ns = args.formats.split(","), [int(v) for v in args.ns.split(",")]
    names = {quantize_name("f32")}
    for fmt in fmts:
        for n in ns:
            names |= {mmq.instance_name(fmt, c) for c in (mmq.mmq_config(fmt, n), *mmq.candidates(n))}
    t0 = time.perf_counter()
    failed_compiles = []
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        futures = {name: pool.submit(_compile, name) for name in sorted(names)}
        for name, fut in futures.items():
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - the sweep reports the configuration as failing
                failed_compiles.append(name)
                print(f"compile {name}: {type(exc).__name__}: {str(exc)[:2000]}", file=sys.stderr)
    print(f"compiled {len(names)} instances in {time.perf_counter() - t0:.1f} s ({args.jobs} processes)"
          + (f"; FAILED: {failed_compiles}" if failed_compiles else ""), flush=True)

    torch = None
    if not args.no_torch:
        try:
            import torch as torch_mod

            torch = torch_mod
        except ImportError:
            print("torch not importable: no bf16 baseline", file=sys.stderr)
    rows: list[Row] = []
    torch_times: dict = {}
    for fmt in fmts:
        sweep_format(cp, fmt, ns, torch, rows, torch_times)
        cp.get_default_memory_pool().free_all_blocks()

    print(f"\nmmq sweep, M={M} K={K}, cold weights for N <= {COLD_MAX_N}; '*' its table's entry, '<' best of its N")
    head = (f"{'fmt':6} {'N':>4} {'config':34} {'us':>8} {'GB/s':>6} {'%4.2T':>5} {'TFLOP/s':>7} {'torch':>7} "
            f"{'x torch':>7} {'NMSE':>8} status")
    print(head)
    best: dict[tuple[str, int], Row] = {}
    for r in rows:
        if r.status == "ok" and (best.get((r.fmt, r.n)) is None or r.us < best[(r.fmt, r.n)].us):
            best[(r.fmt, r.n)] = r
    for r in rows:
        t = torch_times.get((r.n, r.n <= COLD_MAX_N), math.nan)
        mark = ("*" if r.table else " ") + ("<" if best.get((r.fmt, r.n)) is r else " ")
        print(f"{r.fmt:6} {r.n:4} {r.cfg:34} {r.us:8.1f} {r.gbs:6.0f} {r.pct:5.1f} {r.tflops:7.1f} {t:7.1f} "
              f"{t / r.us:7.2f} {r.err:8.1e} {r.status}{mark}")
    for name, tab in (("TABLE", mmq.TABLE), ("TABLE_K", mmq.TABLE_K)):
        group = [f for f in fmts if mmq.table(f) is tab]
        if not group:
            continue
        print(f"\nsuggested {name} (specs/mmq.py), the configuration with the least time summed over {group}:")
        for n in ns:
            most = next(m for m, _ in tab if n <= m)
            total: dict[str, float] = {}
            for r in rows:
                if r.n == n and r.fmt in group:
                    total[r.cfg] = total.get(r.cfg, 0.0) + (r.us if r.status == "ok" else math.inf)
            if total:
                cfg = min(total, key=total.get)
                print(f"  N={n:4} ({name} entry <= {most}): {cfg}  ({total[cfg]:.1f} us summed)")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
