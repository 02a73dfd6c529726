"""CUDA device discovery through CuPy; no GPU or no driver means no devices, and one line why."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ..base import Device

if TYPE_CHECKING:
    from .backend import CudaBackend


@functools.lru_cache(maxsize=1)
def discover() -> tuple[tuple[Device, ...], str]:
    """(devices, why none) — `why` is empty when at least one GPU was found."""
    try:
        import cupy  # noqa: F401
        from cupy.cuda import runtime
    except ImportError as exc:
        return (), f"CuPy is not installed ({exc}); install opdispatch[cuda] to use a GPU"
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver or no device: CuPy raises CUDARuntimeError
        return (), f"no CUDA device usable: {exc}"
    if count == 0:
        return (), "no CUDA device found"
    found = []
    for i in range(count):
        p = runtime.getDeviceProperties(i)
        with cupy.cuda.Device(i):
            free, total = runtime.memGetInfo()
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        props = {
            "cc": (int(p["major"]), int(p["minor"])),
            "sm_count": int(p["multiProcessorCount"]),
            "smem_per_block": int(p["sharedMemPerBlock"]),
            "smem_per_block_optin": int(p.get("sharedMemPerBlockOptin", p["sharedMemPerBlock"])),
            "warp_size": int(p["warpSize"]),
            "total_memory": int(total),
            "free_memory": int(free),
            "pci_bus_id": runtime.deviceGetPCIBusId(i),
            "index": i,
        }
        found.append(Device(f"cuda{i}", "cuda", name, props, backend_factory=_backend_factory))
    return tuple(found), ""


def _backend_factory(device: Device) -> CudaBackend:
    from .backend import backend_for

    return backend_for(device)
