"""Weight loaders: GGUF files, safetensors files and torch/transformers state dicts -> opdispatch params.

Every loader returns ``{name: Tensor}`` of params under Hugging Face's Llama
names (``model.layers.0.self_attn.q_proj.weight``...), the names `LlamaModel`
and `random_weights` use, each tensor kept in the format it is stored in: f32, f16, bf16 and ggml's block formats q4_0, q4_1, q5_0, q5_1,
q8_0 arrive as raw bytes, never dequantized or converted. File-backed params
hold read-only views of a memory map of the file, so loading costs no copy
until a backend uploads them.

- `load_gguf(path)` reads a llama-architecture GGUF through the `gguf` package
  (``pip install 'opdispatch[models]'``): its metadata become a `LlamaConfig`,
  its tensors are renamed by `GGUF_TO_HF`. Shapes are in numpy order: GGUF's
  ``ne`` lists dimensions innermost first, so ``ne = [K, M]`` is shape (M, K).
- `load_safetensors(path_or_dir)` parses the format itself (no package needed):
  an 8-byte little-endian header length, a JSON header of
  ``{name: {dtype, shape, data_offsets}}``, then the data. A directory loads
  every ``*.safetensors`` shard in it (following ``model.safetensors.index.json``
  when there is one).
- `load_state_dict(state_dict)` takes torch tensors (any device; bf16 moved
  bit for bit) or numpy arrays; `state_dict_arrays(state_dict)` gives the same
  as numpy arrays, for `LlamaModel` to convert to its dtype. Both split
  transformers 5's fused MoE experts into the stacked names LlamaModel takes.

Malformed or truncated input raises ValueError naming the file and, where one
is at fault, the tensor; every extent is checked against the file size before
anything is read, so nothing is read out of bounds.

RoPE and GGUF's Q/K rows: llama.cpp's converter (convert_hf_to_gguf.py,
``LlamaModel.permute``) reorders the rows of every head of q_proj and k_proj so
that ggml's "normal" RoPE (rotating adjacent pairs) computes what HF's
rotate-half ("neox") RoPE computes on the original rows. `load_gguf` therefore
either keeps the rows as stored and sets ``rope_mode="normal"`` (when
`LlamaConfig` has a rope_mode field), or, with ``rope_mode="neox"`` or a
`LlamaConfig` without that field, undoes the permutation (a row shuffle, exact
for block formats too: blocks never cross rows) so the weights are HF's again.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np

from ..dtypes import dtype as as_dtype
from ..tensor import Tensor, param
from .llama import LlamaConfig

__all__ = ["load_gguf", "read_gguf", "load_safetensors", "load_state_dict", "state_dict_arrays", "GGUF_TO_HF",
           "GGUF_LAYER_TO_HF", "GGUF_TYPES", "SAFETENSORS_DTYPES", "gguf_name_to_hf", "unpermute_qk"]

#: GGUF tensor names outside the layers -> HF names.
GGUF_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when tied: LlamaModel then uses the embedding
    "rope_freqs.weight": "rope_freqs.weight",  # Llama 3 rope scaling: head_dim/2 frequency divisors (f32)
}

#: Per layer: GGUF ``blk.{i}.<key>.weight`` -> HF ``model.layers.{i}.<value>.weight``.
#:
#: MoE (Mixtral / Qwen2-MoE style, llama.cpp's stacked layout): the router and
#: the experts' matrices stacked on a leading expert axis, under the "merged"
#: names gguf's own tensor_mapping lists for qwen2moe/olmoe, so its
#: TensorNameMap maps them straight back:
#:   mlp.gate.weight                (experts, hidden)         router logits = x @ W.T
#:   mlp.experts.gate_proj.weight   (experts, ffn, hidden)
#:   mlp.experts.up_proj.weight     (experts, ffn, hidden)
#:   mlp.experts.down_proj.weight   (experts, hidden, ffn)
#: (transformers' Mixtral state dict names experts one by one,
#: ``block_sparse_moe.experts.{e}.w1/w3/w2``; stacking those is the model
#: builder's job, `load_state_dict` keeps names as given.)
GGUF_LAYER_TO_HF: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}

#: ggml type names (gguf.GGMLQuantizationType) loaded, -> opdispatch dtype names. Others are refused.
GGUF_TYPES: dict[str, str] = {
    "F32": "f32", "F16": "f16", "BF16": "bf16",
    "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0",
}

#: safetensors dtype names loaded -> opdispatch dtype names. Others are refused.
SAFETENSORS_DTYPES: dict[str, str] = {"F32": "f32", "F16": "f16", "BF16": "bf16"}

_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def gguf_name_to_hf(name: str) -> str | None:
    """The HF name of a GGUF tensor name, or None when `GGUF_TO_HF` / `GGUF_LAYER_TO_HF` have none."""
    if name in GGUF_TO_HF:
        return GGUF_TO_HF[name]
    m = _BLK.fullmatch(name)
    if m and m.group(2) in GGUF_LAYER_TO_HF:
        return f"model.layers.{m.group(1)}.{GGUF_LAYER_TO_HF[m.group(2)]}.weight"
    return None


def unpermute_qk(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation of q_proj/k_proj rows (a new array).

    `rows` has one row per output feature (floats, or raw block bytes: rows
    are whole blocks). The converter wrote, per head, rows (i, j) -> i*2 + j from
    HF's j*(head_dim/2) + i; this puts them back.
    """
    n = rows.shape[0]
    if n % (2 * n_head):
        raise ValueError(f"unpermute_qk: {n} rows do not split into {n_head} heads of even size")
    return np.ascontiguousarray(
        rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape))


