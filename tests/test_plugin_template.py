"""The plugin template of docs/plugins.md (docs/template/leaky_cuda): a fifth CUDA plugin written with the kit.

Registered beside the built-ins, it takes leaky_relu (and fuses scale -> leaky_relu) on the H200
description; its kernel compiles with nvcc, its argument record follows the kernel's head, and on
a GPU it matches the reference. docs/plugins.md shows these files; the test checks that it shows
them as they are.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import opdispatch as od
from opdispatch import ops
from opdispatch.backends.cuda.devices import H200
from opdispatch.backends.cuda.kernels import kernel_params
from opdispatch.manager import PluginManager
from opdispatch.testing.metrics import nmse

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "docs" / "template"
FILES = ("__init__.py", "support.py", "fusion.py", "specs.py", "bind.py", "kernels/leaky.cu")


@pytest.fixture(scope="module")
def leaky():  # noqa: ANN201
    sys.path.insert(0, str(TEMPLATE))
    try:
        yield importlib.import_module("leaky_cuda")
    finally:
        sys.path.remove(str(TEMPLATE))


@pytest.fixture()
def plugins(leaky) -> PluginManager:  # noqa: ANN001
    mgr = PluginManager(strict=True)
    mgr.load_entry_points()
    mgr.register(leaky, "leaky_cuda")
    return mgr


def test_docs_show_the_template_files_as_they_are() -> None:
    text = (ROOT / "docs" / "plugins.md").read_text()
    for name in FILES:
        body = (TEMPLATE / "leaky_cuda" / name).read_text().strip()
        assert body in text, f"docs/plugins.md does not show docs/template/leaky_cuda/{name} as it is"


def test_the_plan_on_the_h200_description(plugins: PluginManager) -> None:
    x = od.input("x", (64, 100))
    plan = od.compile(ops.leaky_relu(ops.scale(x, 0.5), 0.1), H200, plugins=plugins)
    (step,) = [s for s in plan.steps if s.kind in ("kernel", "fused")]
    assert (step.kind, step.plugin, step.device.name) == ("fused", "leaky_cuda", "cuda0")
    assert "scale_leaky_relu" in plan.explain()
    biased = od.compile(ops.leaky_relu(ops.scale(x, 0.5, 1.0)), H200, plugins=plugins)
    assert "the scale adds a bias" in biased.explain()
    (leaky_step,) = [s for s in biased.steps if s.nodes[0].op == "leaky_relu"]
    assert leaky_step.plugin == "leaky_cuda"
    strided = od.compile(ops.leaky_relu(x.permute(1, 0)), H200, plugins=plugins)
    (declined,) = [s for s in strided.steps if s.nodes[0].op == "leaky_relu"]
    assert ("leaky_cuda", "x and the result must be contiguous") in declined.declined


def test_spec_and_record(leaky) -> None:  # noqa: ANN001
    from leaky_cuda import specs

    spec = specs.leaky_spec(0x1000, 0x2000, 1000, 0.1, 2.0)
    assert (spec.kernel, spec.grid, spec.block) == ("leaky_f32<256>", 4, 256)
    assert specs.LeakyArgs.names() == kernel_params(specs.LEAKY_CU)["leaky_f32"]
    assert [type(v) for v in spec.arg_values] == [np.uint64, np.uint64, np.int32, np.float32, np.float32]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: CUDA sources cannot be compiled here")
def test_the_kernel_compiles_with_nvcc(leaky, tmp_path: Path) -> None:  # noqa: ANN001
    from leaky_cuda import specs

    refs = "".join(f"(void*)&{name}, " for name in specs.KERNEL_SOURCES[specs.LEAKY_CU])
    wrapper = tmp_path / "w.cu"
    wrapper.write_text(f'#include "{specs.LEAKY_CU}"\nvoid* const od_instances[] = {{{refs}nullptr}};\n')
    cmd = ["nvcc", "-arch=sm_90", "-std=c++17", f"-I{ROOT / 'core' / 'backends' / 'cuda'}", "-c", str(wrapper),
           "-o", str(tmp_path / "w.o")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.gpu
def test_runs_on_the_gpu_as_the_reference(plugins: PluginManager, rng) -> None:  # noqa: ANN001
    x = od.input("x", (33, 129))
    y = ops.leaky_relu(ops.scale(x, -1.5), 0.2)
    values = rng.uniform(-10, 10, x.shape).astype(np.float32)
    (got,) = od.compile(y, "cuda0", plugins=plugins).run({x: values})
    (want,) = od.compile(y, "cpu", plugins=plugins).run({x: values})
    assert re.search("leaky_cuda", od.compile(y, "cuda0", plugins=plugins).explain())
    assert nmse(got, want) <= 1e-7 and np.isfinite(got).all()
