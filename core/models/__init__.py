"""Graph builders for real workloads."""

from .llama import (  # noqa: F401
    PRESETS,
    Generation,
    Generator,
    LlamaConfig,
    LlamaModel,
    Sampler,
    generate,
    random_weights,
    weight_shapes,
)
