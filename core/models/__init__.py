"""Graph builders for real workloads."""

from .llama import PRESETS, Generation, Generator, LlamaConfig, LlamaModel, generate, random_weights  # noqa: F401
