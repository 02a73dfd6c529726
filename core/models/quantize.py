"""`opdispatch quantize`: a Llama GGUF file, or an HF Llama safetensors directory, -> a GGUF file of another type.

The types come from opdispatch.models.mixture (llama-quantize's rules for a
preset such as Q4_K_M, or one dtype for every tensor it quantizes); the bytes
are llama-quantize's: opdispatch.dtypes.quantize's (byte-exact with ggml's
quantize_row_*_ref), but iq4_nl's, which llama-quantize writes with ggml's
quantize_iq4_nl (7 scales tried a block where the _ref row takes one).
Each tensor is decoded to f32 on its own (a GGUF's stored type, or
safetensors' f32/f16/bf16), quantized and written before the next is read,
so memory holds one tensor at a time. A tensor already in its chosen type is
copied byte for byte, as llama-quantize does. The metadata of a GGUF source
is copied with its value types, general.file_type set to the target's and
general.quantization_version to ggml's; a safetensors source's comes from
its config.json (no tokenizer: llama.cpp needs convert_hf_to_gguf.py's for
text, opdispatch runs token ids). Q/K rows of a safetensors source are
permuted as llama.cpp's converter permutes them.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import attrs
import numpy as np

from ..dtypes import DTYPES, from_float, to_host_float
from ..quants import FORMATS
from ..quants.iquants import encode_iq4_nl_file
from ..tensor import Tensor, param
from .llama.config import LlamaConfig
from .mixture import PRESETS, ModelFacts, tensor_type
from .weights.gguf import _import_gguf, permute_qk, read_gguf, read_gguf_fields
from .weights.names import hf_name_to_gguf
from .weights.safetensors import load_safetensors

#: metadata keys not copied: written anew (file type, quantization version) or meaningless in one file (splits)
_NOT_COPIED = ("general.architecture", "general.file_type", "general.quantization_version", "split.no",
               "split.count", "split.tensors.count")
#: HF names a checkpoint may carry that are no weights (transformers' RoPE buffer)
_NOT_WEIGHTS = ("rotary_emb.inv_freq",)


@attrs.frozen
class Source:
    """A model to quantize: its architecture, metadata as (key, value, type, element type), tensors by GGUF name."""

    arch: str
    meta: list[tuple[str, Any, Any, Any]]
    tensors: dict[str, Tensor]
    facts: ModelFacts


def read_source(path: str | os.PathLike[str]) -> Source:
    """A GGUF file, or a directory (or file) of HF Llama safetensors with config.json beside them."""
    p = Path(path)
    if p.is_dir() or p.suffix == ".safetensors":
        return _safetensors_source(p)
    meta = read_gguf_fields(p)
    _, tensors = read_gguf(p)
    values = {k: v for k, v, _, _ in meta}
    arch = values.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{p}: no general.architecture in the metadata")

    def first(key: str, default: int) -> int:
        v = values.get(f"{arch}.{key}", default)
        return int(v[0] if isinstance(v, list) else v)

    heads = first("attention.head_count", 1)
    facts = ModelFacts(first("block_count", 0), heads, first("attention.head_count_kv", heads),
                       first("expert_count", 0), "output.weight" not in tensors)
    return Source(arch, meta, tensors, facts)


def _safetensors_source(p: Path) -> Source:
    root = p if p.is_dir() else p.parent
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{p}: no config.json beside the safetensors weights ({config_path})")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path}: not JSON ({e})") from None
    cfg = LlamaConfig.from_hf(config)
    gguf = _import_gguf()
    vt = gguf.GGUFValueType
    u32, f32 = vt.UINT32, vt.FLOAT32
    a = "llama"
    meta: list[tuple[str, Any, Any, Any]] = [
        ("general.name", root.name, vt.STRING, None),
        (f"{a}.context_length", int(config.get("max_position_embeddings", cfg.max_ctx)), u32, None),
        (f"{a}.embedding_length", cfg.hidden, u32, None), (f"{a}.block_count", cfg.layers, u32, None),
        (f"{a}.feed_forward_length", cfg.ffn, u32, None), (f"{a}.attention.head_count", cfg.heads, u32, None),
        (f"{a}.attention.head_count_kv", cfg.kv_heads, u32, None),
        (f"{a}.rope.dimension_count", cfg.head_dim, u32, None), (f"{a}.rope.freq_base", cfg.rope_base, f32, None),
        (f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps, f32, None), (f"{a}.vocab_size", cfg.vocab, u32, None),
    ]
    if cfg.experts:
        meta += [(f"{a}.expert_count", cfg.experts, u32, None), (f"{a}.expert_used_count", cfg.experts_used, u32, None)]
    if cfg.rope_freq_scale != 1.0:
        meta += [(f"{a}.rope.scaling.type", "linear", vt.STRING, None),
                 (f"{a}.rope.scaling.factor", 1.0 / cfg.rope_freq_scale, f32, None)]
    tensors: dict[str, Tensor] = {}
    unknown = []
    for hf, t in load_safetensors(p).items():
        name = hf_name_to_gguf(hf)
        if name is None:
            if not hf.endswith(_NOT_WEIGHTS):
                unknown.append(hf)
            continue
        if ".attn_q." in name or ".attn_k." in name:
            rows = to_host_float(t.dtype, t.host_view(t.data))
            t = param(name, permute_qk(rows, cfg.heads if ".attn_q." in name else cfg.kv_heads), "f32")
        t.name = name
        tensors[name] = t
    if unknown:
        raise ValueError(f"{p}: weights with no GGUF name (a Llama's, experts stacked): {', '.join(unknown[:6])}"
                         + (", ..." if len(unknown) > 6 else ""))
    if cfg.rope_freq_factors is not None:
        tensors["rope_freqs.weight"] = param("rope_freqs.weight", np.asarray(cfg.rope_freq_factors, np.float32), "f32")
    facts = ModelFacts(cfg.layers, cfg.heads, cfg.kv_heads, cfg.experts, "output.weight" not in tensors)
    return Source(a, meta, tensors, facts)


def plan_types(source: Source, target: str) -> dict[str, str]:
    """The dtype of every tensor of `source` in the file for `target` (integer tensors keep theirs)."""
    return {name: t.dtype.name if t.dtype.is_int else tensor_type(target, name, t.shape, source.facts)
            for name, t in source.tensors.items()}


def file_type(target: str) -> int:
    """general.file_type for `target`: the preset's LLAMA_FTYPE, or the file type named after a dtype."""
    if target in PRESETS:
        return PRESETS[target].file_type
    gguf = _import_gguf()
    names = {"f32": "ALL_F32"} | {t.name.removeprefix("MOSTLY_").lower(): t.name for t in gguf.LlamaFileType}
    for key in (target.lower(), target.lower() + "_s", target.lower() + "_moe"):
        if key in names:
            return int(gguf.LlamaFileType[names[key]])
    return int(gguf.LlamaFileType.GUESSED)


