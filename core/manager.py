"""The plugin manager: loading, validation, isolation and a visible order.

Plugins come from the entry-point group ``opdispatch`` (the built-ins too) or
from `register()`. Each is loaded on its own: one that fails to import or
whose hooks do not match the specs is named in a warning and left out
(``OPDISPATCH_STRICT_PLUGINS=1`` raises instead). Dispatch asks plugins one
by one in `order()`: priority (higher first), then name; `prefer` moves
plugins to the front, `exclude` drops them, and ``OPDISPATCH_PLUGINS`` does
both from the environment ("mine,cuda_norm,-cuda_misc"). The manager also
answers what is asked of the plugins as a whole: the devices, the device a
name means, a plugin's kernels, the fusion rules (names unique among them).
"""

from __future__ import annotations

import os
import re
import warnings
from importlib.metadata import entry_points
from typing import Any, Callable, Iterable, Sequence

import attrs
import pluggy

from .errors import PluginError
from .hookspecs import HOOK_NAMES, PROJECT, AbsentDevice, Device, FusionRule, Hooks, Kernel, PluginInfo
from .tensor import Tensor

ENTRY_POINT_GROUP = "opdispatch"

#: 'cpu0', 'cpu1', ...: the CPU device under another name, with memory of its own (see PluginManager.device)
_NUMBERED_CPU = re.compile(r"cpu(\d+)")


class PluginWarning(UserWarning):
    """A plugin was left out (not strict mode)."""


def strict_from_env() -> bool:
    return os.environ.get("OPDISPATCH_STRICT_PLUGINS", "") not in ("", "0")


@attrs.define(eq=False)
class Plugin:
    """A registered plugin: its name, info and hook functions."""

    name: str
    obj: Any
    info: PluginInfo
    origin: str  # "entry point <value>" or "registered"
    hooks: dict[str, Callable[..., Any]] = attrs.field(factory=dict)

    @property
    def priority(self) -> int:
        return self.info.priority


