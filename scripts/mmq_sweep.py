#!/usr/bin/env python3
"""Time the quantized GEMMs' configurations on one GPU, in one call: mmq, mmq_small and mmq_id.

--kernel (comma-separated, run in order):

- mmq (default): every configuration of specs/mmq.py's CANDIDATES for each format (q4_0, q8_0 by default; any
  of specs/mmq.MMQ_FORMATS, e.g. --formats q4_K,q5_K,q6_K) at each M x K of --shapes (default 4096x14336;
  the 1b preset's are 3072x2048,2048x2048,8192x2048,2048x8192) and each N (--ns, default 16, 32, 64, 128,
  512), torch.matmul in bf16 of the same shape beside; prints the lines of each format's table
  (specs/mmq.py: TABLE for the legacy formats, TABLE_K for the sub-scaled ones) the measurements suggest.
- mmq_small: every configuration of specs/mmq_small.SMALL_CANDIDATES (passed to small_specs) against mmq's table
  choice, at 4096 x 14336 and 14336 x 4096 weights (--small-shapes), N = 9, 16, 24, 32 (--small-ns), formats q4_0, q8_0, q4_K
  (--small-formats); prints the best configuration per (format, N, shape), whether it beats mmq, and the one
  with the least time summed over formats and shapes per N.
- mmq_wgmma: mmq's table configuration against mmq_wgmma's two tiles (specs/mmq_wgmma.NARROW, WIDE) at each
  M x K of --wgmma-shapes (default the 4096 x 14336 pair and the 1b preset's 2048 x 8192 pair), each N of
  --wgmma-ns (48 .. 2048) and format of --wgmma-formats (q4_0, q8_0, q4_K): the crossover support.MMQ_WGMMA_MIN_N
  and tile_for encode; prints the best tile per (format, shape, N) against the path support.choose takes.
- mmq_id: the MoE prefill shape (64 experts, 8 used, 2048 x 2048 experts, b one row a token) at T = 64 and 512
  tokens (--tokens): mmv_id_grouped, every configuration of specs/mmq_id.CANDIDATES (mmq_id_config's two
  among them) and mmq_wgmma_id's tiles (specs/mmq_wgmma.ID_TILES), formats --id-formats (q4_0, q8_0, q4_K);
  prints the best of mmq_id and of mmq_wgmma_id per (format, T) against the path support.choose takes today.

Each configuration's launches are built straight from the spec functions (the weights marked constant, as a
model's are: PDL preload on), captured into a CUDA graph of several instances and timed by its replays. At
most 64 columns (tokens) the weights are cold: the instances rotate over enough weight copies (>= 200 MB) that
the 50 MB L2 holds none of them, as in a decode step. Each output is checked: every element written (poisoned
with NaN first), rows 0..63 against a float64 numpy reference (NMSE < 5e-4), and the whole output against the
first configuration of its group that rounds b the same way (NMSE < 1e-8: they differ only in f32 summation
order; mmq's q8_1 and mmq_wgmma's bf16 meet only through the reference). A configuration that
fails to compile, launch or verify is reported and the sweep goes on (a kernel fault that breaks the CUDA context
fails the rest: the table says so). The instances compile first, in parallel processes (NVRTC; CuPy's disk
cache then serves the main process).

    python3 -m pip install -q --no-deps --no-build-isolation -e .   # as scripts/gpu-check does
    python3 scripts/mmq_sweep.py [--kernel mmq,mmq_small,mmq_wgmma,mmq_id] [--formats q4_0,q8_0] [--ns 16,32,64,128,512]
        [--shapes 4096x14336]
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
from typing import Any, Callable, Sequence

import attrs
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench import device_seconds, torch_graph  # noqa: E402 - the benchmarks' timing, shared

import opdispatch as od  # noqa: E402
from opdispatch import ops  # noqa: E402
from opdispatch.backends.cuda.args import UNCHECKED  # noqa: E402
from opdispatch.backends.cuda.kernels import KernelSpec  # noqa: E402
from opdispatch.plugins.cuda_matmul import support  # noqa: E402
from opdispatch.plugins.cuda_matmul.specs import mmq, mmq_id, mmq_small, mmq_wgmma, mmv  # noqa: E402
from opdispatch.plugins.cuda_matmul.specs.stream import device_facts  # noqa: E402
from opdispatch.tensor import Tensor  # noqa: E402

KERNELS = ("mmq", "mmq_small", "mmq_wgmma", "mmq_id")
MOE_EXPERTS, MOE_USED, MOE_M, MOE_K = 64, 8, 2048, 2048
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


def seconds(replay: Callable[[], None], sync: Callable[[], None]) -> float:
    """Median seconds of one replay: 7 rounds of 3 replays and one synchronize."""
    return device_seconds(replay, sync, reps=3, rounds=7)


@attrs.frozen
class Job:
    """One configuration to time: `kernel` (mmq, mmq_small, mmq_wgmma, mmq_id, mmq_wgmma_id, or the mat-vec
    mmv_id_grouped) on format `fmt`, weights (experts x) m x k, n columns (tokens for mul_mat_id); `table`: what the
    plugin runs today."""

    kernel: str
    fmt: str
    m: int
    k: int
    n: int
    cfg: Any = None
    table: bool = False
    experts: int = 0
    used: int = 0

    @property
    def rounding(self) -> str:
        """How the kernel rounds b: outputs of the same rounding agree but for summation order."""
        return "bf16" if self.kernel in ("mmq_wgmma", "mmq_wgmma_id") else "q8_1"

    @property
    def group(self) -> tuple:
        """The jobs whose outputs must agree: same format, shape and columns."""
        return self.fmt, self.experts, self.m, self.k, self.n

    def node(self) -> Tensor:
        """The product's node (inputs "a", "x", "ids")."""
        if self.experts:
            a = od.input("a", (self.experts, self.m, self.k), self.fmt)
            return ops.mul_mat_id(a, od.input("x", (self.n, 1, self.k)), od.input("ids", (self.n, self.used), "i32"))
        return ops.mul_mat(od.input("a", (self.m, self.k), self.fmt), od.input("x", (self.n, self.k)))

    def fits(self, node: Tensor) -> bool:
        """The configuration's shared memory within the H200's (device_facts(None))."""
        if self.kernel == "mmq":
            return mmq.mmq_fits(self.fmt, self.n, None, self.cfg)
        if self.kernel == "mmq_small":
            return mmq_small.small_fits(node, None, self.cfg)
        if self.kernel == "mmq_id":
            return mmq_id.mmq_id_smem(self.fmt, self.cfg) <= device_facts(None).smem_per_block_optin
        if self.kernel == "mmq_wgmma":
            return mmq_wgmma.wgmma_smem(self.fmt, self.cfg) <= device_facts(None).smem_per_block_optin
        if self.kernel == "mmq_wgmma_id":
            return mmq_wgmma.wgmma_id_smem(self.fmt, self.cfg) <= device_facts(None).smem_per_block_optin
        return True

    def specs(self, node: Tensor, ptr: Callable[[Tensor], int], scratch: Callable[..., int]) -> list[KernelSpec]:
        """The launches, from the plugin's spec functions, the weights marked constant (PDL preload)."""
        guard = lambda *_: UNCHECKED  # noqa: E731 - the ids are valid
        if self.kernel == "mmq":
            specs = mmq.mmq_specs(node, ptr, scratch, self.cfg)
        elif self.kernel == "mmq_small":
            specs = mmq_small.small_specs(node, ptr, scratch, None, self.cfg)
        elif self.kernel == "mmq_id":
            specs = mmq_id.mmq_id_specs(node, node, ptr, scratch, guard, cfg=self.cfg)
        elif self.kernel == "mmq_wgmma":
            specs = mmq_wgmma.wgmma_specs(node, ptr, scratch, None, self.cfg)
        elif self.kernel == "mmq_wgmma_id":
            specs = mmq_wgmma.wgmma_id_specs(node, node, ptr, scratch, guard, tile=self.cfg)
        else:
            specs = mmv.grouped_specs(node, node, ptr, scratch, guard)
        last = specs[-1]
        if "preload" in attrs.fields_dict(type(last.args)):
            specs[-1] = attrs.evolve(last, args=attrs.evolve(last.args, preload=1))
        return specs

    def label(self) -> str:
        return f"{self.kernel} {self.cfg}" if self.cfg is not None else self.kernel


