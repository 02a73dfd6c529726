"""Random weights drawn directly in their stored format, for benchmarks and runs of models too big to draw as floats.

Speed and memory do not depend on the values, so instead of drawing floats and converting (or quantizing) them,
each storage type gets one random pool of bytes (as large as its largest matrix) and every matrix of that type is
a param viewing a slice of it at a random offset: no host copy per weight, so a model of hundreds of GB is built
in the host memory of its largest matrix (LlamaModel's stack_qkv concatenates q/k/v into new host arrays: leave
it off for such a model). Floats: random signs and mantissas, magnitudes in [2^-7, 2^-5); blocks: random codes
and sub-block scales with fixed sane f16 scale fields. Norms are f32 arrays near 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...dtypes import dtype as as_dtype
from ...tensor import param
from ..mixture import PRESETS as FILE_TYPES
from ..mixture import ModelFacts, tensor_type
from ..weights.names import hf_name_to_gguf
from .config import LlamaConfig
from .names import weight_shapes

#: byte offsets of each block format's f16 scale fields (d, and dmin or m where there is one): ggml's block_* structs
SCALE_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q5_1": (0, 2), "q2_K": (80, 82), "q3_K": (108,),
                "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,), "iq4_nl": (0,), "iq4_xs": (0,)}
#: the f16 scale that makes random codes values of std ~0.02, like HF's initializer (code spread x sub-scale)
SCALE = {"q8_0": 0.02 / 74, "q4_0": 0.02 / 4.6, "q5_0": 0.02 / 9.2, "q5_1": 0.02 / 9.2, "q2_K": 0.02 / (7.5 * 1.1),
         "q3_K": 0.02 / (16 * 2.3), "q4_K": 0.02 / (32 * 4.6), "q5_K": 0.02 / (32 * 9.2), "q6_K": 0.02 / (64 * 18.5),
         "iq4_nl": 0.02 / 67.4, "iq4_xs": 0.02 / (18.5 * 67.4)}


def weight_types(cfg: LlamaConfig, weights: str) -> dict[str, str]:
    """The storage type of each matrix: `weights` itself for a dtype, llama-quantize's mixture for a file type
    ("Q4_K_M": q4_K, q6_K for the output and the use_more_bits layers' attn_v and ffn_down)."""
    shapes = {n: s for n, s in weight_shapes(cfg).items() if len(s) > 1}
    if weights not in FILE_TYPES:
        return {n: weights for n in shapes}
    facts = ModelFacts(cfg.layers, cfg.heads, cfg.kv_heads, cfg.experts)
    return {n: tensor_type(weights, hf_name_to_gguf(n), s, facts) for n, s in shapes.items()}


def random_params(cfg: LlamaConfig, seed: int = 0, weights: str | None = None) -> dict[str, Any]:
    """Every weight of `cfg` as an opdispatch param, matrices in cfg.dtype or the mixture of file type `weights`
    (weight_types), norms f32, each type's matrices views of one random pool of its own (module docstring)."""
    rng = np.random.default_rng(seed)
    shapes = weight_shapes(cfg)
    types = weight_types(cfg, weights or cfg.dtype)
    pools = {}
    for name in sorted(set(types.values())):
        dt = as_dtype(name)
        largest = max(dt.row_bytes(shapes[n][-1]) * int(np.prod(shapes[n][:-1])) for n, t in types.items() if t == name)
        pool = np.frombuffer(rng.bytes(largest + 2**20), np.uint8).copy()
        if name in ("f16", "bf16"):
            bits = pool[: pool.size // 2 * 2].view(np.uint16)
            # keep the sign and the low mantissa/exponent bits, fix the exponent high: |x| in [2^-7, 2^-5)
            if name == "f16":
                bits &= 0x87FF
                bits |= 0x2000
            else:
                bits &= 0x80FF
                bits |= 0x3C00
        else:  # block formats: random codes and sub-block scales, each f16 scale field a fixed sane value
            blocks = pool[: pool.size // dt.block_bytes * dt.block_bytes].reshape(-1, dt.block_bytes)
            for at in SCALE_FIELDS[name]:
                blocks[:, at:at + 2] = np.frombuffer(np.float16(SCALE[name]).tobytes(), np.uint8)
        pools[name] = pool
    out: dict[str, Any] = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = rng.uniform(0.9, 1.1, shape).astype(np.float32)
            continue
        dt, pool = as_dtype(types[name]), pools[types[name]]
        nbytes = dt.row_bytes(shape[-1]) * int(np.prod(shape[:-1]))
        off = int(rng.integers(0, (pool.size - nbytes) // dt.block_bytes)) * dt.block_bytes
        out[name] = param(name, pool[off:off + nbytes], dt.name, shape=shape)
    return out
