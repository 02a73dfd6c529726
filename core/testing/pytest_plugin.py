"""pytest plugin: the conformance sweep as parametrized tests, for plugin authors.

    pytest -p opdispatch.testing.pytest_plugin --opdispatch-device cuda0 --opdispatch-plugin mine

    # test_mine.py
    def test_conformance(opdispatch_case):
        opdispatch_case.check()  # skips what the device does not run, fails with the NMSE and seed

Options: --opdispatch-device (default: the first GPU, else cpu),
--opdispatch-op (repeatable or comma-separated; default: every op and fused
pattern), --opdispatch-plugin (the plugin under test: asked first, and a node
it declines is a skip), --opdispatch-full (the whole sweep). Groups without
cases become skipped tests that say so. Cases on a CUDA device carry the
`gpu` marker, which this plugin defines.
"""

from __future__ import annotations

import attrs
import pytest

from ..manager import manager
from .cases import Case, sweep
from .harness import Result, Status, run_case


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("opdispatch", "opdispatch conformance sweep")
    group.addoption("--opdispatch-device", default=None, help="device under test (default: the first GPU, else cpu)")
    group.addoption("--opdispatch-op", action="append", default=[], metavar="OP",
                    help="op or fused pattern to test (repeatable or comma-separated; default: all)")
    group.addoption("--opdispatch-plugin", default=None, help="the plugin under test (asked first)")
    group.addoption("--opdispatch-full", action="store_true", help="the whole sweep instead of the quick one")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU with CuPy; skipped with a reason elsewhere")


@attrs.frozen
class ConformanceCase:
    """A case bound to the device and plugin under test."""

    case: Case
    device: str | None = None  # None: the first GPU, else cpu
    plugin: str | None = None

    def run(self) -> Result:
        return run_case(self.case, self.device, plugin=self.plugin)

    def check(self) -> Result:
        """Run; skip when the device (or plugin) does not run the node, fail with the details otherwise."""
        r = self.run()
        if r.status is Status.UNSUPPORTED:
            pytest.skip(r.describe())
        if r.status is Status.FAIL:
            pytest.fail(r.describe(), pytrace=False)
        return r


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "opdispatch_case" not in metafunc.fixturenames:
        return
    opt = metafunc.config.getoption
    selected = [name for item in opt("--opdispatch-op") for name in item.split(",") if name]
    marks = [pytest.mark.gpu] if manager().device(opt("--opdispatch-device")).kind == "cuda" else []
    params = []
    for group, group_cases in sweep(selected, opt("--opdispatch-full")).items():
        if not group_cases:
            params.append(pytest.param(None, id=f"{group}[no cases]",
                                       marks=pytest.mark.skip(reason=f"{group}: no cases (no generator)")))
        params += [pytest.param(c, id=c.name, marks=marks) for c in group_cases]
    metafunc.parametrize("opdispatch_case", params, indirect=True)


@pytest.fixture
def opdispatch_case(request: pytest.FixtureRequest) -> ConformanceCase:
    """One conformance case on the device and plugin the command line names; call `.check()`."""
    opt = request.config.getoption
    return ConformanceCase(request.param, opt("--opdispatch-device"), opt("--opdispatch-plugin"))