def mmq_jobs(fmts: Sequence[str], ns: Sequence[int], shapes: Sequence[tuple[int, int]]) -> list[Job]:
    """Each format's table entry, then specs/mmq.CANDIDATES, at each (M, K) of shapes."""
    jobs = []
    for fmt in fmts:
        for (m, k) in shapes:
            for n in ns:
                table = mmq.mmq_config(fmt, n)
                jobs += [Job("mmq", fmt, m, k, n, cfg, cfg == table)
                         for cfg in dict.fromkeys([table, *mmq.candidates(n)])]
    return jobs


def small_jobs(fmts: Sequence[str], ns: Sequence[int], shapes: Sequence[tuple[int, int]]) -> list[Job]:
    """mmq's table entry (what runs today), then every SMALL_CANDIDATES configuration, at each (M, K) of shapes."""
    jobs = []
    for fmt in fmts:
        for (m, k) in shapes:
            for n in ns:
                jobs.append(Job("mmq", fmt, m, k, n, mmq.mmq_config(fmt, n), True))
                jobs += [Job("mmq_small", fmt, m, k, n, cfg) for cfg in mmq_small.SMALL_CANDIDATES]
    return jobs


def wgmma_jobs(fmts: Sequence[str], ns: Sequence[int], shapes: Sequence[tuple[int, int]]) -> list[Job]:
    """mmq's table configuration, then mmq_wgmma's tiles, at each (M, K) of shapes; `table` marks the path (and
    tile) support.choose takes, the format selected for mmq_wgmma as support.MMQ_WGMMA_TYPES says."""
    jobs = []
    for fmt in fmts:
        for (m, k) in shapes:
            for n in ns:
                today = support.choose(Job("mmq", fmt, m, k, n).node()).path
                jobs.append(Job("mmq", fmt, m, k, n, mmq.mmq_config(fmt, n), today == "mmq"))
                jobs += [Job("mmq_wgmma", fmt, m, k, n, t, today == "mmq_wgmma" and t == mmq_wgmma.tile_for(m, n, k))
                         for t in mmq_wgmma.TILES]
    return jobs


