"""The errors opdispatch raises, one family: each names what it is about (the op, the node, the
tensors with their shapes and dtypes, the device, the plugin), so a caller can catch them all as
`OpdispatchError` and a message is enough to find the cause."""

from __future__ import annotations


class OpdispatchError(Exception):
    """The base of every error the library raises about its input, its plugins or its devices."""


class OpError(OpdispatchError, ValueError):
    """Invalid op at graph-build time; the message names op, tensors, shapes, dtypes."""


class DispatchError(OpdispatchError, RuntimeError):
    """No plugin accepts a node on any device; the message lists who declined and why."""


class LaunchError(OpdispatchError, RuntimeError):
    """A launch failed; the message names the node, its op and the plugin."""


class PluginError(OpdispatchError, RuntimeError):
    """A plugin failed to load or raised in a hook; the message names it."""


class FeedError(OpdispatchError, ValueError):
    """A value given for a plan's input or state (`Plan.run`/`submit`/`write`) that the tensor cannot take:
    not a mapping of tensors or names, a wrong shape, a dtype of the wrong kind, integers out of range."""


class OutOfMemory(OpdispatchError, MemoryError):
    """Memory a plan needs that its device (or the host) does not have; the message names the tensor or
    buffer, the bytes asked and the bytes free. Raised before the allocation: the backend stays usable."""


class PlanKeyError(OpdispatchError, KeyError):
    """A tensor or name a plan does not have (fed, written or read), or an input given no value."""


class DeviceIndexError(OpdispatchError, IndexError):
    """A kernel met an index outside its range; recorded on the device, raised where the plan synchronizes.
    The message names the op, the node, the index tensor, the bad value, its position and the valid range."""


class PlacementError(OpdispatchError, ValueError):
    """A split that cannot be made as asked: devices named twice, proportions that are not one number >= 0
    per device; a tensor split whose heads or features do not divide among the devices, or whose block
    format would not split into whole blocks. (Too little memory for it is OutOfMemory.)"""


class CaptureWarning(RuntimeWarning):
    """A plan segment that could not be captured into a CUDA graph and runs by direct launches from then on;
    the message names the device, the segment and the cause. The conformance harness fails a case on it."""
