"""Every kernel's argument record against the kernel's own parameter list, and every launched kernel has one.

A plugin's `KernelArgs` subclasses name the `__global__` functions they serve (`KERNELS`);
the parameter names, in order, are read from the plugin's kernels/*.cu (macros of parameter
groups expanded) and must equal the record's fields (ArgGroup fields expanded), and the numpy scalars its
converters make must be the parameters' C types' (kernels.kernel_param_types).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import attrs
import numpy as np
import pytest

from opdispatch.backends.cuda.args import ArgGroup, KernelArgs
from opdispatch.backends.cuda.kernels import kernel_param_types, kernel_params

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "kernels").is_dir())


def modules(plugin: str) -> list:
    package = importlib.import_module(f"opdispatch.plugins.{plugin}")
    return [package] + [importlib.import_module(m.name)
                        for m in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")]


def records(plugin: str) -> list[type[KernelArgs]]:
    """The KernelArgs subclasses defined in the plugin's modules."""
    found = {cls for module in modules(plugin) for _, cls in inspect.getmembers(module, inspect.isclass)
             if issubclass(cls, KernelArgs) and cls.__module__.startswith(f"opdispatch.plugins.{plugin}")}
    return sorted(found, key=lambda c: c.__qualname__)


def heads(plugin: str) -> dict[str, list[tuple[str, tuple[str, ...], tuple[type, ...]]]]:
    """kernel name -> [(file, parameter names, their numpy scalar types)] over the plugin's .cu files."""
    out: dict[str, list[tuple[str, tuple[str, ...], tuple[type, ...]]]] = {}
    for cu in sorted((ROOT / "plugins" / plugin / "kernels").glob("*.cu")):
        types = kernel_param_types(cu.resolve())
        for name, params in kernel_params(cu.resolve()).items():
            out.setdefault(name, []).append((cu.name, params, types[name]))
    return out


def ones(record: type) -> object:
    """`record` with every argument 1 (True for a bool), its groups' too."""
    fields = attrs.fields(attrs.resolve_types(record))
    return record(**{f.alias: ones(f.type) if issubclass(f.type, ArgGroup) else True if f.type is np.bool_ else 1
                     for f in fields})


@pytest.mark.parametrize("plugin", PLUGINS)
def test_records_follow_the_kernel_heads(plugin: str) -> None:
    kernels = heads(plugin)
    for cls in records(plugin):
        assert cls.KERNELS, f"{cls.__qualname__} names no kernel (KERNELS)"
        types = tuple(type(v) for v in ones(cls).values())
        for kernel in cls.KERNELS:
            assert kernel in kernels, f"{cls.__qualname__}: no __global__ {kernel} in {plugin}/kernels"
            for cu, params, want in kernels[kernel]:
                assert cls.names() == params, (f"{cls.__qualname__} fields {cls.names()} differ from {cu}'s "
                                               f"{kernel} parameters {params}")
                assert types == want, f"{cls.__qualname__}'s argument types differ from {cu}'s {kernel} parameters"


@pytest.mark.parametrize("plugin", PLUGINS)
def test_every_kernel_has_a_record(plugin: str) -> None:
    """Each `__global__` kernel of the plugin's .cu files, and so each one it launches, has its record."""
    covered = {kernel for cls in records(plugin) for kernel in cls.KERNELS}
    assert set(heads(plugin)) - covered == set(), f"{plugin}: kernels without a KernelArgs record"
    specs = importlib.import_module(f"opdispatch.plugins.{plugin}.specs")
    launched = {name.split("<")[0].strip() for names in specs.KERNEL_SOURCES.values() for name in names}
    assert launched <= set(heads(plugin)), f"{plugin}: KERNEL_SOURCES names kernels the .cu files lack"