@attrs.define(eq=False)
class PluginManager:
    """Holds plugins and asks them, one by one, in a deterministic order."""

    strict: bool = attrs.field(factory=strict_from_env)
    pm: pluggy.PluginManager = attrs.field(init=False)
    plugins: dict[str, Plugin] = attrs.field(init=False, factory=dict)
    #: (name, reason) of plugins left out at load time
    skipped: list[tuple[str, str]] = attrs.field(init=False, factory=list)
    #: bumped whenever plugins are registered or unregistered: caches of their answers
    #: (the compiler's plans) keep the generation they were made in
    generation: int = attrs.field(init=False, default=0)
    _kernels: dict[tuple[str, str], dict[str, list[Kernel]]] = attrs.field(init=False, factory=dict)
    _numbered_cpus: dict[str, Device] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(Hooks)

    # -- loading ----------------------------------------------------------------
    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Load every entry point of `group`, each isolated from the others."""
        for ep in sorted(entry_points(group=group), key=lambda e: e.name):
            if ep.name in self.plugins:
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure isolates the plugin
                self._reject(ep.name, f"failed to import {ep.value}: {type(exc).__name__}: {exc}")
                continue
            self.register(obj, ep.name, origin=f"entry point {ep.value}")

    def register(self, obj: Any, name: str | None = None, *, origin: str = "registered") -> Plugin | None:
        """Register a plugin object (module, class instance); None if it was left out."""
        name = name or getattr(obj, "__name__", None) or type(obj).__name__
        if name in self.plugins:
            self._reject(name, "a plugin of that name is already registered")
            return None
        try:
            self.pm.register(obj, name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            self._reject(name, f"hooks do not match the specs: {exc}")
            return None
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(name=name)
            self._reject(name, f"unknown hook: {exc}")
            return None
        hooks = {
            hook_name: impl.function
            for hook_name in HOOK_NAMES
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls()
            if impl.plugin_name == name
        }
        info = PluginInfo(name=name)
        if "plugin_info" in hooks:
            try:
                info = hooks["plugin_info"]()
                if not isinstance(info, PluginInfo):
                    raise TypeError(f"plugin_info returned {type(info).__name__}, expected PluginInfo")
            except Exception as exc:  # noqa: BLE001
                self.pm.unregister(name=name)
                self._reject(name, f"plugin_info raised {type(exc).__name__}: {exc}")
                return None
        plugin = Plugin(info.name if info.name else name, obj, info, origin, hooks)
        self.plugins[plugin.name] = plugin
        self._changed()
        return plugin

    def unregister(self, name: str) -> None:
        plugin = self.plugins.pop(name)
        self.pm.unregister(plugin.obj)
        self._changed()

    def _changed(self) -> None:
        self._kernels.clear()
        self.generation += 1

    def _reject(self, name: str, reason: str) -> None:
        if self.strict:
            raise PluginError(f"plugin '{name}' {reason}")
        self.skipped.append((name, reason))
        warnings.warn(f"opdispatch: plugin '{name}' left out: {reason}", PluginWarning, stacklevel=3)

    # -- order --------------------------------------------------------------------
    def order(self, prefer: Sequence[str] = (), exclude: Iterable[str] = ()) -> list[Plugin]:
        """Plugins in the order dispatch asks them.

        Default: priority (higher first), then name. The environment's
        ``OPDISPATCH_PLUGINS`` applies first, then the caller's prefer/exclude.
        """
        env = [s.strip() for s in os.environ.get("OPDISPATCH_PLUGINS", "").split(",") if s.strip()]
        env_prefer = [s for s in env if not s.startswith("-")]
        env_exclude = [s[1:] for s in env if s.startswith("-")]
        excluded = set(exclude) | set(env_exclude)
        front = list(prefer) + [n for n in env_prefer if n not in prefer]
        for n in [*front, *excluded]:
            if n not in self.plugins:
                raise PluginError(f"unknown plugin '{n}' in prefer/exclude (known: {', '.join(sorted(self.plugins))})")
        ranked = sorted(self.plugins.values(), key=lambda p: (-p.priority, p.name))
        head = [self.plugins[n] for n in front if n not in excluded]
        return head + [p for p in ranked if p.name not in excluded and p.name not in front]

    # -- asking -------------------------------------------------------------------
    def call(self, plugin: Plugin, hook: str, **kwargs: Any) -> Any:
        """Call one plugin's hook; a raise is wrapped in PluginError naming plugin and hook."""
        fn = plugin.hooks.get(hook)
        if fn is None:
            return None
        try:
            return fn(**kwargs)
        except Exception as exc:  # noqa: BLE001 - isolate the plugin, name it
            raise PluginError(f"plugin '{plugin.name}' raised in {hook}: {type(exc).__name__}: {exc}") from exc

    def guarded(self, plugin: Plugin, hook: str, default: Any, **kwargs: Any) -> tuple[Any, str | None]:
        """Like `call`, but in non-strict mode a raise becomes (default, reason)."""
        try:
            return self.call(plugin, hook, **kwargs), None
        except PluginError as exc:
            if self.strict:
                raise
            warnings.warn(f"opdispatch: {exc}", PluginWarning, stacklevel=3)
            return default, str(exc)

    def first_result(self, plugins: Sequence[Plugin], hook: str, **kwargs: Any) -> tuple[Any, Plugin | None]:
        """The first answer that is not None of `plugins`, in order, to a `firstresult` hook, and who
        gave it ((None, None): no opinion); the plugins after it are not asked."""
        if not getattr(self.pm.hook, hook).spec.opts["firstresult"]:
            raise TypeError(f"hook {hook} is not declared firstresult: ask plugins one by one")
        for plugin in plugins:
            answer, _ = self.guarded(plugin, hook, None, **kwargs)
            if answer is not None:
                return answer, plugin
        return None, None

    # -- devices --------------------------------------------------------------------
    def devices(self) -> list[Device]:
        """Every device the plugins bring, in plugin order, names unique."""
        found: dict[str, Device] = {}
        for plugin in self.order():
            got, _ = self.guarded(plugin, "devices", None)
            for dev in flatten(got, Device, plugin.name):
                found.setdefault(dev.name, dev)
        return list(found.values())

    def absent_devices(self) -> list[AbsentDevice]:
        """Devices the plugins bring but did not find here (why, and a description to plan for)."""
        absent = []
        for plugin in self.order():
            got, _ = self.guarded(plugin, "absent_devices", None)
            absent += flatten(got, AbsentDevice, plugin.name)
        return absent

    def device(self, which: str | Device | None = None) -> Device:
        """A device by name ('cpu', 'cuda0') or kind ('cuda': the first of that kind); None: the
        best there is, the first GPU, else the CPU.

        'cpu0', 'cpu1', ... (names no plugin's device takes) are the CPU device with memory of its own
        each: they run the CPU's kernels, but values move between them and the CPU by copies, as between
        GPUs, so that a graph split over devices runs, and is tested, on a machine without any."""
        if isinstance(which, Device):
            return which
        devices = self.devices()
        if which is None:
            gpus = [d for d in devices if d.kind == "cuda"]
            return gpus[0] if gpus else self.cpu()
        for d in devices:
            if d.name == which:
                return d
        of_kind = [d for d in devices if d.kind == which]
        if of_kind:
            return of_kind[0]
        if isinstance(which, str) and _NUMBERED_CPU.fullmatch(which):
            if which not in self._numbered_cpus:  # one object per name: plans are cached by device identity
                self._numbered_cpus[which] = attrs.evolve(
                    self.cpu(), name=which, host_memory=False,
                    description=f"{self.cpu().description}, memory of its own (a stand-in for a second device)")
            return self._numbered_cpus[which]
        raise ValueError(f"unknown device '{which}' (known: {', '.join(d.name for d in devices)})")

    def cpu(self) -> Device:
        """The CPU device: where a node that no plugin takes elsewhere runs."""
        devices = self.devices()
        for d in devices:
            if d.name == "cpu":
                return d
        raise ValueError(f"no 'cpu' device: is the cpu plugin installed? (known: {', '.join(d.name for d in devices)})")

    # -- kernels and fusion rules -----------------------------------------------------
    def kernels(self, plugin: Plugin, device: Device) -> dict[str, list[Kernel]]:
        """A plugin's kernels for `device`, by op (cached)."""
        key = (plugin.name, device.name)
        if key not in self._kernels:
            got, _ = self.guarded(plugin, "kernels", None, device=device)
            table: dict[str, list[Kernel]] = {}
            for k in flatten(got, Kernel, plugin.name):
                table.setdefault(k.op, []).append(k)
            self._kernels[key] = table
        return self._kernels[key]

    def fusion_rules(self, plugins: Sequence[Plugin], device: Device) -> list[tuple[Plugin, FusionRule]]:
        """Fusion rules of `plugins` for `device`, in plugin order.

        A rule name is what explain() and the plan say fused a group, so it must name one rule:
        a second rule of a name already yielded is rejected, the error naming both plugins
        (strict mode raises; otherwise a warning, and the first rule stays).
        """
        rules: list[tuple[Plugin, FusionRule]] = []
        owner: dict[str, Plugin] = {}
        for plugin in plugins:
            got, _ = self.guarded(plugin, "fusion_rules", None, device=device)
            for rule in flatten(got, FusionRule, plugin.name):
                first = owner.get(rule.name)
                if first is not None:
                    self._conflict(f"fusion rule '{rule.name}' of plugin '{plugin.name}' is rejected: plugin "
                                   f"'{first.name}' already yields a rule of that name")
                    continue
                owner[rule.name] = plugin
                rules.append((plugin, rule))
        return rules

    def _conflict(self, msg: str) -> None:
        if self.strict:
            raise PluginError(msg)
        warnings.warn(f"opdispatch: {msg}", PluginWarning, stacklevel=3)

    # -- per node -------------------------------------------------------------------------
    def supports(self, plugin: Plugin, device: Device, node: Tensor) -> tuple[Kernel | None, str]:
        """(kernel, "") if `plugin` accepts `node` on `device`, else (None, reason)."""
        gate, err = self.guarded(plugin, "supports_op", False, device=device, node=node)
        if err:
            return None, err
        if gate is False or isinstance(gate, str):
            return None, gate or "declined"
        candidates = self.kernels(plugin, device).get(node.op, [])
        if not candidates:
            return None, ""  # no kernel for this op: the common, silent decline
        reasons = []
        for k in candidates:
            try:
                answer = k.supports(device, node)
            except Exception as exc:  # noqa: BLE001
                err = f"plugin '{plugin.name}' raised in supports of {k.label}: {type(exc).__name__}: {exc}"
                if self.strict:
                    raise PluginError(err) from exc
                warnings.warn(f"opdispatch: {err}", PluginWarning, stacklevel=2)
                reasons.append(err)
                continue
            if answer is True:
                return k, ""
            reasons.append(answer if isinstance(answer, str) and answer else "declined")
        return None, "; ".join(dict.fromkeys(reasons))  # several kernels may give one reason


def flatten(records: object, kind: type, plugin: str) -> list:
    """A hook's answer as a list of `kind` records; a wrong type names the plugin."""
    if records is None:
        return []
    items = [records] if isinstance(records, kind) else list(records)  # type: ignore[call-overload]
    for r in items:
        if not isinstance(r, kind):
            raise TypeError(f"plugin '{plugin}' returned {type(r).__name__}, expected {kind.__name__}")
    return items


_default: PluginManager | None = None


def manager() -> PluginManager:
    """The process-wide manager, with every entry point loaded (on first use)."""
    global _default
    if _default is None:
        m = PluginManager()
        m.load_entry_points()
        _default = m
    return _default
