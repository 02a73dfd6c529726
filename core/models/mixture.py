"""Which type each tensor of a GGUF file gets: llama-quantize's rules (llama.cpp src/llama-quant.cpp).

`tensor_type` is a pure function of the target (a llama-quantize file type
such as "Q4_K_M", or an opdispatch dtype name such as "q4_0"), the GGUF
tensor name and shape, and a few facts about the model (`ModelFacts`):

- Tensors llama-quantize leaves alone (1-d ones such as the norms, the MoE
  router ffn_gate_inp) are f32.
- A dtype name quantizes every other tensor to that dtype, as
  ``llama-quantize --pure`` does.
- A file type ("preset") starts from its default type and follows
  llama_tensor_get_type's mixture for a Llama (no Falcon rules, no
  importance matrix): output.weight (or token_embd.weight when the
  embeddings are tied) Q6_K unless the preset is Q8_0; attn_v and ffn_down
  one or two steps up on some layers (use_more_bits); Q2_K/Q3_K_* lift
  attn_output too; IQ4_NL/IQ4_XS lift attn_v (GQA >= 4) and the first eighth
  of ffn_down; MoE models of 8 experts and 70B models have their own bumps.
  MXFP4_MOE writes stacked experts (3-d tensors) mxfp4 and every other
  matrix q8_0.
- Then the fallback of tensor_type_fallback: a row length that is not whole
  blocks of the chosen type takes q4_0 (q2_K, q3_K), q5_0 (q4_K), q5_1
  (q5_K), q8_0 (q6_K) or iq4_nl (the 256-value I-quants), and f16 when that
  does not fit either. llama-quantize has no fallback for the 32-value
  formats (it stops); here they fall back to f16 as well.

llama.cpp counts attn_v and ffn_down tensors in file order (blk.0 first) to
place them; for a Llama, one of each a layer, that count is the layer index,
which is what this module reads from the name.
"""

from __future__ import annotations

import re

import attrs

from ..dtypes import DTYPES


@attrs.frozen
class Preset:
    """A llama-quantize file type: its name, its LLAMA_FTYPE number (general.file_type) and default dtype."""

    name: str
    file_type: int
    default: str


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("F32", 0, "f32"), Preset("F16", 1, "f16"), Preset("BF16", 32, "bf16"),
    Preset("Q4_0", 2, "q4_0"), Preset("Q4_1", 3, "q4_1"), Preset("Q5_0", 8, "q5_0"), Preset("Q5_1", 9, "q5_1"),
    Preset("Q8_0", 7, "q8_0"), Preset("Q2_K", 10, "q2_K"), Preset("Q3_K_S", 11, "q3_K"),
    Preset("Q3_K_M", 12, "q3_K"), Preset("Q3_K_L", 13, "q3_K"), Preset("Q4_K_S", 14, "q4_K"),
    Preset("Q4_K_M", 15, "q4_K"), Preset("Q5_K_S", 16, "q5_K"), Preset("Q5_K_M", 17, "q5_K"),
    Preset("Q6_K", 18, "q6_K"), Preset("IQ4_NL", 25, "iq4_nl"), Preset("IQ4_XS", 30, "iq4_xs"),
    Preset("MXFP4_MOE", 38, "mxfp4"),
)}


@attrs.frozen
class ModelFacts:
    """What the mixture reads about a model: layers, heads, experts, and whether output.weight exists."""

    n_layers: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0
    tied: bool = False

    @property
    def n_gqa(self) -> int:
        return self.n_head // max(self.n_head_kv, 1)

    @property
    def is_70b(self) -> bool:
        """llama.cpp's LLM_TYPE_70B for a Llama: 80 layers with grouped KV heads, not a MoE."""
        return self.n_expert != 8 and self.n_layers == 80 and self.n_head != self.n_head_kv