def id_jobs(fmts: Sequence[str], tokens: Sequence[int]) -> list[Job]:
    """mmv_id_grouped, every mmq_id CANDIDATES configuration, then mmq_wgmma_id's tiles, at the MoE prefill
    shape; `table` marks the path (and configuration) support.choose takes."""
    jobs = []
    for fmt in fmts:
        for t in tokens:
            shape = dict(experts=MOE_EXPERTS, used=MOE_USED)
            today = support.choose(Job("mmq_id", fmt, MOE_M, MOE_K, t, **shape).node()).path
            chosen = mmq_id.mmq_id_config(fmt, t * MOE_USED, MOE_EXPERTS)
            jobs.append(Job("mmv_id_grouped", fmt, MOE_M, MOE_K, t, None, today == "mmv_id_grouped", **shape))
            jobs += [Job("mmq_id", fmt, MOE_M, MOE_K, t, cfg, today == "mmq_id" and cfg == chosen, **shape)
                     for cfg in dict.fromkeys([chosen, *mmq_id.CANDIDATES])]
            jobs += [Job("mmq_wgmma_id", fmt, MOE_M, MOE_K, t, tile,
                         today == "mmq_wgmma_id" and tile == mmq_wgmma.ID_TILE, **shape)
                     for tile in mmq_wgmma.ID_TILES]
    return jobs