# ---------------------------------------------------------------------------
# GGUF


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("load_gguf needs the 'gguf' package: pip install 'opdispatch[models]'") from e
    return gguf


class _GGUFFormatError(ValueError):
    """A structural problem found while reading; the caller prefixes the file name."""


def _reader_class(gguf: Any) -> type:
    """GGUFReader with every read bounds-checked and every tensor validated before it is mapped.

    GGUFReader slices its memmap without checking sizes (numpy clips a slice at
    the end quietly) and fails later with messages that name no tensor. Two
    overrides: `_get` refuses any read that would end past the file; and
    `_build_tensors` checks each tensor's type, shape and extent, naming it,
    before the reader maps it (it unpacks `field.parts` exactly as the reader's
    own `_build_tensors` does).
    """
    sizes = gguf.GGML_QUANT_SIZES
    types = gguf.GGMLQuantizationType

    class Reader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            offset, count = int(offset), int(count)
            end = offset + np.dtype(dtype).itemsize * count
            if offset < 0 or count < 0 or end > self.data.size:
                raise _GGUFFormatError(
                    f"truncated: a read of {count} x {np.dtype(dtype).name} at byte {offset} ends at byte {end}, "
                    f"past the end of the file ({self.data.size} bytes)")
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            seen: set[str] = set()
            for field in fields:
                _len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                if name in seen:
                    raise _GGUFFormatError(f"tensor '{name}' appears twice")
                seen.add(name)
                ne = [int(d) for d in dims]
                try:
                    qtype = types(int(raw_dtype[0]))
                except ValueError:
                    raise _GGUFFormatError(f"tensor '{name}' has unknown ggml type {int(raw_dtype[0])}") from None
                block, type_size = sizes[qtype]
                if ne and ne[0] % block:
                    raise _GGUFFormatError(f"tensor '{name}' ({qtype.name}, ne {ne}): ne[0] is not a multiple of "
                                           f"its block size {block}")
                n_bytes = math.prod(ne) * type_size // block
                begin = int(start_offs) + int(offset[0])
                if int(offset[0]) % self.alignment:
                    raise _GGUFFormatError(f"tensor '{name}': data offset {int(offset[0])} is not a multiple of "
                                           f"the alignment {self.alignment}")
                if begin + n_bytes > self.data.size:
                    raise _GGUFFormatError(
                        f"tensor '{name}' ({qtype.name}, ne {ne}, {n_bytes} bytes at byte {begin}) runs past the "
                        f"end of the file ({self.data.size} bytes): truncated?")
            super()._build_tensors(start_offs, fields)

    return Reader


