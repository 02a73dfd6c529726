"""The CUDA backend: imports without CuPy, kernel arguments, the CUDA-graph policy; on a GPU,
memory, transfers, out-of-memory, NVRTC modules, launches and graph capture.

Random inputs come from a fresh seed each run, printed on failure; set
OPDISPATCH_TEST_SEED to replay one.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import opdispatch as od
from opdispatch.errors import LaunchError, OutOfMemory
from opdispatch.backends.cuda import graphs
from opdispatch.backends.cuda.graphs import MAX_CONSECUTIVE_RECAPTURES, GraphRunner
from opdispatch.backends.cuda.kernels import pack_args

gpu = pytest.mark.gpu


# -- without a GPU ------------------------------------------------------------------------


def test_cuda_modules_and_plugins_import_without_importing_cupy() -> None:
    code = textwrap.dedent("""
        import sys
        import opdispatch.backends.cuda.backend, opdispatch.backends.cuda.kernels, opdispatch.backends.cuda.graphs
        import opdispatch.plugins.cuda_norm
        assert "cupy" not in sys.modules, "CuPy was imported at module level"
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_pack_args_passes_each_numpy_scalar_as_its_c_type() -> None:
    args = (np.uint64(0xDEADBEEF000), np.int32(-7), np.int64(-(2**40)), np.float32(1.5), np.float64(0.25))
    params, values, described = pack_args(args)
    ctypes_of = (ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_double)
    assert len(params) == len(args) == len(values)
    for p, ctype, a in zip(params, ctypes_of, args):
        assert ctypes.cast(p, ctypes.POINTER(ctype)).contents.value == a.item()
    assert described == tuple((a.dtype.char, a.item()) for a in args)
    hash(described)  # part of a graph signature


@pytest.mark.parametrize("bad", [3, 2.5, "x", np.array([1], np.int32)])
def test_pack_args_refuses_values_without_an_exact_c_type(bad: object) -> None:
    with pytest.raises(TypeError, match=r"kernel argument 1 .*np\.uint64 for pointers"):
        pack_args((np.int32(1), bad))


PDL_SOURCE = r"""
template <int B>
__global__ void __launch_bounds__(256, 2) waits_first(float* y, const float* x, int n) {
    od::grid_enter();
    y[0] = x[0];
}
__global__ void reads_first(float* y, const float* x) {
    const float v = x[0];
    od::grid_enter();
    y[0] = v;
}
extern "C" __global__ void commented(float* y) {
    // a comment first: not recognised, so launched without PDL (the safe default)
    od::grid_enter();
}
"""


def test_pdl_kernels_are_those_whose_body_begins_with_the_wait(tmp_path: Path) -> None:
    from opdispatch.backends.cuda.kernels import KernelSpec, pdl_kernels

    path = tmp_path / "k.cu"
    path.write_text(PDL_SOURCE)
    assert pdl_kernels(path) == {"waits_first"}
    assert KernelSpec(path, "waits_first<3>", 1, 32, ()).pdl
    assert not KernelSpec(path, "reads_first", 1, 32, ()).pdl


def test_the_decode_step_kernels_launch_with_pdl() -> None:
    from opdispatch.backends.cuda.kernels import pdl_kernels

    plugins = Path(od.__file__).resolve().parent.parent / "plugins"
    expected = {"cuda_matmul/kernels/mmv.cu": {"mmv", "mmvq", "quantize_q8_1"},
                "cuda_matmul/kernels/mmvq_stream.cu": {"mmvq_stream"},
                "cuda_matmul/kernels/mmv_id.cu": {"mmv_id", "mmvq_id", "moe_route", "mmv_id_grouped",
                                                  "mmvq_id_grouped"},
                "cuda_misc/kernels/sort.cu": {"topk_moe"},
                "cuda_attention/kernels/fattn_decode.cu": {"fattn_decode"},
                "cuda_norm/kernels/norm.cu": {"norm_rows_f32"},
                "cuda_misc/kernels/rows.cu": {"get_rows", "set_rows"},
                "cuda_misc/kernels/reduce.cu": {"argmax_split"}}
    for source, names in expected.items():
        assert names <= pdl_kernels((plugins / source).resolve()), source