def quantize_model(src: str | os.PathLike[str], dst: str | os.PathLike[str], target: str, *,
                   progress: TextIO | None = None) -> dict[str, str]:
    """Write `src` (a GGUF file or an HF safetensors directory) to the GGUF file `dst` for `target` (a preset of
    mixture.PRESETS or a dtype name); returns {tensor: dtype written}. A progress bar goes to `progress`."""
    if Path(dst).resolve() == Path(src).resolve():
        raise ValueError(f"quantize: the output {dst} is the input")
    source = read_source(src)
    types = plan_types(source, target)
    missing = Counter(dt for name, dt in types.items() if DTYPES[dt].is_quant and FORMATS[dt].encode is None
                      and source.tensors[name].dtype.name != dt)
    if missing:
        raise ValueError(f"quantize {target}: opdispatch cannot quantize to {', '.join(missing)} yet "
                         f"({', '.join(f'{dt}: {n} tensors' for dt, n in missing.items())})")
    gguf = _import_gguf()
    tmp = Path(f"{dst}.part")  # renamed to dst once whole: a failure leaves no half-written dst
    writer = gguf.GGUFWriter(str(tmp), source.arch)
    try:
        for key, value, vtype, sub in source.meta:
            if key not in _NOT_COPIED and not (isinstance(value, list) and not value):  # gguf writes no empty arrays
                writer.add_key_value(key, value, vtype, sub_type=sub)
        writer.add_file_type(file_type(target))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, t in source.tensors.items():
            _add_info(gguf, writer, name, t.shape, types[name])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, (name, t) in enumerate(source.tensors.items()):
            if progress is not None:
                _bar(progress, i, len(types), name)
            writer.write_tensor_data(_converted(t, types[name]))
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dst)
    if progress is not None:
        _bar(progress, len(types), len(types), "done")
        progress.write("\n")
    return types


def _add_info(gguf: Any, writer: Any, name: str, shape: tuple[int, ...], dt: str) -> None:
    """The tensor info of `name` in dtype dt: block formats as rows of raw bytes, floats and ints as numpy types."""
    d = DTYPES[dt]
    raw_type = gguf.GGMLQuantizationType[dt.upper()]
    if d.is_quant:
        byte_shape = (*shape[:-1], d.row_bytes(shape[-1]))
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=raw_type)
    else:
        writer.add_tensor_info(name, shape, d.numpy, math.prod(shape) * d.block_bytes,
                               raw_dtype=raw_type if dt == "bf16" else None)


#: the encoders llama-quantize writes a type with where they differ from dtypes.quantize's (the _ref rows)
_FILE_ENCODERS = {"iq4_nl": encode_iq4_nl_file}


def _converted(t: Tensor, dt: str) -> np.ndarray:
    """Tensor t's data stored as dt: its bytes as they are if it is stored so, else decoded to f32 and encoded
    (by _FILE_ENCODERS' encoder where dt has one)."""
    stored = t.host_view(t.data)
    if t.dtype.name == dt:
        return np.ascontiguousarray(stored)
    values = to_host_float(t.dtype, stored)
    if dt not in _FILE_ENCODERS:
        return from_float(dt, values)
    d = DTYPES[dt]
    blocks = values.astype(np.float32).reshape(*values.shape[:-1], -1, d.block_size)
    return _FILE_ENCODERS[dt](blocks).reshape(*values.shape[:-1], -1)


def _bar(out: TextIO, done: int, total: int, what: str, width: int = 30) -> None:
    """``\\r[#####     ] 45/147 blk.7.ffn_down.weight``, padded to clear a longer previous line."""
    filled = width * done // max(total, 1)
    out.write(f"\r[{'#' * filled}{' ' * (width - filled)}] {done}/{total} {what:<40}")
    out.flush()
