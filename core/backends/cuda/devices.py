"""CUDA device discovery through CuPy; no GPU or no driver means no devices, and one line why."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import attrs

from ...hookspecs import Device

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
            "smem_per_sm": int(p.get("sharedMemPerMultiprocessor", H200.props["smem_per_sm"])),
            "warp_size": int(p["warpSize"]),
            "total_memory": int(total),
            "free_memory": int(free),
            "pci_bus_id": runtime.deviceGetPCIBusId(i),
            "index": i,
        }
        found.append(Device(f"cuda{i}", "cuda", name, props, backend_factory=_backend_factory))
    return tuple(found), ""


def peer_links(devices: tuple[Device, ...]) -> dict[tuple[str, str], bool]:
    """For each ordered pair of the GPUs in `devices` (as `discover` found them): can the first access the
    second's memory directly (cudaDeviceCanAccessPeer)? Empty without CuPy or with fewer than two GPUs."""
    gpus = [d for d in devices if d.kind == "cuda" and d.backend_factory is not None]
    if len(gpus) < 2:
        return {}
    from cupy.cuda import runtime

    return {(a.name, b.name): bool(runtime.deviceCanAccessPeer(int(a.props["index"]), int(b.props["index"])))
            for a in gpus for b in gpus if a is not b}


#: An H200 as `discover` describes one, without a backend: plans and support
#: predicates for it are computed (and tested) where no GPU is.
H200 = Device("cuda0", "cuda", "NVIDIA H200 (description: no GPU here)", {
    "cc": (9, 0), "sm_count": 132, "smem_per_block": 48 * 1024, "smem_per_block_optin": 227 * 1024,
    "smem_per_sm": 228 * 1024, "warp_size": 32, "total_memory": 143771 * 2**20, "free_memory": 143771 * 2**20,
    "pci_bus_id": "", "index": 0,
})


@attrs.frozen
class DeviceFacts:
    """What kernels are sized by, read from a device's description: where the description
    lacks a fact (a hand-made test device), the H200's is taken, the one fallback."""

    cc: tuple[int, int]
    sm_count: int
    smem_per_block: int  # dynamic shared memory a block gets without opting in
    smem_per_block_optin: int  # the most a block may opt into
    smem_per_sm: int
    warp_size: int


def facts(device: Device) -> DeviceFacts:
    """The `DeviceFacts` of `device` (see there for the fallback)."""
    props = {**H200.props, **device.props}
    cc = tuple(props["cc"])
    return DeviceFacts(cc, int(props["sm_count"]), int(props["smem_per_block"]),  # type: ignore[arg-type]
                       int(props["smem_per_block_optin"]), int(props["smem_per_sm"]), int(props["warp_size"]))


def warp32_gate(device: Device) -> str | None:
    """A reason to decline on a CUDA device whose warps are not 32 lanes (the
    built-in kernels' reductions assume 32), else None: the plugins' supports_op."""
    if device.kind == "cuda" and device.props.get("warp_size", 32) != 32:
        return f"the kernels need 32-lane warps, {device.name} has {device.props['warp_size']}"
    return None


def _backend_factory(device: Device) -> CudaBackend:
    from .backend import backend_for

    return backend_for(device)