def _open_gguf(path: str | os.PathLike[str]) -> Any:
    gguf = _import_gguf()
    try:
        reader = _reader_class(gguf)(path, "r")
    except _GGUFFormatError as e:
        raise ValueError(f"{path}: {e}") from None
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError, TypeError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    if reader.byte_order != "I":
        raise ValueError(f"{path}: a GGUF file of the other byte order (big-endian); only little-endian loads")
    return reader


def _field_value(field: Any) -> Any:
    """A metadata value: a scalar, a str, or a list (arrays of strings give lists of str)."""
    gguf = _import_gguf()
    vt = gguf.GGUFValueType
    main = field.types[0]

    def one(i: int, t: Any) -> Any:
        part = field.parts[i]
        return bytes(part).decode("utf-8", errors="replace") if t == vt.STRING else part.tolist()[0]

    if main == vt.ARRAY:
        return [one(i, field.types[-1]) for i in field.data]
    return one(field.data[0], main)


def _unpermuted(t: Tensor, n_head: int) -> Tensor:
    rows = t.data.reshape(t.shape[0], -1)
    return param(t.name, unpermute_qk(rows, n_head), t.dtype, shape=t.shape)


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Any GGUF file -> (metadata {key: value}, {GGUF name: param}): no renaming, no architecture check.

    Tensors keep their stored format (raw bytes of the memory map); a type
    outside `GGUF_TYPES` is refused naming the tensor. Values of the metadata
    are ints, floats, bools, strs or lists of them.
    """
    reader = _open_gguf(path)
    try:
        meta = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    except (IndexError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: unreadable metadata ({type(e).__name__}: {e})") from e
    tensors: dict[str, Tensor] = {}
    for rt in reader.tensors:
        type_name = rt.tensor_type.name
        if type_name not in GGUF_TYPES:
            raise ValueError(f"{path}: tensor '{rt.name}' has type {type_name}; opdispatch loads "
                             f"{', '.join(GGUF_TYPES)} (requantize the file, e.g. with llama-quantize)")
        shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
        try:
            tensors[rt.name] = param(rt.name, rt.data, GGUF_TYPES[type_name], shape=shape)
        except ValueError as e:
            raise ValueError(f"{path}: tensor '{rt.name}': {e}") from e
    return meta, tensors


def load_gguf(path: str | os.PathLike[str], *, rope_mode: str | None = None) -> tuple[LlamaConfig, dict[str, Tensor]]:
    """A llama GGUF file -> (LlamaConfig, {HF name: param}), tensors in their stored format.

    Metadata read (``llama.`` prefix): block_count, embedding_length,
    feed_forward_length (or expert_feed_forward_length), attention.head_count,
    attention.head_count_kv, rope.freq_base, attention.layer_norm_rms_epsilon,
    context_length; expert_count / expert_used_count for MoE. The vocabulary
    size is the embedding's row count (else the token list's length). The
    config's `dtype` names the storage type of most of the layer matrices when
    `LlamaConfig` accepts it, else f32 (it is what LlamaModel would convert
    float weights to; loaded params keep their own types). Fields the
    installed `LlamaConfig` lacks (rope_mode, experts, experts_used) are not
    passed. Change max_ctx or cache_dtype with ``attrs.evolve(cfg, ...)``.

    rope_mode: None (default) -> "normal" with Q/K rows as stored when
    LlamaConfig has a rope_mode field, else "neox" with Q/K rows un-permuted
    to HF's order; "neox" -> un-permuted; "normal" -> as stored (needs the field).

    RoPE scaling: llama.rope.scaling.factor (or the older rope.scale_linear)
    becomes rope_freq_scale = 1 / factor, as llama.cpp reads it (linear, its
    default type); YaRN and other types are refused. Llama 3's scaling comes
    as the tensor rope_freqs.weight, which LlamaModel takes by that name.

    Tensors without an HF name in the tables are kept under their GGUF name,
    with a warning. Without output.weight (tied embeddings) there is no
    lm_head.weight: LlamaModel then uses the embedding.
    """
    if rope_mode not in (None, "normal", "neox"):
        raise ValueError(f"load_gguf: rope_mode must be None, 'normal' or 'neox', got {rope_mode!r}")
    cfg_fields = {f.name for f in attrs.fields(LlamaConfig)}
    if rope_mode is None:
        rope_mode = "normal" if "rope_mode" in cfg_fields else "neox"
    elif rope_mode == "normal" and "rope_mode" not in cfg_fields:
        raise ValueError("load_gguf: rope_mode='normal' needs a LlamaConfig with a rope_mode field")

    meta, tensors = read_gguf(path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture is {arch!r}; load_gguf reads 'llama' models")

    def key(name: str, default: Any = None, *, required: bool = False) -> Any:
        value = meta.get(f"llama.{name}", default)
        if value is None and required:
            raise ValueError(f"{path}: metadata key 'llama.{name}' is missing")
        if isinstance(value, list):  # per-layer values (head counts): llama has one for all layers
            if not value or any(v != value[0] for v in value):
                raise ValueError(f"{path}: 'llama.{name}' differs between layers ({value}); not supported")
            value = value[0]
        return value

    # -- tensors --------------------------------------------------------------------
    params: dict[str, Tensor] = {}
    unmapped: list[str] = []
    for name, t in tensors.items():
        hf = gguf_name_to_hf(name)
        if hf is None:
            unmapped.append(name)
        else:
            t.name = hf
        params[t.name] = t
    if unmapped:
        warnings.warn(f"{path}: tensors with no HF name, kept under their GGUF names (LlamaModel refuses "
                      f"weights it does not use: drop them first): {', '.join(unmapped)}", stacklevel=2)
    embed = params.get("model.embed_tokens.weight")
    if embed is None:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")

    # -- config --------------------------------------------------------------------
    hidden = int(key("embedding_length", required=True))
    heads = int(key("attention.head_count", required=True))
    kv_heads = int(key("attention.head_count_kv", heads))
    experts = int(key("expert_count", 0) or 0)
    ffn = key("feed_forward_length")
    if experts and key("expert_feed_forward_length") is not None:
        ffn = key("expert_feed_forward_length")  # models that also have a dense FFN size
    if ffn is None:
        raise ValueError(f"{path}: metadata key 'llama.feed_forward_length' is missing")
    if heads <= 0 or hidden % heads:
        raise ValueError(f"{path}: embedding_length {hidden} does not split into {heads} heads")
    head_dim = hidden // heads
    for name in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        value = key(name)
        if value is not None and int(value) != head_dim:
            raise ValueError(f"{path}: 'llama.{name}' = {value} but embedding_length / head_count = {head_dim}; "
                             f"LlamaModel needs them equal")
    scaling = key("rope.scaling.type", "linear")  # llama.cpp's default type
    factor = float(key("rope.scaling.factor", key("rope.scale_linear", 0.0)) or 0.0)
    if scaling not in ("linear", "none", ""):
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported (linear only)")
    vocab = embed.shape[0] if embed.ndim == 2 else len(meta.get("tokenizer.ggml.tokens", ()))
    kwargs: dict[str, Any] = dict(
        vocab=int(vocab), hidden=hidden, layers=int(key("block_count", required=True)), heads=heads,
        kv_heads=kv_heads, ffn=int(ffn), rope_base=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
    )
    ctx = key("context_length")
    if ctx is not None:
        kwargs["max_ctx"] = int(ctx)
    if experts:
        if not {"experts", "experts_used"} <= cfg_fields:
            raise ValueError(f"{path}: a MoE model ({experts} experts) and this LlamaConfig has no MoE fields")
        kwargs["experts"] = experts
        kwargs["experts_used"] = int(key("expert_used_count", required=True))
    if "rope_mode" in cfg_fields:
        kwargs["rope_mode"] = rope_mode
    if factor not in (0.0, 1.0):
        if "rope_freq_scale" not in cfg_fields:
            raise ValueError(f"{path}: linear rope scaling x{factor} and this LlamaConfig has no rope_freq_scale")
        kwargs["rope_freq_scale"] = 1.0 / factor
    cfg = _config(path, kwargs, params)

    if rope_mode == "neox":
        for i in range(cfg.layers):
            for proj, n_head in (("q_proj", cfg.heads), ("k_proj", cfg.kv_heads)):
                name = f"model.layers.{i}.self_attn.{proj}.weight"
                if name in params:
                    params[name] = _unpermuted(params[name], n_head)
    return cfg, params


def _config(path: Any, kwargs: dict[str, Any], params: dict[str, Tensor]) -> LlamaConfig:
    """LlamaConfig with dtype = the commonest storage type of the layer matrices, or f32 if refused."""
    by_type: Counter[str] = Counter()
    for name, t in params.items():
        if name.startswith("model.layers.") and t.ndim >= 2:
            by_type[t.dtype.name] += t.size
    candidates = [by_type.most_common(1)[0][0]] if by_type else []
    for dt in candidates + ["f32"]:
        try:
            return LlamaConfig(**kwargs, dtype=dt)
        except ValueError as e:
            err = e
    raise ValueError(f"{path}: the metadata give no valid llama config: {err}") from err


# ---------------------------------------------------------------------------
# safetensors

_ST_HEADER_MAX = 100 << 20  # the safetensors library's own limit on the JSON header


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _safetensors_file(path: Path) -> dict[str, Tensor]:
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{path}: {size} bytes, too short for a safetensors header length")
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} runs past the end of the file ({size} bytes): "
                             f"truncated or not a safetensors file")
        if n > _ST_HEADER_MAX:
            raise ValueError(f"{path}: header length {n} is over the {_ST_HEADER_MAX}-byte limit")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: the header is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    start, data_len = 8 + n, size - 8 - n
    mm = np.memmap(path, dtype=np.uint8, mode="r") if data_len else np.zeros(0, np.uint8)

    out: dict[str, Tensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict):
                raise ValueError(f"{path}: __metadata__ is not a JSON object")
            continue
        where = f"{path}: tensor '{name}'"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise ValueError(f"{where}: needs dtype, shape and data_offsets, got {info!r}")
        st_dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if st_dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{where} has dtype {st_dtype!r}; opdispatch loads {', '.join(SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise ValueError(f"{where}: data_offsets {offsets!r} is not a pair of integers")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise ValueError(f"{where}: data_offsets [{begin}, {end}] fall outside the data area of {data_len} "
                             f"bytes (file of {size} bytes): truncated or corrupt")
        dt = as_dtype(SAFETENSORS_DTYPES[st_dtype])
        want = math.prod(shape) * dt.block_bytes
        if end - begin != want:
            raise ValueError(f"{where}: {st_dtype} {tuple(shape)} takes {want} bytes but data_offsets "
                             f"[{begin}, {end}] hold {end - begin}")
        spans.append((begin, end, name))
        out[name] = param(name, mm[start + begin:start + end], dt, shape=shape)
    spans.sort()
    for (_, e0, a), (b1, _, b) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"{path}: tensors '{a}' and '{b}' overlap in the data area")
    return out


def load_safetensors(path_or_dir: str | os.PathLike[str]) -> dict[str, Tensor]:
    """A safetensors file, or a directory of shards -> {name: param}, names and f32/f16/bf16 kept.

    In a directory with ``model.safetensors.index.json`` the shards it names
    are loaded and every tensor it lists must be in its shard; without one,
    every ``*.safetensors`` file is loaded. A name in two shards is an error.
    """
    root = Path(path_or_dir)
    if not root.is_dir():
        return _safetensors_file(root)
    index = root / "model.safetensors.index.json"
    weight_map: dict[str, str] | None = None
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        files = [root / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root}: no *.safetensors files")
    out: dict[str, Tensor] = {}
    origin: dict[str, Path] = {}
    for f in files:
        if not f.is_file():
            raise ValueError(f"{index}: shard {f.name} is missing")
        for name, t in _safetensors_file(f).items():
            if name in out:
                raise ValueError(f"{root}: tensor '{name}' is in two shards, {origin[name].name} and {f.name}")
            out[name], origin[name] = t, f
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in out or origin[name].name != Path(shard).name:
                found = origin[name].name if name in out else "no shard"
                raise ValueError(f"{index}: tensor '{name}' is listed in {shard} but found in {found}")
    return out


# ---------------------------------------------------------------------------
# state dicts


def _host_array(name: str, value: Any) -> np.ndarray:
    """A numpy array of a torch tensor (bf16 bit for bit, any device) or an array-like."""
    if type(value).__module__.split(".")[0] == "torch":
        import ml_dtypes
        import torch

        t = value.detach().to("cpu")
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        try:
            return t.numpy()
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"state dict tensor '{name}': {t.dtype} has no numpy equivalent ({e})") from None
    return np.asarray(value)


#: transformers 5's fused MoE experts (Mixtral and others): "experts.gate_up_proj" (E, 2 * ffn, hidden), the
#: gate's rows first, and "experts.down_proj" (E, hidden, ffn), parameters without a ".weight" suffix
_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")


def _unfused(name: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(name, array) pairs under LlamaModel's stacked expert names for a fused expert tensor, else [(name, arr)]."""
    m = _FUSED_EXPERTS.fullmatch(name)
    if m is None:
        return [(name, arr)]
    stem = m.group(1) + "mlp.experts."
    if arr.ndim != 3 or (m.group(2) == "gate_up_proj" and arr.shape[1] % 2):
        raise ValueError(f"state dict tensor '{name}' has shape {arr.shape}; fused experts are (experts, "
                         f"{'2 * ffn, hidden' if m.group(2) == 'gate_up_proj' else 'hidden, ffn'})")
    if m.group(2) == "down_proj":
        return [(stem + "down_proj.weight", arr)]
    f = arr.shape[1] // 2
    return [(stem + "gate_proj.weight", np.ascontiguousarray(arr[:, :f])),
            (stem + "up_proj.weight", np.ascontiguousarray(arr[:, f:]))]


