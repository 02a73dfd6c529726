"""The op catalogue: builders with shape/dtype inference and validation.

Semantics are ggml's, restated in numpy order (see docs/ops.md and each
builder's docstring). `OPS` maps op names to their definitions.
"""

from .base import OPS, OpDef  # noqa: F401
from .views import permute, reshape, transpose, view  # noqa: F401
from .matmul import *  # noqa: F401,F403
from .elementwise import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .rows import *  # noqa: F401,F403
from .layout import *  # noqa: F401,F403
from .reduce import *  # noqa: F401,F403
from .collective import *  # noqa: F401,F403
