"""Collectives: ops whose result combines the values every rank of a tensor split holds (all_reduce_sum).

A tensor split runs one graph per device (its rank), the same graph shape on each rank's shard of the
weights (docs/multi-device.md). A collective node names its group (the devices, in rank order) and its
rank: within its rank's graph it reads the rank's own part; its kernel meets the peers' kernels (NCCL
on GPUs, a host rendezvous on CPU devices), which hold the same node in their graphs.
"""

from __future__ import annotations

import re

from ..tensor import Tensor
from .base import check_dtype, check_rank, check_tensor, fail, int_param, node, op

__all__ = ["all_reduce_sum", "group_devices"]

#: a device name in a group: 'cpu', 'cuda0', a plugin's 'toy1'
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def group_devices(op_name: str, group: object, *tensors: Tensor) -> tuple[str, ...]:
    """The device names of a group param: a comma-separated string of distinct device names."""
    if not isinstance(group, str):
        fail(op_name, f"group must be a string of device names joined by commas, got {group!r} "
                      f"({type(group).__name__})", *tensors)
    names = tuple(group.split(","))
    if not all(_NAME.fullmatch(n) for n in names) or len(set(names)) != len(names):
        fail(op_name, f"group {group!r} must name distinct devices ('cuda0,cuda1'), joined by commas without "
                      "spaces", *tensors)
    return names


@op("collective")
def all_reduce_sum(x: Tensor, group: str, rank: int) -> Tensor:
    """Sum of x over the ranks of a tensor split's group: f32 of x's shape, the same in every rank.

    `group`: the devices' names in rank order ("cuda0,cuda1"); `rank`: the rank whose graph holds the
    node, x being that rank's part (a row-parallel projection's partial sums). A group of one device is
    the identity."""
    check_tensor("all_reduce_sum", x)
    check_dtype("all_reduce_sum", x, ("f32",))
    check_rank("all_reduce_sum", x, 1)
    names = group_devices("all_reduce_sum", group, x)
    r = int_param("all_reduce_sum", "rank", rank, x, lo=0, hi=len(names) - 1)
    return node("all_reduce_sum", (x,), x.shape, "f32", {"group": group, "rank": r})