def state_dict_arrays(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A torch/transformers state dict -> {name: numpy array} (host copies of torch tensors, bf16 bit for bit).

    Names are kept, except transformers 5's fused MoE experts
    (``model.layers.{i}.mlp.experts.gate_up_proj`` and ``...down_proj``),
    which become the stacked ``mlp.experts.{gate,up,down}_proj.weight`` that
    `LlamaModel` takes (gate_up split in two). Give the result to LlamaModel
    to have it convert float weights to its config's dtype.
    """
    return {n: a for name, value in state_dict.items() for n, a in _unfused(name, _host_array(name, value))}


def load_state_dict(state_dict: Mapping[str, Any], *, copy: bool = True) -> dict[str, Tensor]:
    """A torch/transformers state dict (or {name: numpy array}) -> {name: param}, names kept.

    f32, f16, bf16 (torch.bfloat16 or ml_dtypes.bfloat16) and integer tensors
    keep their type; float64 becomes f32 (rounded). With copy=False the params
    share the memory of contiguous CPU tensors (mutating those changes the
    weights); the default copies. transformers 5's fused MoE experts are
    renamed and split as `state_dict_arrays` does (the split halves are copies).
    """
    out: dict[str, Tensor] = {}
    for name, arr in (pair for n, v in state_dict.items() for pair in _unfused(n, _host_array(n, v))):
        if arr.dtype == np.float64:
            out[name] = param(name, arr, "f32")
            continue
        try:
            dt = as_dtype(arr.dtype)
        except ValueError:
            raise ValueError(f"state dict tensor '{name}' has dtype {arr.dtype}; opdispatch loads float32, "
                             f"float16, bfloat16, float64 (as f32) and int8/16/32/64") from None
        if copy:
            arr = np.array(arr, order="C", copy=True)
        out[name] = param(name, arr, dt, shape=arr.shape)
    return out