def fake_specs(job: Job) -> list[KernelSpec]:
    """The job's launches with made-up addresses (16-byte aligned): for compiling, and tests without a GPU."""
    addrs: dict[object, int] = {}

    def fake(key: object) -> int:
        return addrs.setdefault(key, (len(addrs) + 1) << 32)

    return job.specs(job.node(), lambda t: fake(id(t)), lambda role, nbytes, zeroed=False: fake(role))


def _compile(source: str, name: str) -> float:
    """NVRTC-compiles one instance of `source` (into CuPy's disk cache): seconds taken."""
    from opdispatch.backends.cuda.kernels import load_module

    t0 = time.perf_counter()
    load_module(source, (name,))
    return time.perf_counter() - t0


def nmse(got: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    return float(np.sum((got.astype(np.float64) - ref) ** 2) / max(np.sum(ref**2), 1e-300))


@attrs.define
class Row:
    job: Job
    us: float = math.nan
    gbs: float = math.nan
    pct: float = math.nan
    tflops: float = math.nan
    err: float = math.nan
    same: float = math.nan
    status: str = "ok"


def dequant_rows(fmt: str, raw: np.ndarray) -> np.ndarray:
    from opdispatch.dtypes import dequantize

    return dequantize(fmt, raw).astype(np.float64)


class Bench:
    """Device buffers for one format and weight shape: weight copies (random valid blocks), scratch, a stream."""

    def __init__(self, cp: Any, fmt: str, rows: int, k: int) -> None:
        self.cp, self.fmt = cp, fmt
        self.stream = cp.cuda.Stream(non_blocking=True)
        row_bytes = od.input("a", (1, k), fmt).nbytes
        self.nbytes = rows * row_bytes
        self.copies = max(2, math.ceil(COLD_BYTES / self.nbytes))
        qk = od.input("a", (1, k), fmt).dtype.block_size
        nb, block = k // qk, row_bytes * qk // k
        self.weights = []
        for _ in range(self.copies):
            raw = cp.random.randint(0, 256, size=(rows, nb, block), dtype=cp.int32).astype(cp.uint8)
            for at in F16_FIELDS[fmt]:
                scales = cp.random.uniform(1e-3, 1e-2, size=(rows, nb, 1)).astype(cp.float16)
                raw[:, :, at:at + 2] = scales.view(cp.uint8).reshape(rows, nb, 2)
            if fmt == "mxfp4":
                raw[:, :, 0] = cp.random.randint(119, 127, size=(rows, nb), dtype=cp.int32).astype(cp.uint8)
            self.weights.append(raw.reshape(rows, row_bytes))
        self.scratch_bufs: dict[str, Any] = {}

    def scratch(self, role: str, nbytes: int, zeroed: bool = False) -> int:
        buf = self.scratch_bufs.get(role)
        if buf is None or buf.nbytes < nbytes:
            buf = self.scratch_bufs[role] = self.cp.zeros(max(nbytes, 1 << 20), self.cp.uint8)
        return buf.data.ptr

    def graph(self, job: Job, inputs: dict[str, Any], outs: list) -> Callable[[], None]:
        """A CUDA graph of len(outs) instances of the job's launches, over the weight copies: its replay."""
        from opdispatch.backends.cuda.graphs import stream_capture

        node = job.node()
        named = {t.name: t for t in node.srcs}
        for role, buf in self.scratch_bufs.items():  # a failed configuration may have left counters set
            if "counters" in role:
                buf.fill(0)
        # the weights, outputs and counters were written on CuPy's default stream; ours does not wait for it
        self.cp.cuda.Device().synchronize()
        launches = []
        for i, out in enumerate(outs):
            where = {id(named["a"]): self.weights[i % self.copies].data.ptr, id(node): out.data.ptr,
                     **{id(named[n]): v.data.ptr for n, v in inputs.items()}}
            launches += [s.launch(self.stream) for s in job.specs(node, lambda t: where[id(t)], self.scratch)]
        for go in launches:  # warm-up, outside the capture
            go()
        self.stream.synchronize()
        return stream_capture(self.stream)(lambda: [go() for go in launches])


def run_group(cp: Any, bench: Bench, jobs: list[Job], rows: list[Row], rng: np.random.Generator) -> None:
    """Time the jobs of one group (same format, shape and columns), each output checked."""
    j0 = jobs[0]
    cold = j0.n <= COLD_MAX_N
    instances = 2 * bench.copies if cold else 8
    xv = rng.uniform(-1, 1, (j0.n, j0.k)).astype(np.float32)
    inputs = {"x": cp.asarray(xv)}
    x64 = xv.astype(np.float64)
    if j0.experts:  # rows 0..63 of each expert; each expert's tokens at once
        ids = np.argsort(rng.random((j0.n, j0.experts)), axis=1)[:, :j0.used].astype(np.int32)
        inputs["ids"] = cp.asarray(ids)
        w0 = cp.asnumpy(bench.weights[0].reshape(j0.experts, j0.m, -1)[:, :REF_ROWS])
        a = dequant_rows(j0.fmt, w0.reshape(j0.experts * REF_ROWS, -1)).reshape(j0.experts, REF_ROWS, j0.k)
        ref = np.zeros((j0.n, j0.used, REF_ROWS))
        for e in np.unique(ids):
            t, u = np.nonzero(ids == e)
            ref[t, u] = x64[t] @ a[e].T
        shape = (j0.n, j0.used, j0.m)
    else:
        ref = x64 @ dequant_rows(j0.fmt, cp.asnumpy(bench.weights[0][:REF_ROWS])).T
        shape = (j0.n, j0.m)
    outs = [cp.empty(shape, cp.float32) for _ in range(instances)]
    firsts: dict[str, np.ndarray] = {}  # each rounding's first output
    for job in jobs:
        row = Row(job)
        rows.append(row)
        try:
            if not job.fits(job.node()):
                row.status = "smem"
                continue
            for o in outs:
                o.fill(cp.nan)
            replay = bench.graph(job, inputs, outs)
            replay()
            bench.stream.synchronize()
            got = cp.asnumpy(outs[0])
            if not np.isfinite(got).all():
                row.status = "UNWRITTEN/NaN"
            row.err = nmse(got[..., :REF_ROWS], ref)
            row.same = nmse(got, firsts.setdefault(job.rounding, got))
            if row.err > NMSE_REF or row.same > NMSE_SAME:
                row.status = "WRONG"
            secs = seconds(replay, bench.stream.synchronize) / instances
            row.us = secs * 1e6
            row.gbs = bench.nbytes / secs / 1e9
            row.pct = 100 * bench.nbytes / secs / COPY_BW
            row.tflops = 2 * j0.m * j0.k * j0.n * max(1, j0.used) / secs / 1e12
        except Exception as exc:  # noqa: BLE001 - report and go on
            row.status = f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
            traceback.print_exc(file=sys.stderr)
    del outs


def torch_us(torch: Any, m: int, k: int, n: int, copies: int, instances: int) -> float:
    """torch.matmul bf16 (n, k) x (k, m) per instance, instances over `copies` weights, in a CUDA graph."""
    ws = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    replay = torch_graph(torch, lambda: [torch.matmul(x, ws[i % copies].T) for i in range(instances)])
    secs = seconds(replay, torch.cuda.synchronize)
    del ws, replay
    return secs / instances * 1e6


def best_of(rows: list[Row], key: Callable[[Job], tuple]) -> dict[tuple, Row]:
    """The fastest good row per key."""
    best: dict[tuple, Row] = {}
    for r in rows:
        if r.status == "ok" and (key(r.job) not in best or r.us < best[key(r.job)].us):
            best[key(r.job)] = r
    return best


def least_summed(rows: list[Row], kernel: str, over: Callable[[Job], bool]) -> tuple[str, float] | None:
    """The configuration of `kernel` with the least time summed over the rows `over` selects (a failure: inf)."""
    total: dict[str, float] = {}
    for r in rows:
        if r.job.kernel == kernel and over(r.job):
            total[str(r.job.cfg)] = total.get(str(r.job.cfg), 0.0) + (r.us if r.status == "ok" else math.inf)
    if not total:
        return None
    cfg = min(total, key=total.get)
    return cfg, total[cfg]


def print_rows(title: str, rows: list[Row], torch_times: dict) -> None:
    best = best_of(rows, lambda j: j.group)
    print(f"\n{title}; '*' what runs today, '<' the best of its group")
    print(f"{'fmt':6} {'weights':>14} {'N':>4} {'what':48} {'us':>8} {'GB/s':>6} {'%4.2T':>5} {'TFLOP/s':>7} "
          f"{'torch':>7} {'NMSE':>8} status")
    for r in rows:
        j = r.job
        t = torch_times.get((j.m, j.k, j.n), math.nan)
        shape = f"{j.experts}x{j.m}x{j.k}" if j.experts else f"{j.m}x{j.k}"
        mark = ("*" if j.table else " ") + ("<" if best.get(j.group) is r else " ")
        print(f"{j.fmt:6} {shape:>14} {j.n:4} {j.label():48} {r.us:8.1f} {r.gbs:6.0f} {r.pct:5.1f} {r.tflops:7.1f} "
              f"{t:7.1f} {r.err:8.1e} {r.status}{mark}")


def report_mmq(rows: list[Row], fmts: Sequence[str], ns: Sequence[int]) -> None:
    for name, tab in (("TABLE", mmq.TABLE), ("TABLE_K", mmq.TABLE_K)):
        group = [f for f in fmts if mmq.table(f) is tab]
        if not group:
            continue
        print(f"\nsuggested {name} (specs/mmq.py), the configuration with the least time summed over {group}:")
        for n in ns:
            most = next(m for m, _ in tab if n <= m)
            got = least_summed(rows, "mmq", lambda j: j.n == n and j.fmt in group)
            if got:
                print(f"  N={n:4} ({name} entry <= {most}): {got[0]}  ({got[1]:.1f} us summed)")


def report_versus(rows: list[Row], kernel: str, what: str) -> None:
    """Per group: the best configuration of `kernel` against what runs today (the `table` row)."""
    best = best_of([r for r in rows if r.job.kernel == kernel], lambda j: j.group)
    today = {r.job.group: r for r in rows if r.job.table}
    print(f"\nbest {kernel} per (format, weights, {what}) against what runs today:")
    for group, r in best.items():
        j, t = r.job, today.get(group)
        vs = (f"{t.job.label()} {t.us:.1f} us: {'BEATS it' if r.us < t.us else 'slower'} ({t.us / r.us:.2f}x)"
              if t is not None and t.status == "ok" else "nothing to compare")
        shape = f"{j.experts}x{j.m}x{j.k}" if j.experts else f"{j.m}x{j.k}"
        print(f"  {j.fmt:6} {shape:>14} {what}={j.n:4}: {j.cfg} {r.us:.1f} us; today {vs}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="mmq", help=f"comma-separated, run in order: {', '.join(KERNELS)}")
    ap.add_argument("--formats", default="q4_0,q8_0", help="mmq's formats")
    ap.add_argument("--ns", default="16,32,64,128,512", help="mmq's columns")
    ap.add_argument("--shapes", default="4096x14336", help="mmq's weights, MxK comma-separated")
    ap.add_argument("--small-shapes", default="4096x14336,14336x4096", help="mmq_small's weights")
    ap.add_argument("--small-formats", default="q4_0,q8_0,q4_K")
    ap.add_argument("--small-ns", default="9,16,24,32")
    ap.add_argument("--wgmma-formats", default="q4_0,q8_0,q4_K")
    ap.add_argument("--wgmma-ns", default="48,64,96,128,300,512,2048")
    ap.add_argument("--wgmma-shapes", default="4096x14336,14336x4096,2048x8192,8192x2048")
    ap.add_argument("--id-formats", default="q4_0,q8_0,q4_K")
    ap.add_argument("--tokens", default="64,512", help="mmq_id's tokens")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    kernels = args.kernel.split(",")
    bad = [k for k in kernels if k not in KERNELS] + [
        f for opt in ("formats", "small_formats", "wgmma_formats", "id_formats")
        for f in getattr(args, opt).split(",")
        if f not in mmq.MMQ_FORMATS]
    if bad:
        ap.error(f"unknown kernel or format: {', '.join(bad)} (kernels: {', '.join(KERNELS)}; formats: "
                 f"{', '.join(mmq.MMQ_FORMATS)})")
    return args


def plan(args: argparse.Namespace) -> dict[str, list[Job]]:
    """kernel -> its jobs, as the arguments ask."""
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    shapes = lambda s: [tuple(int(v) for v in mk.split("x")) for mk in s.split(",")]  # noqa: E731
    every = {"mmq": lambda: mmq_jobs(args.formats.split(","), ints(args.ns), shapes(args.shapes)),
             "mmq_small": lambda: small_jobs(args.small_formats.split(","), ints(args.small_ns),
                                             shapes(args.small_shapes)),
             "mmq_wgmma": lambda: wgmma_jobs(args.wgmma_formats.split(","), ints(args.wgmma_ns),
                                             shapes(args.wgmma_shapes)),
             "mmq_id": lambda: id_jobs(args.id_formats.split(","), ints(args.tokens))}
    return {k: every[k]() for k in args.kernel.split(",")}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import cupy as cp

    jobs = plan(args)
    names = {(str(s.source), s.kernel) for js in jobs.values() for j in js if j.fits(j.node()) for s in fake_specs(j)}
    t0 = time.perf_counter()
    failed_compiles = []
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        futures = {name: pool.submit(_compile, *name) for name in sorted(names)}
        for (source, name), fut in futures.items():
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
    rng = np.random.default_rng(0)
    for kernel, js in jobs.items():
        t0 = time.perf_counter()
        rows: list[Row] = []
        torch_times: dict = {}
        by_weights: dict[tuple, dict[tuple, list[Job]]] = {}
        for j in js:
            by_weights.setdefault((j.fmt, j.experts, j.m, j.k), {}).setdefault(j.group, []).append(j)
        for (fmt, experts, m, k), groups in by_weights.items():
            bench = Bench(cp, fmt, max(1, experts) * m, k)
            for group in groups.values():
                n = group[0].n
                if torch is not None and not experts and (m, k, n) not in torch_times:
                    try:
                        cold = n <= COLD_MAX_N
                        torch_times[(m, k, n)] = torch_us(torch, m, k, n, bench.copies if cold else 1,
                                                          2 * bench.copies if cold else 8)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        torch_times[(m, k, n)] = math.nan
                        print(f"torch n={n}: {type(exc).__name__}: {exc}", file=sys.stderr)
                run_group(cp, bench, group, rows, rng)
            del bench
            cp.get_default_memory_pool().free_all_blocks()
        print_rows(f"{kernel} sweep, cold weights for N <= {COLD_MAX_N} ({time.perf_counter() - t0:.0f} s)", rows,
                   torch_times)
        if kernel == "mmq":
            report_mmq(rows, args.formats.split(","), [int(v) for v in args.ns.split(",")])
        elif kernel == "mmq_small":
            report_versus(rows, "mmq_small", "N")
            print("\nmmq_small configuration with the least time summed over formats and shapes, per N "
                  "(specs/mmq_small.SMALL; support.MMQ_SMALL_MIN_N selects it):")
            for n in sorted({j.n for j in js}):
                got = least_summed(rows, "mmq_small", lambda j: j.n == n)
                mmq_total = sum(r.us for r in rows if r.job.n == n and r.job.kernel == "mmq")
                if got:
                    print(f"  N={n:3}: {got[0]}  {got[1]:.1f} us summed, mmq's table {mmq_total:.1f} us")
        elif kernel == "mmq_wgmma":
            report_versus(rows, "mmq_wgmma", "N")
        else:
            report_versus(rows, "mmq_id", "T")
            report_versus(rows, "mmq_wgmma_id", "T")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