def test_the_prefill_attention_kernels_launch_with_pdl() -> None:
    from opdispatch.backends.cuda.kernels import pdl_kernels

    plugins = Path(od.__file__).resolve().parent.parent / "plugins" / "cuda_attention" / "kernels"
    for source, name in (("fattn_prefill.cu", "fattn_prefill"), ("fattn_prefill_wgmma.cu", "fattn_prefill_wgmma"),
                         ("fattn_mask.cu", "fattn_mask_flags")):
        assert pdl_kernels((plugins / source).resolve()) == {name}, source


def test_graphs_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPDISPATCH_DISABLE_CUDA_GRAPHS", raising=False)
    assert graphs.graphs_enabled()
    monkeypatch.setenv("OPDISPATCH_DISABLE_CUDA_GRAPHS", "0")
    assert graphs.graphs_enabled()
    monkeypatch.setenv("OPDISPATCH_DISABLE_CUDA_GRAPHS", "1")
    assert not graphs.graphs_enabled()


class FakeStream:
    """Records launches while capturing and replays the records, like stream capture."""

    def __init__(self) -> None:
        self.executed: list[str] = []
        self.recording: list[str] | None = None
        self.fail_capture = False

    def launch(self, tag: str):  # noqa: ANN201
        def go() -> None:
            (self.recording if self.recording is not None else self.executed).append(tag)

        return go

    def capture(self, issue):  # noqa: ANN001, ANN201
        self.recording = []
        try:
            issue()
            if self.fail_capture:
                raise RuntimeError("operation not permitted when stream is capturing")
        finally:
            graph, self.recording = self.recording, None
        return lambda: self.executed.extend(graph)


def fake_runner(capture: bool = True) -> tuple[GraphRunner, FakeStream]:
    s = FakeStream()
    launches = [("a 'x' (2,) f32 by t:a", s.launch("a")), ("b 'y' (2,) f32 by t:b", s.launch("b"))]
    return GraphRunner("segment [a .. b]", launches, s.capture if capture else None, "fake0"), s


def test_graph_runner_warms_up_then_captures_once_and_replays() -> None:
    runner, s = fake_runner()
    for run in range(1, 5):
        runner("sig")
        assert s.executed == ["a", "b"] * run  # every run runs every launch once
    assert runner.captures == 1 and runner.recaptures == 0 and not runner.disabled


def test_graph_runner_recaptures_on_a_changed_signature_and_stops_after_four_in_a_row() -> None:
    runner, s = fake_runner()
    runner("s0")  # warm-up, direct
    runner("s0")  # first capture: not a re-capture
    runner("s1")  # re-capture 1
    runner("s1")  # replay: the count starts again
    assert (runner.captures, runner.recaptures) == (2, 0)
    for i in range(2, 2 + MAX_CONSECUTIVE_RECAPTURES):
        assert not runner.disabled
        runner(f"s{i}")
    assert runner.captures == 2 + MAX_CONSECUTIVE_RECAPTURES
    assert runner.disabled == f"the signature changed on {MAX_CONSECUTIVE_RECAPTURES} consecutive runs"
    runner("s5")
    runner("s9")
    assert runner.captures == 2 + MAX_CONSECUTIVE_RECAPTURES  # direct from now on
    assert s.executed == ["a", "b"] * runner.runs


def test_graph_runner_without_capture_launches_directly() -> None:
    runner, s = fake_runner(capture=False)
    for sig in ("x", "x", "y"):
        runner(sig)
    assert runner.captures == 0 and s.executed == ["a", "b"] * 3


def test_graph_runner_names_the_failing_launch() -> None:
    def boom() -> None:
        raise ValueError("bad grid")

    runner = GraphRunner("segment", [("ok 'x'", lambda: None), ("rms_norm 'y' (4, 8) f32 by cuda_norm:rms", boom)],
                         None, "cuda0")
    with pytest.raises(LaunchError, match=r"cuda0: rms_norm 'y' \(4, 8\) f32 by cuda_norm:rms failed: ValueError: bad grid"):
        runner("sig")


def test_graph_runner_falls_back_to_direct_launches_when_capture_fails() -> None:
    runner, s = fake_runner()
    s.fail_capture = True
    runner("s")
    with pytest.warns(RuntimeWarning, match="capture of segment .* failed, launching directly"):
        runner("s")
    runner("s")
    assert runner.disabled.startswith("capture failed: RuntimeError")
    assert s.executed == ["a", "b"] * 3


# -- on a GPU ------------------------------------------------------------------------------

AXPB = r"""
#include "common.cuh"

// y = a * x + B over n floats
template <int B>
__global__ void axpb(float* y, const float* x, float a, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        od::store(y + i, a * od::load(x + i) + B);
    }
}
"""


