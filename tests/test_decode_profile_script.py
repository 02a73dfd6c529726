"""scripts/decode_profile.py without a GPU: the time each kernel adds to a replayed step, from a chrome trace's
kernel events, and the side-by-side table of two runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_script


@pytest.fixture(scope="module")
def profile():  # noqa: ANN201 - the script, imported as a module
    return load_script("decode_profile")


def _replay(t0: float, rng) -> tuple[list[dict], dict[str, float]]:  # noqa: ANN001
    """One replay: a kernel, one that starts before it ends (programmatic dependent launch), one that starts and
    ends inside the second, and a last one after a gap; plus a host event the table ignores. Also what each
    kernel adds to the replay's span."""
    gemm, attn = rng.uniform(10, 20), rng.uniform(5, 10)
    events = [
        {"cat": "kernel", "name": "void mmf<2, 2, 0>(unsigned char const*, float*)", "ts": t0, "dur": gemm},
        {"cat": "kernel", "name": "void fattn_decode<64, od::f16>(char const*)", "ts": t0 + gemm - 2, "dur": attn},
        {"cat": "kernel", "name": "void norm_rows_f32<1>(float*)", "ts": t0 + gemm - 1, "dur": 0.5},
        {"cat": "kernel", "name": "void mmf<2, 2, 0>(unsigned char const*, float*)", "ts": t0 + gemm + attn + 3,
         "dur": gemm},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t0, "dur": 100.0},
    ]
    # the second mmf adds the gap and the 2 us the attention ran past the first
    return events, {"mmf<2, 2, 0>": gemm + (2 + 3 + gemm), "fattn_decode<64, od::f16>": attn - 2,
                    "norm_rows_f32<1>": 0.0}


def test_added_time_sums_to_the_last_replays_span(profile, rng) -> None:  # noqa: ANN001
    first, _ = _replay(0.0, rng)
    last, want = _replay(1000.0, rng)
    events = [*last, *first]  # the trace's order is not the launches'
    added = profile.added_by_kernel(events, 2)
    assert {k.removeprefix("void "): v[1] for k, v in added.items()} == {
        "mmf<2, 2, 0>": 2, "fattn_decode<64, od::f16>": 1, "norm_rows_f32<1>": 1}
    for name, (us, _) in added.items():
        assert us == pytest.approx(want[name.removeprefix("void ")]), name
    kernels = [e for e in last if e["cat"] == "kernel"]
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    assert sum(us for us, _ in added.values()) == pytest.approx(span)


def test_added_time_by_launch_grid_parts_a_kernel_by_its_shapes(profile, rng) -> None:  # noqa: ANN001
    events, want = _replay(0.0, rng)
    events[3]["args"] = {"grid": [64, 2, 1]}  # the second mmf launched for other weights
    events[0]["args"] = {"grid": [32, 1, 1]}
    added = profile.added_by_kernel(events, 1, profile.launch_shape)
    gemm = events[0]["dur"]
    assert added["void mmf<2, 2, 0> grid (32, 1, 1)"] == [pytest.approx(gemm), 1]
    assert added["void mmf<2, 2, 0> grid (64, 2, 1)"] == [pytest.approx(want["mmf<2, 2, 0>"] - gemm), 1]
    assert added["void norm_rows_f32<1> grid ()"] == [0.0, 1]  # an event without a grid keeps its name


def test_table_shows_the_added_time_of_the_runs_that_have_it(profile, tmp_path: Path, capsys,  # noqa: ANN001
                                                             rng) -> None:  # noqa: ANN001
    events, _ = _replay(0.0, rng)
    added = profile.added_by_kernel(events, 1)
    kernels = {name: [us, 1.0] for name, (us, _) in added.items()}
    runs = {"old": {"bf16": {"device_us": [20.0] * 3, "kernels": kernels}},  # a run from before the added time
            "new": {"bf16": {"device_us": [19.0] * 3, "kernels": kernels, "added": added,
                             "added_by_shape": profile.added_by_kernel(events, 1, profile.launch_shape)}}}
    for label, run in runs.items():
        (tmp_path / f"prof-{label}.json").write_text(json.dumps(run))
    profile.table(str(tmp_path))
    out = capsys.readouterr().out
    assert "us added to the last replay" in out and "the replay's span" in out and "by launch grid" in out
    span = sum(us for us, _ in added.values())
    assert f"{span:12.2f} |       | the replay's span" in out
