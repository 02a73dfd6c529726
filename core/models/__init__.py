"""Graph builders for real workloads: llama/ (a Llama decoder), sampling, generate, weights/ (loaders).

The llama package is imported first: its API includes opdispatch.models.sampling
and .generate, which import its modules, so it must load before either does.
"""

from . import llama  # noqa: F401
