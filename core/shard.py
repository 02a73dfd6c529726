"""Tensor split: the rank of a device in a split, and the rules that cut a param into the ranks' shards.

In a tensor split (Megatron-style, as llama.cpp's tensor-split backend) each device holds a slice of every
layer's matrices and runs the same graph shape on it: one graph per device (its rank), with collective
nodes (all_reduce_sum) where the ranks' partial results meet (docs/multi-device.md). A model says which
params split along which axis (the Llama rule: core/models/llama/split.py); the cuts are made here:

- by rows (`shard_rows`, column-parallel: a projection's output features, the heads): rows are independent
  in every format, so any count of whole rows goes;
- by columns (`shard_cols`, row-parallel: a projection's input features K): every rank's columns must be
  whole blocks of a block format (K / parts a multiple of the block size), else PlacementError.
"""

from __future__ import annotations

import attrs
import numpy as np

from .errors import PlacementError
from .tensor import Flag, Tensor, param


@attrs.frozen
class Shard:
    """Rank `rank` of a tensor split over `devices` (device names, in rank order)."""

    rank: int
    devices: tuple[str, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if len(set(self.devices)) != len(self.devices) or len(self.devices) < 2:
            raise PlacementError(f"tensor split: needs two distinct devices or more, got {', '.join(self.devices)}")
        if not 0 <= self.rank < len(self.devices):
            raise PlacementError(f"tensor split: rank {self.rank} outside 0..{len(self.devices) - 1}")

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def group(self) -> str:
        """The group param of the split's collective nodes: 'cuda0,cuda1'."""
        return ",".join(self.devices)

    def part(self, n: int, what: str) -> int:
        """n / size: what each rank holds of n heads, rows or columns; PlacementError naming `what` if n does
        not divide."""
        if n % self.size:
            raise PlacementError(f"tensor split over {self.size} devices ({self.group}): {what} ({n}) is not a "
                                 f"multiple of {self.size}")
        return n // self.size


def _raw(t: Tensor) -> np.ndarray:
    """A param's stored bytes as (..., row bytes)."""
    if not t.flags & Flag.PARAM or t.data is None or not t.is_contiguous():
        raise PlacementError(f"tensor split: {t.describe()} must be a contiguous param with its values")
    raw = np.ascontiguousarray(np.asarray(t.data)).view(np.uint8).reshape(-1)
    return raw.reshape(*t.shape[:-1], t.dtype.row_bytes(t.shape[-1]))


def shard_rows(t: Tensor, shard: Shard) -> Tensor:
    """Rank shard.rank's 1/size of the rows of param `t` (axis -2: a projection's output features)."""
    n = shard.part(t.shape[-2], f"the rows of {t.describe()}")
    cut = _raw(t)[..., shard.rank * n:(shard.rank + 1) * n, :]
    return param(f"{t.name}@{shard.rank}/{shard.size}", cut, t.dtype, shape=(*t.shape[:-2], n, t.shape[-1]))


def shard_cols(t: Tensor, shard: Shard) -> Tensor:
    """Rank shard.rank's columns of param `t` (the last axis, K): whole blocks of a block format."""
    k = t.shape[-1]
    n = shard.part(k, f"the columns (K) of {t.describe()}")
    block = t.dtype.block_size
    if n % block:
        raise PlacementError(f"tensor split over {shard.size} devices ({shard.group}): {t.describe()} splits K = {k} "
                             f"into {n} columns per device, not a whole number of {t.dtype.name}'s {block}-value "
                             "blocks")
    width = t.dtype.row_bytes(n)
    cut = _raw(t)[..., shard.rank * width:(shard.rank + 1) * width]
    return param(f"{t.name}@{shard.rank}/{shard.size}", cut, t.dtype, shape=(*t.shape[:-1], n))