@pytest.fixture
def backend():  # noqa: ANN201
    from opdispatch.backends.cuda.backend import backend_for
    from opdispatch.backends.cuda.devices import discover

    return backend_for(discover()[0][0])


@pytest.fixture
def axpb_module(tmp_path: Path):  # noqa: ANN201
    from opdispatch.backends.cuda.kernels import load_module

    path = tmp_path / "axpb.cu"
    path.write_text(AXPB)
    return load_module(path, ("axpb<1>", "axpb<3>"))


@gpu
def test_one_backend_per_device(backend) -> None:  # noqa: ANN001
    from opdispatch.backends.cuda.backend import backend_for

    dev = backend.device
    assert backend_for(dev) is backend and dev.backend_factory(dev) is backend
    assert backend.stream.is_non_blocking
    for key in ("cc", "sm_count", "smem_per_block", "warp_size", "total_memory", "pci_bus_id"):
        assert key in dev.props


@gpu
def test_alloc_write_read_and_device_copy_round_trip(backend, rng) -> None:  # noqa: ANN001
    data = rng.integers(0, 256, 5000, dtype=np.uint8)
    a = backend.alloc(6000, "buffer a")
    b = backend.alloc(6000, "buffer b")
    backend.write(a, 100, data)
    assert np.array_equal(backend.read(a, 100, 5000), data)
    backend.copy(b, 7, a, 100, 5000)
    assert np.array_equal(backend.read(b, 7, 5000), data)  # read waits for the queued copy
    with pytest.raises(ValueError, match="outside the 6000-byte buffer for buffer a"):
        backend.write(a, 1001, data)


@gpu
def test_out_of_memory_names_the_request_and_leaves_the_backend_usable(backend, rng) -> None:  # noqa: ANN001
    with pytest.raises(OutOfMemory) as info:
        backend.alloc(10**15, "a buffer far too large")
    assert isinstance(info.value, MemoryError)
    msg = str(info.value)
    assert f"{backend.device.name}: cannot allocate {10**15} bytes" in msg
    assert "a buffer far too large" in msg and "free of" in msg
    buf = backend.alloc(1 << 20, "after the failure")
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    backend.write(buf, 0, data)
    assert np.array_equal(backend.read(buf, 0, 1 << 20), data)


@gpu
def test_a_state_starts_as_zeros_over_recycled_nan_memory(backend) -> None:  # noqa: ANN001
    # A KV cache's unwritten rows are read (times a zero softmax weight): NaN there would spread.
    n = 1 << 18
    junk = backend.alloc(4 * n, "junk")
    backend.fill(junk, 0xFF)  # NaN in f32
    del junk  # back to CuPy's pool, ready for the state below
    cache = od.state("cache", (n,), "f32")
    (out,) = od.compile(od.ops.scale(cache, 2.0, 1.0), "cuda0").run()
    assert np.array_equal(out, np.ones(n, np.float32))


@gpu
def test_bind_context_addresses_and_views(backend, rng) -> None:  # noqa: ANN001
    import cupy

    x = od.input("x", (4, 6))
    xt = x.permute(1, 0)
    buf = backend.alloc(512, "views")
    values = rng.standard_normal((4, 6)).astype(np.float32)
    backend.write(buf, 64, values)
    ctx = backend.bind_context(lambda t: (buf, 64 + t.view_offset))
    assert ctx.ptr(x) == buf.ptr + 64 and ctx.stream is backend.stream
    assert np.array_equal(cupy.asnumpy(ctx.array(x)), values)
    assert np.array_equal(cupy.asnumpy(ctx.array(xt)), values.T)
    q = od.input("q", (2, 64), "q8_0")
    assert ctx.array(q).shape == (2, 2 * 34) and ctx.array(q).dtype == np.uint8


@gpu
def test_module_and_prebound_launch(backend, axpb_module, rng) -> None:  # noqa: ANN001
    from opdispatch.backends.cuda.kernels import EMPTY, KernelLaunch, launcher

    n = 1000
    x, y = backend.alloc(4 * n, "x"), backend.alloc(4 * n, "y")
    values = rng.uniform(-1, 1, n).astype(np.float32)
    backend.write(x, 0, values)
    fn = axpb_module.get_function("axpb<3>")
    launch = launcher(fn, (n + 255) // 256, 256, (np.uint64(y.ptr), np.uint64(x.ptr), np.float32(2), np.int32(n)),
                      stream=backend.stream)
    assert isinstance(launch, KernelLaunch)
    assert launcher(fn, 0, 256, (), stream=backend.stream) is EMPTY
    launch()
    got = backend.read(y, 0, 4 * n).view(np.float32)
    assert np.array_equal(got, 2 * values + 3)


