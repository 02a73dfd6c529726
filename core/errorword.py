"""The error word of a plan's index-reading kernels, and the named error a set word becomes.

A kernel that takes indices from data (get_rows' rows, set_rows' destination rows, mul_mat_id's
experts) checks each before it dereferences it (common.cuh's `od::index_ok`) and records the
first bad one in the plan's error word on that device: 4 u64 `[tag + 1, position, value,
spare]`, zero while all is well. The word lies in host-mapped memory, so the host reads it
after a synchronize at no cost: no copy is queued. The tag is an `IndexUse` registered at bind
(`IndexTable.register`: the node, the index tensor, the valid range); `IndexTable.check`, called
where the plan synchronizes, clears a set word and raises DeviceIndexError naming them.
OPDISPATCH_CHECK_INDICES=0 at bind time passes a null word: bad indices are still skipped, not recorded.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import attrs
import numpy as np

from .errors import DeviceIndexError
from .tensor import Tensor


def checks_enabled() -> bool:
    """Index checking on (the default); OPDISPATCH_CHECK_INDICES=0, read at bind, turns it off."""
    return os.environ.get("OPDISPATCH_CHECK_INDICES", "1") != "0"


@attrs.frozen
class IndexUse:
    """A launch reading `index`'s values as indices that must lie in [0, bound)."""

    node: Tensor  # the node the launch computes (the op the error names)
    index: Tensor
    bound: int
    what: str  # what an index picks: "a row of 'cache' (64, 32) f16"
    instead: str  # what the kernel does for a bad one: "that row is not written"

    def message(self, device: str, position: int, value: int) -> str:
        at = (f"'{self.index.name}'{list(int(i) for i in np.unravel_index(position, self.index.shape))}"
              if 0 <= position < self.index.size else f"position {position} of '{self.index.name}'")
        return (f"{self.node.op} {self.node.describe()} on {device}: index {value} at {at} (index tensor "
                f"{self.index.describe()}) is outside [0, {self.bound}): it picks {self.what}; {self.instead}. "
                "The first bad index the device met is reported; the plan stays usable.")


@attrs.define(eq=False)
class ErrorWord:
    """An error word: 4 u64 the host reads as `host`, kernels write at `device_ptr`."""

    host: np.ndarray
    device_ptr: int
    keep: Any  # the allocation, alive as long as the word


@attrs.define(eq=False)
class IndexTable:
    """A plan's index uses by tag and its error word on each device (made at bind, kept by the plan)."""

    enabled: bool = attrs.field(factory=checks_enabled)
    uses: list[IndexUse] = attrs.field(factory=list)
    words: dict[str, ErrorWord] = attrs.field(factory=dict)

    def word(self, device: str, make: Callable[[], ErrorWord]) -> ErrorWord:
        """The plan's error word on `device`, made by `make` on first use."""
        if device not in self.words:
            self.words[device] = make()
        return self.words[device]

    def register(self, use: IndexUse) -> int:
        """The tag of `use` (what its kernel records with a bad index)."""
        self.uses.append(use)
        return len(self.uses) - 1

    def check(self, device: str | None = None) -> None:
        """Raise DeviceIndexError for the first set word (of `device`, or of every device), clearing it;
        call once those devices have finished their work (a word is written in three stores)."""
        for name, word in self.words.items():
            if word.host[0] and device in (None, name):
                tag, position, value = int(word.host[0]) - 1, *(int(v) for v in word.host[1:3].view(np.int64))
                word.host[:] = 0
                raise DeviceIndexError(self.uses[tag].message(name, position, value))