#: tensor_type_fallback's table: the type a row that is not whole blocks of the key takes instead
_FALLBACK = {"q2_K": "q4_0", "q3_K": "q4_0", "q4_K": "q5_0", "q5_K": "q5_1", "q6_K": "q8_0",
             **{t: "iq4_nl" for t in ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq4_xs")}}
_BLK = re.compile(r"blk\.(\d+)\.")
#: the non-linear 4-bit presets, which share their mixture rules
_IQ4 = ("IQ4_NL", "IQ4_XS")


def targets() -> list[str]:
    """Every target `tensor_type` takes: the presets, then the float and block dtypes."""
    return [*PRESETS, *(n for n, t in DTYPES.items() if t.is_float or t.is_quant)]


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize changes this tensor's type (tensor_allows_quantization, for a Llama)."""
    return (len(shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name)


def tensor_type(target: str, name: str, shape: tuple[int, ...], facts: ModelFacts) -> str:
    """The dtype llama-quantize gives tensor `name` of numpy `shape` (rows last) for `target` (see the module doc)."""
    if target not in PRESETS and target not in DTYPES:
        raise ValueError(f"quantize: unknown type {target!r}: one of {', '.join(targets())}")
    if not quantizable(name, shape):
        return "f32"
    preset = PRESETS.get(target)
    chosen = target if preset is None else preset.default
    if not DTYPES[chosen].is_quant:
        return chosen
    if preset is not None:
        chosen = _mixture(preset.name, chosen, name, shape, facts)
    return _fallback(chosen, shape[-1])


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _mixture(ftype: str, new: str, name: str, shape: tuple[int, ...], f: ModelFacts) -> str:
    """llama_tensor_get_type_impl for a Llama (its Falcon branches, and the IQ1-IQ3 presets, are not here)."""
    m = _BLK.match(name)
    i, n = (int(m.group(1)) if m else 0), f.n_layers
    if name == "output.weight" or (f.tied and name == "token_embd.weight"):
        if ftype == "MXFP4_MOE" or shape[-1] % DTYPES[new].block_size:
            return "q8_0"
        return new if new == "q8_0" else "q6_K"
    if ftype == "MXFP4_MOE":  # the experts (stacked: 3-d) mxfp4, every other matrix q8_0
        return new if len(shape) == 3 and shape[0] > 1 else "q8_0"
    if name == "token_embd.weight":
        return new
    if "attn_v.weight" in name or "attn_qkv.weight" in name or "attn_kv_b.weight" in name:
        if ftype == "Q2_K":
            new = "q4_K" if f.n_gqa >= 4 else "q3_K"
        elif ftype == "Q3_K_M":
            new = "q5_K" if i < 2 else "q4_K"
        elif ftype == "Q3_K_L":
            new = "q5_K"
        elif ftype in _IQ4 and f.n_gqa >= 4:
            new = "q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, n):
            new = "q6_K"
        elif ftype == "Q4_K_S" and i < 4:
            new = "q5_K"
        if f.is_70b and new in ("q3_K", "q4_K"):
            new = "q5_K"
        return "q8_0" if f.n_expert == 8 else new
    if "attn_k.weight" in name:
        return "q8_0" if f.n_expert == 8 else new
    if "ffn_down" in name:
        if ftype == "Q2_K":
            return "q3_K"
        if ftype == "Q3_K_M":
            return "q5_K" if i < n // 16 else "q4_K"
        if ftype == "Q3_K_L":
            return "q5_K"
        if ftype in ("Q4_K_M", "Q5_K_M"):
            return "q6_K" if _use_more_bits(i, n) else new
        if ftype in _IQ4:  # llama-quantize's rule without an importance matrix
            return "q5_K" if i < n // 8 else new
        if ftype == "Q4_K_S" and i < n // 8:
            return "q5_K"
        return new
    if "attn_output.weight" in name:
        if f.n_expert == 8:
            return "q5_K" if ftype in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", *_IQ4) else new
        return {"Q2_K": "q3_K", "Q3_K_M": "q4_K", "Q3_K_L": "q5_K"}.get(ftype, new)
    return new


def _fallback(chosen: str, ncols: int) -> str:
    """tensor_type_fallback: a type whose blocks fit a row of ncols values (f16 as the last resort)."""
    if ncols % DTYPES[chosen].block_size == 0:
        return chosen
    other = _FALLBACK.get(chosen)
    if other in DTYPES and ncols % DTYPES[other].block_size == 0:
        return other
    return "f16"
