"""A Llama decoder as one opdispatch graph per step (docs/models.md), and its generation API.

The library API: the config, weights and model from this package's modules,
and the sampler and generator from opdispatch.models.sampling and .generate.
Those two import this package's modules, so they are imported last here.
"""

from .config import PRESETS, LlamaConfig, window_for
from .inputs import StepInputs
from .model import LlamaModel
from .names import MOE_ALIASES, random_weights, weight_shapes
from .stored import random_params

from ..sampling import SAMPLING, Sampler
from ..generate import BatchGeneration, Generation, Generator, Progress, generate

__all__ = ["LlamaConfig", "PRESETS", "MOE_ALIASES", "weight_shapes", "random_weights", "random_params", "LlamaModel",
           "StepInputs", "Sampler", "SAMPLING", "Progress", "Generator", "Generation", "BatchGeneration", "generate",
           "window_for"]
