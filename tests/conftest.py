"""Shared test configuration: `@pytest.mark.gpu` tests skip, with the reason, where no GPU is usable; each test
plans afresh."""

from __future__ import annotations

import os
import weakref

import numpy as np
import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    from opdispatch.backends.cuda.devices import discover

    devices, why = discover()
    if devices:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {why}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty plan cache for every test: plans are cached by graph, not by the selection tables and
    configurations tests monkeypatch, so a plan made by an earlier test in the same process would be reused."""
    from opdispatch import compiler

    monkeypatch.setattr(compiler, "_CACHES", weakref.WeakKeyDictionary())


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, printed; OPDISPATCH_TEST_SEED replays one."""
    s = int(os.environ.get("OPDISPATCH_TEST_SEED", np.random.SeedSequence().entropy % 2**63))
    print(f"random seed {s}: replay with OPDISPATCH_TEST_SEED={s}")
    return s


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)
