"""Device scratch memory: one pool per backend, one buffer per role, shared by every launch.

Launches on a GPU run in the order of its one stream (a kernel launched with
PDL touches memory only after `od::grid_enter()`, once the kernel ahead has
finished), so every node can use the same buffer for a role: the pool hands
out the role's buffer, grown when a node needs more. A bind keeps the buffers
it was given alive with its launch (`launch_specs(..., keep)`), so a plan
bound before a role grew keeps its smaller buffer.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

#: the smallest buffer the pool allocates for a role, so that small nodes do not grow it one by one
MIN_BYTES = 1 << 20


@attrs.frozen
class Workspace:
    """Scratch a launch needs (partials, tile flags, counters): bytes, its role (what for), and
    whether it must start zeroed. Zeroed roles hold counters the kernels set back to 0 when done
    ("the last block finishes the job"), so every later launch and CUDA-graph replay finds them so."""

    nbytes: int
    what: str
    zeroed: bool = False


@attrs.define(eq=False)
class ScratchPool:
    """The scratch buffers of one backend, by role (`Workspace.what`)."""

    alloc: Callable[[int, str], Any]
    fill: Callable[[Any, int], None]
    _buffers: dict[str, tuple[Any, bool]] = attrs.field(init=False, factory=dict)

    def take(self, space: Workspace) -> Any:
        """The buffer of `space`'s role, at least `space.nbytes` long (a new one, zeroed if asked, when
        the role has none that large). A role is zeroed or not for all its users."""
        held = self._buffers.get(space.what)
        if held is not None and held[1] != space.zeroed:
            raise ValueError(f"scratch role '{space.what}' is asked for both zeroed and not zeroed")
        if held is None or held[0].nbytes < space.nbytes:
            buf = self.alloc(max(space.nbytes, MIN_BYTES), f"scratch '{space.what}'")
            if space.zeroed:
                self.fill(buf, 0)
            self._buffers[space.what] = held = (buf, space.zeroed)
        return held[0]

    def take_all(self, spaces: tuple[Workspace, ...]) -> tuple[Any, ...]:
        return tuple(self.take(w) for w in spaces)
