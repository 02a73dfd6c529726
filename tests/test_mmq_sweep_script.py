"""scripts/mmq_sweep.py without a GPU: its command line, and every configuration it would time (mmq's, mmq_small's,
mmq_id's candidates, the path that runs today beside them) building launch specs on the H200's description
that fit its limits, with the configuration's own kernel instance."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from opdispatch.plugins.cuda_matmul import support
from opdispatch.plugins.cuda_matmul.specs import mmq, mmq_id, mmq_small, mmq_wgmma
from opdispatch.plugins.cuda_matmul.specs.stream import device_facts

from helpers import load_script


@pytest.fixture(scope="module")
def sweep():  # noqa: ANN201 - the script, imported as a module
    return load_script("mmq_sweep")


def test_cli_parses(sweep) -> None:  # noqa: ANN001
    args = sweep.parse_args([])
    assert args.kernel == "mmq" and args.formats == "q4_0,q8_0" and args.small_ns == "9,16,24,32"
    args = sweep.parse_args(["--kernel", "mmq_small,mmq_id", "--small-formats", "q4_K", "--tokens", "64"])
    assert list(sweep.plan(args)) == ["mmq_small", "mmq_id"]
    for bad in (["--kernel", "mmq,nope"], ["--small-formats", "iq2_xxs"], ["--ns", "16", "--formats", "q8_K"]):
        with pytest.raises(SystemExit) as exc:
            sweep.parse_args(bad)
        assert exc.value.code == 2


def test_the_jobs_are_the_brief(sweep) -> None:  # noqa: ANN001
    """mmq_small: q4_0 / q8_0 / q4_K at 4096 x 14336 and 14336 x 4096, N 9, 16, 24, 32, each SMALL_CANDIDATES
    configuration beside mmq's table entry; mmq_id: 64 experts, 8 used, 2048 x 2048, T 64 and 512, beside
    mmv_id_grouped and mmq_wgmma_id, one job a group marked as what runs today."""
    jobs = sweep.plan(sweep.parse_args(["--kernel", "mmq,mmq_small,mmq_id"]))
    small = jobs["mmq_small"]
    assert {(j.fmt, j.m, j.k, j.n) for j in small} == {
        (f, m, k, n) for f in ("q4_0", "q8_0", "q4_K") for m, k in ((4096, 14336), (14336, 4096)) for n in (9, 16, 24, 32)}
    assert {j.cfg for j in small if j.kernel == "mmq_small"} == set(mmq_small.SMALL_CANDIDATES)
    assert mmq_small.SMALL_CANDIDATES[0] == mmq_small.SMALL
    moe = jobs["mmq_id"]
    assert {(j.experts, j.used, j.m, j.k, j.n) for j in moe} == {(64, 8, 2048, 2048, t) for t in (64, 512)}
    assert {j.cfg for j in moe if j.kernel == "mmq_id"} >= set(mmq_id.CANDIDATES)
    assert {(j.fmt, j.n, j.cfg) for j in moe if j.kernel == "mmq_wgmma_id"} == {
        (f, t, tile) for f in ("q4_0", "q8_0", "q4_K") for t in (64, 512) for tile in mmq_wgmma.ID_TILES}
    for kernel, js in jobs.items():
        groups: dict[tuple, list] = {}
        for j in js:
            groups.setdefault(j.group, []).append(j)
        for group, members in groups.items():
            (today,) = [j for j in members if j.table]
            if kernel == "mmq_small":
                assert (today.kernel, today.cfg) == ("mmq", mmq.mmq_config(today.fmt, today.n))
            elif kernel == "mmq_id":  # 64 tokens: 8 pairs an expert, the grouped mat-vec; 512: mmq_wgmma_id
                assert (today.kernel, today.cfg) == (("mmq_wgmma_id", mmq_wgmma.ID_TILE) if today.n > 64 else
                                                     ("mmv_id_grouped", None)), group


def test_every_job_builds_specs_within_the_h200(sweep) -> None:  # noqa: ANN001
    facts = device_facts(None)
    jobs = [j for js in sweep.plan(sweep.parse_args(["--kernel", "mmq,mmq_small,mmq_wgmma,mmq_id"])).values()
            for j in js]
    fitting = 0
    for job in jobs:
        if not job.fits(job.node()):
            assert job.kernel != "mmv_id_grouped" and not job.table, job  # what runs today fits
            continue
        fitting += 1
        specs = sweep.fake_specs(job)
        for s in specs:
            grid = (s.grid,) if isinstance(s.grid, int) else tuple(s.grid)
            assert all(g > 0 for g in grid) and grid[0] < 2**31 and all(g <= 65535 for g in grid[1:]), (job, s)
            assert 0 < math.prod((s.block,) if isinstance(s.block, int) else s.block) <= 1024, (job, s)
            assert s.smem <= facts.smem_per_block_optin, (job, s)
            assert Path(s.source).exists()
        last = specs[-1]
        want = {"mmq": lambda: mmq.instance_name(job.fmt, job.cfg),
                "mmq_small": lambda: mmq_small.small_name(job.fmt, mmq_small.small_nt(job.n), job.cfg),
                "mmq_id": lambda: mmq_id.instance_name(job.fmt, job.cfg),
                "mmq_wgmma": lambda: mmq_wgmma.instance_name(job.fmt, job.cfg)}.get(job.kernel)
        if want is not None:
            assert last.kernel == want(), job
        if job.kernel in ("mmq", "mmq_small"):
            assert last.args.preload == 1  # constant weights, as a model's
    assert fitting >= 0.95 * len(jobs)
    # mmq_small's first guess and most candidates fit every shape of the sweep
    small = [j for j in jobs if j.kernel == "mmq_small"]
    assert all(j.fits(j.node()) for j in small if j.cfg == mmq_small.SMALL)


def test_the_wgmma_jobs_bracket_the_crossover(sweep) -> None:  # noqa: ANN001
    """mmq_wgmma: q4_0 / q8_0 / q4_K at the 4096 x 14336 and 2048 x 8192 pairs, N 48 .. 2048 (both sides of
    support.MMQ_WGMMA_MIN_N and of tile_for's switch), mmq's table entry beside both tiles; the row marked as what
    runs today is mmq below the crossover and the chosen tile above it for the selected formats, none where
    dequant_cublas runs (q4_K above support.MMQ_MAX_N). Outputs compare within one rounding of b only."""
    jobs = sweep.plan(sweep.parse_args(["--kernel", "mmq_wgmma"]))["mmq_wgmma"]
    ns = {j.n for j in jobs}
    assert min(ns) < support.MMQ_WGMMA_MIN_N <= max(ns) and {128, 512} <= ns
    groups: dict[tuple, list] = {}
    for j in jobs:
        groups.setdefault(j.group, []).append(j)
    assert len(groups) == 3 * 4 * len(ns)
    for (fmt, _, m, k, n), members in groups.items():
        assert [(j.kernel, j.cfg) for j in members] == [("mmq", mmq.mmq_config(fmt, n)),
                                                        *(("mmq_wgmma", t) for t in mmq_wgmma.TILES)]
        today = [(j.kernel, j.cfg) for j in members if j.table]
        if support.wgmma_takes(fmt, m, k) is True and n >= support.MMQ_WGMMA_MIN_N:
            assert today == [("mmq_wgmma", mmq_wgmma.tile_for(m, n, k))]
        elif n <= support.MMQ_MAX_N:
            assert today == [("mmq", mmq.mmq_config(fmt, n))]
        else:
            assert today == []
        assert {j.rounding for j in members} == {"q8_1", "bf16"}
