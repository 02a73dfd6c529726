"""The plugin contract: the hooks a plugin implements and every record they yield.

A plugin is a module (or object) registered under the entry-point group
``opdispatch`` that implements some of the hooks of `Hooks`, each marked with
``@opdispatch.hookimpl``; README.md and docs/plugins.md show one. The records
live here, beside the hooks, and this module imports nothing of the
dispatcher at run time: a plugin depends on the contract, not on how dispatch
asks it. The manager asks plugins one by one in a visible order (priority,
then `prefer`/`exclude`), never through pluggy's last-registered-first calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

import attrs
import pluggy

if TYPE_CHECKING:
    from .backends.base import Backend, BindContext
    from .graph import Graph
    from .tensor import Tensor

PROJECT = "opdispatch"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Order among plugins: higher is asked first.
PRIORITY_BUILTIN = 100
PRIORITY_THIRD_PARTY = 200
PRIORITY_REFERENCE = 0


@attrs.frozen
class Device:
    """A place to run kernels: 'cpu', 'cuda0', or a plugin's own kind.

    A plain description, so that plans and support predicates can be computed
    and tested without the hardware; `backend_factory` makes the Backend that
    allocates and runs, on first use.
    """

    name: str
    kind: str  # "cpu", "cuda", or a plugin's kind
    description: str = ""
    #: facts support predicates read: compute capability, smem per block, ...
    props: dict[str, Any] = attrs.field(factory=dict, hash=False, eq=False)
    #: makes the Backend; None for a description only (planning, tests)
    backend_factory: Callable[[Device], Backend] | None = attrs.field(default=None, hash=False, eq=False, repr=False)
    #: host-memory devices share numpy storage with the CPU (no copies needed)
    host_memory: bool = False

    def __str__(self) -> str:
        return self.name


@attrs.frozen
class AbsentDevice:
    """A device a plugin brings but found none of here: why, and a description of one
    (no backend) that plans and the support matrix can still be made for."""

    stand_in: Device
    why: str


class Launch(Protocol):
    """A pre-bound kernel launch: all buffers, sizes and arguments fixed at plan time."""

    def __call__(self) -> None: ...


@attrs.frozen
class PluginInfo:
    """Who a plugin is: shown by `opdispatch info` and in `Plan.explain()`."""

    name: str
    version: str = ""
    priority: int = PRIORITY_THIRD_PARTY
    description: str = ""


def always(device: Device, node: Tensor) -> bool | str:
    return True


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


#: One position of a fusion pattern: an op, or a set of ops any of which matches there.
PatternOp = str | frozenset[str]


def _pattern(ops: Iterable[str | Iterable[str]]) -> tuple[PatternOp, ...]:
    """Positions as given: a string stays one op, any other collection becomes a frozenset."""
    return tuple(p if isinstance(p, str) else frozenset(p) for p in ops)


def _op_set(ops: str | Iterable[str]) -> frozenset[str]:
    """An op name or a collection of them, as a set."""
    return frozenset((ops,) if isinstance(ops, str) else ops)


def _accept(device: Device, nodes: Sequence[Tensor], graph: Graph) -> bool | str:
    return True


@attrs.frozen
class FusionRule:
    """`pattern` ops, in execution order, run by one `bind`-ed launch.

    A position of `pattern` is an op name or a set of them (`("rope", {"view",
    "reshape"}, "set_rows")`). `check(device, nodes, graph)` returns True or a
    reason not to fuse (types, shapes, broadcasting the fused kernel cannot
    handle). `bind(ctx, nodes)` returns one launch that writes the last node's
    output, and the outputs of the nodes at the pattern positions in `outputs`:
    those may be read outside the group (ggml's top-k MoE router also writes
    the expert ids). Names are unique among the plugins asked.

    `hoist`: ops that may come between the pattern's nodes when they are independent of the group
    (they read nothing it computes or writes, `fusion.hoistable`); those nodes then run before the
    group. Llama's separate k and v projections (mul_mat, reshape) land inside the q/k/v group that
    way: `hoist=("mul_mat", "reshape", "view")`. Empty (the default): the nodes are consecutive.
    """

    name: str
    pattern: tuple[PatternOp, ...] = attrs.field(converter=_pattern)
    bind: Callable[[BindContext, Sequence[Tensor]], Launch]
    check: Callable[[Device, Sequence[Tensor], Graph], bool | str] = _accept
    outputs: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    hoist: frozenset[str] = attrs.field(default=frozenset(), converter=_op_set)

    def __attrs_post_init__(self) -> None:
        if len(self.pattern) < 2:
            raise ValueError(f"fusion rule '{self.name}': a pattern needs at least two ops")
        if any(isinstance(p, frozenset) and (not p or not all(isinstance(o, str) for o in p)) for p in self.pattern):
            raise ValueError(f"fusion rule '{self.name}': a set in the pattern needs one or more op names")
        if any(not 0 <= j < len(self.pattern) - 1 for j in self.outputs):
            raise ValueError(f"fusion rule '{self.name}': outputs {self.outputs} must be positions "
                             f"before the last of its {len(self.pattern)} ops")
        if not all(isinstance(o, str) for o in self.hoist):
            raise ValueError(f"fusion rule '{self.name}': hoist must be op names, got {sorted(map(repr, self.hoist))}")


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
    def absent_devices(self) -> Iterable[AbsentDevice]:
        """Devices this plugin brings but did not find here, each with why and a
        description to plan for (`opdispatch info` and `opdispatch ops` show them)::

            @hookimpl
            def absent_devices():
                if not found:
                    yield AbsentDevice(Device("toy0", "toy", "a toy (description)"), "no toy plugged in")
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
        """Fusion rules for `device`: a pattern of ops in execution order, a check, a bind::

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

    @hookspec(firstresult=True)
    def offload_op(self, device: Device, node: Tensor) -> bool | str | None:
        """Is `node` worth running on `device` although weights it reads live on the
        host (copying them over)? True, False or a reason not to, None for no
        opinion; the first plugin in order with an opinion decides, and without
        one the node stays on the host. The CUDA plugin answers ggml's rule::

            @hookimpl
            def offload_op(device, node):
                if device.kind == "cuda":
                    return batch_size(node) >= 32 or "batch below offload threshold"
        """


#: every hook of the contract, read off the specs
HOOK_NAMES: tuple[str, ...] = tuple(name for name, fn in vars(Hooks).items() if hasattr(fn, f"{PROJECT}_spec"))


__all__: Sequence[str] = [
    "Hooks", "HOOK_NAMES", "hookimpl", "hookspec", "Device", "AbsentDevice", "Launch", "Kernel", "PluginInfo",
    "FusionRule", "PatternOp", "always", "PRIORITY_BUILTIN", "PRIORITY_THIRD_PARTY", "PRIORITY_REFERENCE",
]