CHAIN = r"""
#include "common.cuh"

// dst = src + 1, launched with programmatic dependent launch: each block waits for the kernel
// before, and block 0 lingers before writing, so that a missing wait would show as a stale read in
// the next kernel.
__global__ void chain_step(float* dst, const float* src, int n) {
    od::grid_enter();
    if (blockIdx.x == 0) {
        __nanosleep(20000);
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        dst[i] = src[i] + 1.0f;
    }
}
"""


@gpu
@pytest.mark.parametrize("captured", [False, True], ids=["direct", "graph"])
def test_programmatic_dependent_launches_keep_the_stream_order(backend, tmp_path, rng, captured) -> None:  # noqa: ANN001
    from opdispatch.backends.cuda.graphs import stream_capture
    from opdispatch.backends.cuda.kernels import launcher, load_module, pdl_enabled

    path = tmp_path / "chain.cu"
    path.write_text(CHAIN)
    fn = load_module(path, ("chain_step",)).get_function("chain_step")
    n, steps = 1 << 16, 40
    bufs = [backend.alloc(4 * n, "a"), backend.alloc(4 * n, "b")]
    values = rng.uniform(-1, 1, n).astype(np.float32)
    backend.write(bufs[0], 0, values)
    launches = [launcher(fn, 64, 256, (np.uint64(bufs[(i + 1) % 2].ptr), np.uint64(bufs[i % 2].ptr), np.int32(n)),
                         stream=backend.stream, pdl=True) for i in range(steps)]
    assert all(launch.signature[-1] == pdl_enabled(backend.stream.device_id) for launch in launches)
    runner = GraphRunner("chain", [(f"step {i}", f) for i, f in enumerate(launches)],
                         stream_capture(backend.stream) if captured else None, "cuda")
    expected = values.copy()
    for _ in range(steps):
        expected += np.float32(1)
    for _ in range(2):  # with capture: the warm-up runs directly, the second run is the graph's replay
        backend.write(bufs[0], 0, values)
        with backend.cuda_device, backend.stream:
            runner("s")
        got = backend.read(bufs[steps % 2], 0, 4 * n).view(np.float32)
        assert np.array_equal(got, expected), np.flatnonzero(got != expected)[:8]
    assert runner.captures == (1 if captured else 0)


@gpu
def test_graph_runner_on_the_stream_recaptures_then_stops(backend, axpb_module, rng) -> None:  # noqa: ANN001
    from opdispatch.backends.cuda.graphs import stream_capture
    from opdispatch.backends.cuda.kernels import launcher

    n = 4096
    x, y = backend.alloc(4 * n, "x"), backend.alloc(4 * n, "y")
    fn = axpb_module.get_function("axpb<1>")
    launch = launcher(fn, n // 256, 256, (np.uint64(y.ptr), np.uint64(x.ptr), np.float32(-0.5), np.int32(n)),
                      stream=backend.stream)
    runner = GraphRunner("axpb segment", [("axpb 'y'", launch)], stream_capture(backend.stream), "cuda")
    signatures = ["s0", "s0", "s0", "s1", "s2", "s3", "s4", "s4"]
    for sig in signatures:
        values = rng.uniform(-1, 1, n).astype(np.float32)
        backend.write(x, 0, values)  # a replay reads what was written since
        with backend.cuda_device, backend.stream:
            runner(sig)
        assert np.array_equal(backend.read(y, 0, 4 * n).view(np.float32), -0.5 * values + 1), sig
    assert runner.captures == 1 + MAX_CONSECUTIVE_RECAPTURES
    assert runner.disabled


@gpu
def test_executor_runs_foreign_cupy_launches_on_its_stream_under_capture(backend, monkeypatch) -> None:  # noqa: ANN001
    import cupy

    monkeypatch.delenv("OPDISPATCH_DISABLE_CUDA_GRAPHS", raising=False)
    buf = backend.alloc(4 * 256, "doubled")
    backend.write(buf, 0, np.ones(256, np.float32))
    arr = backend.bind_context(lambda t: (buf, 0)).array(od.input("v", (256,)))

    def double() -> None:
        cupy.multiply(arr, 2, out=arr)  # a CuPy kernel, on the current stream

    segment = backend.executor([("double 'v'", double)])
    for run in range(1, 5):
        segment()
        assert np.array_equal(backend.read(buf, 0, 1024).view(np.float32), np.full(256, 2.0**run, np.float32))
    assert segment.runner.captures == 1 and not segment.runner.disabled
    assert isinstance(arr, cupy.ndarray)


