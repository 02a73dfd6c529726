"""opdispatch: tensor compute graphs on NVIDIA GPUs through op plugins."""

from . import ops  # noqa: F401
from .dtypes import DType, dtype  # noqa: F401
from .graph import Graph  # noqa: F401
from .hookspecs import FusionRule, Kernel, PluginInfo, hookimpl  # noqa: F401
from .tensor import Flag, Tensor, input, param, state  # noqa: F401,A004

__version__ = "0.1.0"
from .compiler import compile  # noqa: E402,F401,A004
from .manager import manager  # noqa: E402,F401
from .plan import Plan  # noqa: E402,F401
