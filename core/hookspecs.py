"""The plugin contract: the hooks a plugin implements and the records they yield.

A plugin is a module (or object) registered under the entry-point group
``opdispatch``; it implements some of the hooks below, each marked with
``@opdispatch.hookimpl``. The manager asks plugins one by one, in a visible
order (priority, then `prefer`/`exclude`), never through pluggy's own
last-registered-first call order.

A minimal plugin that runs `neg` on the CPU with its own numpy kernel::

    # my_plugin.py  (pyproject: [project.entry-points.opdispatch] my = "my_plugin")
    import opdispatch
    from opdispatch import Kernel, PluginInfo

    @opdispatch.hookimpl
    def plugin_info():
        return PluginInfo(name="my", version="1.0")       # priority 200 by default

    def bind_neg(ctx, node):
        out, x = ctx.array(node), ctx.array(node.srcs[0])
        return lambda: opdispatch.reference.store(out, -x, node)

    @opdispatch.hookimpl
    def kernels(device):
        if device.kind == "cpu":
            yield Kernel(op="neg", bind=bind_neg,
                         supports=lambda dev, n: n.dtype.name == "f32" or "f32 only")
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import attrs
import pluggy

from .backends.base import BindContext, Device, Launch
from .fusion import FusionRule
from .tensor import Tensor

PROJECT = "opdispatch"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Order among plugins: higher is asked first.
PRIORITY_BUILTIN = 100
PRIORITY_THIRD_PARTY = 200
PRIORITY_REFERENCE = 0


def always(device: Device, node: Tensor) -> bool | str:
    return True


@attrs.frozen
class PluginInfo:
    """Who a plugin is: shown by `opdispatch info` and in `Plan.explain()`."""

    name: str
    version: str = ""
    priority: int = PRIORITY_THIRD_PARTY
    description: str = ""


@attrs.frozen
class Kernel:
    """A kernel for one op: `supports` decides per node, `bind` pre-binds a launch.

    `supports(device, node)` returns True or a short reason for declining.
    `bind(ctx, node)` runs once at plan time and returns a zero-argument
    launch that does no per-node Python work beyond the launch itself.
    """

    op: str
    bind: Callable[[BindContext, Tensor], Launch]
    supports: Callable[[Device, Tensor], bool | str] = always
    name: str = ""  # which variant, for explain(): "mmvq", "cublas", ...

    @property
    def label(self) -> str:
        return self.name or self.op


class Hooks:
    """Hook specifications; every hook is optional for a plugin."""

    @hookspec
    def plugin_info(self) -> PluginInfo:
        """Name, version and priority. Without it the plugin is named after its
        entry point and gets the third-party priority (above the built-ins)."""

    @hookspec
    def devices(self) -> Iterable[Device]:
        """Devices this plugin brings (a backend plugin)::

            @hookimpl
            def devices():
                return [Device("toy0", "toy", backend_factory=ToyBackend, host_memory=True)]
        """

    @hookspec
    def kernels(self, device: Device) -> Iterable[Kernel]:
        """Kernels this plugin can run on `device` (yield nothing for other kinds)::

            @hookimpl
            def kernels(device):
                if device.kind == "cuda":
                    yield Kernel("rms_norm", bind=bind_rms_norm, supports=rms_norm_ok)
        """

    @hookspec
    def fusion_rules(self, device: Device) -> Iterable[FusionRule]:
        """Fusion rules for `device`: a pattern of consecutive ops, a check, a bind::

            @hookimpl
            def fusion_rules(device):
                yield FusionRule("rms_norm_mul", ("rms_norm", "mul"), check=weight_ok, bind=bind_fused)
        """

    @hookspec
    def supports_op(self, device: Device, node: Tensor) -> bool | str | None:
        """A plugin-wide gate asked before its kernels' own predicates: True or
        None to go on, False or a reason to decline every kernel for `node`::

            @hookimpl
            def supports_op(device, node):
                return device.props.get("cc", (0, 0)) >= (8, 0) or "needs sm_80"
        """

    @hookspec
    def offload_op(self, device: Device, node: Tensor) -> bool | None:
        """Is `node` worth running on `device` although its weights live on the
        host (copying them over)? ggml's rule: batch >= 32. None: no opinion::

            @hookimpl
            def offload_op(device, node):
                if device.kind == "cuda":
                    return batch_size(node) >= 32
        """


def flatten(records: object, kind: type, plugin: str) -> list:
    """A hook's answer as a list of `kind` records; a wrong type names the plugin."""
    if records is None:
        return []
    items = [records] if isinstance(records, kind) else list(records)  # type: ignore[call-overload]
    for r in items:
        if not isinstance(r, kind):
            raise TypeError(f"plugin '{plugin}' returned {type(r).__name__}, expected {kind.__name__}")
    return items


__all__: Sequence[str] = [
    "Hooks", "hookimpl", "hookspec", "Kernel", "PluginInfo", "FusionRule", "always",
    "PRIORITY_BUILTIN", "PRIORITY_THIRD_PARTY", "PRIORITY_REFERENCE", "flatten",
]