@gpu
def test_executor_failure_names_the_launch_and_pending_names_segments(backend) -> None:  # noqa: ANN001
    def boom() -> None:
        raise RuntimeError("no such kernel")

    segment = backend.executor([("rms_norm 'y' (4, 8) f32 by cuda_norm:rms_norm_f32", boom)])
    with pytest.raises(LaunchError, match=r"rms_norm 'y' \(4, 8\) f32 by cuda_norm:rms_norm_f32 failed: "
                                          "RuntimeError: no such kernel"):
        segment()
    fine = backend.executor([("nothing 'z'", lambda: None)])
    fine()
    assert fine.runner.name in backend.pending
    backend.synchronize()
    assert not backend.pending


@gpu
def test_staged_upload_and_download_through_pinned_memory(backend, rng) -> None:  # noqa: ANN001
    import cupy

    host = backend.staging(8192)
    assert cupy.cuda.runtime.pointerGetAttributes(host.ctypes.data).type == cupy.cuda.runtime.memoryTypeHost
    block = backend.alloc(8192, "a block")
    part = backend.sub(block, 4096, 1000, "a part of it")
    data = rng.integers(0, 256, 8192, dtype=np.uint8)
    host[:] = data
    backend.upload(block, 0, host, 0, 8192)  # queued; nothing touches host before the synchronize
    back = backend.staging(1000)
    backend.download(back, 0, part, 0, 1000)
    backend.synchronize()
    assert np.array_equal(back, data[4096:5096])
    assert np.array_equal(backend.read(block, 0, 8192), data)
    with pytest.raises(ValueError, match="outside the 1000-byte buffer for a part of it"):
        backend.download(back, 0, part, 1, 1000)


@gpu
def test_plan_run_on_a_gpu_uploads_once_replays_and_matches_write_launch_read(rng, monkeypatch) -> None:  # noqa: ANN001
    from opdispatch import ops
    from opdispatch.backends.cuda.backend import CudaBackend

    calls: list[tuple[str, int]] = []
    for name in ("upload", "download", "write"):
        orig = getattr(CudaBackend, name)

        def spy(self, *args, _orig=orig, _name=name):  # noqa: ANN001, ANN202
            calls.append((_name, args[-1] if _name != "write" else args[-1].size))
            return _orig(self, *args)

        monkeypatch.setattr(CudaBackend, name, spy)
    x, w, idx = od.input("x", (6, 256)), od.input("w", (256,)), od.input("idx", (3,), "i32")
    y = ops.get_rows(ops.mul(ops.rms_norm(x, 1e-6), w), idx)
    plan = od.compile(y, "cuda0")
    runs = []
    for _ in range(4):  # bind, capture, replays: fresh inputs each time
        feeds = {x: rng.uniform(-1, 1, (6, 256)).astype(np.float32), w: rng.uniform(0.5, 1.5, 256).astype(np.float32),
                 idx: rng.permutation(6)[:3].astype(np.int32)}
        calls.clear()
        got = plan.run(feeds)[0]
        assert calls == [("upload", 6 * 256 * 4 + 256 * 4 + 256), ("download", 3 * 256 * 4)], calls  # x, w, idx padded
        xs = feeds[x] / np.sqrt(np.mean(feeds[x] ** 2, axis=-1, keepdims=True) + 1e-6) * feeds[w]
        np.testing.assert_allclose(got, xs[feeds[idx]], rtol=1e-5, atol=1e-6)
        runs.append((feeds, got))
    # the pieces agree with run, on the same buffers
    for t, v in runs[0][0].items():
        plan.write(t, v)
    plan.launch()
    np.testing.assert_array_equal(plan.read(y), runs[0][1])
    view = plan.run(runs[1][0], copy=False)[0]
    np.testing.assert_array_equal(view, runs[1][1])
    plan.run(runs[2][0], copy=False)
    np.testing.assert_array_equal(view, runs[2][1])  # the staging buffer, overwritten by the next run
