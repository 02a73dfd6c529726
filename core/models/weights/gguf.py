"""load_gguf: a llama GGUF file -> (LlamaConfig, params); read_gguf: any GGUF file, nothing renamed.

Reads through the `gguf` package (pip install 'opdispatch[models]'), imported
when a file is read, with every read and tensor extent bounds-checked first
and the tensors' data held to ggml's packed layout (no gaps, no overlaps).
GGUF's ``ne`` lists dimensions innermost first: ``ne = [K, M]`` is shape (M, K).
llama.cpp's converter permutes the Q/K rows of each head for ggml's "normal"
RoPE; load_gguf keeps them (rope_mode "normal") or undoes it (docs/models.md).
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from typing import Any

import attrs
import numpy as np

from ...dtypes import DTYPES, from_float
from ...tensor import Tensor, param
from ..llama.config import LlamaConfig
from .names import gguf_name_to_hf



def gguf_dtype(type_name: str) -> str | None:
    """The opdispatch dtype that holds ggml type `type_name` (gguf.GGMLQuantizationType's name) as stored, or None.

    The dtype table is the list: a ggml type loads as stored when its name,
    lowercased, is a dtype's name lowercased (Q4_K -> q4_K, IQ4_XS -> iq4_xs).
    """
    return _BY_LOWER_NAME.get(type_name.lower())


_BY_LOWER_NAME: dict[str, str] = {name.lower(): name for name in DTYPES}


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
    own `_build_tensors` does). The data must follow ggml's packed layout, as
    ggml's loader requires: each tensor's offset is the running size of those
    before it, each padded to the alignment; so no two tensors share bytes,
    which the reader alone would map without complaint.
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
            packed = 0  # where the next tensor's data must start (relative to the data section)
            placed: list[tuple[int, int, str]] = []  # (first byte, end, name) of the tensors checked so far
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
                n_bytes = math.prod(ne) * type_size // block  # Python ints: a huge ne cannot wrap
                off = int(offset[0])
                begin = int(start_offs) + off
                if off % self.alignment:
                    raise _GGUFFormatError(f"tensor '{name}': data offset {off} is not a multiple of "
                                           f"the alignment {self.alignment}")
                if begin + n_bytes > self.data.size:
                    raise _GGUFFormatError(
                        f"tensor '{name}' ({qtype.name}, ne {ne}, {n_bytes} bytes at byte {begin}) runs past the "
                        f"end of the file ({self.data.size} bytes): truncated?")
                if off != packed:
                    _refuse_unpacked(name, off, n_bytes, packed, placed, self.alignment)
                placed.append((off, off + n_bytes, name))
                packed = off + -(-n_bytes // self.alignment) * self.alignment
            super()._build_tensors(start_offs, fields)

    return Reader


def _refuse_unpacked(name: str, off: int, n_bytes: int, packed: int, placed: list[tuple[int, int, str]],
                     alignment: int) -> None:
    """Raise for tensor `name` at data offset `off` where the packed layout puts it at `packed`, naming the
    tensor whose bytes it overlaps if one does."""
    for first, end, other in placed:
        if first < off + n_bytes and off < end:
            raise _GGUFFormatError(f"tensor '{name}' (data bytes {off}..{off + n_bytes}) overlaps tensor '{other}' "
                                   f"(data bytes {first}..{end})")
    if not placed:
        raise _GGUFFormatError(f"tensor '{name}': data offset {off}, expected 0: the first tensor's data starts the "
                               "data section, as ggml's loader requires")
    first, end, prev = placed[-1]
    raise _GGUFFormatError(f"tensor '{name}': data offset {off}, expected {packed}: each tensor's data follows the "
                           f"previous one's ('{prev}', data bytes {first}..{end}) padded to the alignment {alignment}, "
                           "as ggml's loader requires")


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


def permute_qk(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q_proj/k_proj rows (HF order -> GGUF order), a new array; the inverse
    of `unpermute_qk`."""
    n = rows.shape[0]
    if n % (2 * n_head):
        raise ValueError(f"permute_qk: {n} rows do not split into {n_head} heads of even size")
    return np.ascontiguousarray(
        rows.reshape(n_head, 2, n // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape))


def read_gguf_fields(path: str | os.PathLike[str]) -> list[tuple[str, Any, Any, Any]]:
    """The metadata of a GGUF file as written: [(key, value, GGUFValueType, element type of an array or None)],
    to copy it into another file with the same types (llama.cpp checks them). Values as `read_gguf` gives them."""
    reader = _open_gguf(path)
    try:
        return [(name, _field_value(f), f.types[0], f.types[-1] if len(f.types) > 1 else None)
                for name, f in reader.fields.items() if not name.startswith("GGUF.")]
    except (IndexError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: unreadable metadata ({type(e).__name__}: {e})") from e


def _unpermuted(t: Tensor, n_head: int) -> Tensor:
    rows = t.data.reshape(t.shape[0], -1)
    return param(t.name, unpermute_qk(rows, n_head), t.dtype, shape=t.shape)


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Any GGUF file -> (metadata {key: value}, {GGUF name: param}): no renaming, no architecture check.

    Tensors whose type is in opdispatch's dtype table (`gguf_dtype`) keep it
    (raw bytes of the memory map), whatever the mix of types in the file. A
    tensor of a type gguf knows but the table lacks (TQ2_0, NVFP4, ...) is
    dequantized here by gguf.quants to f16 (bf16 where a value exceeds f16's
    range; f32 for F64), with one warning naming every such tensor and its
    type; a type gguf cannot dequantize either is refused naming the tensor.
    Values of the metadata are ints, floats, bools, strs or lists of them.
    """
    reader = _open_gguf(path)
    try:
        meta = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    except (IndexError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: unreadable metadata ({type(e).__name__}: {e})") from e
    tensors: dict[str, Tensor] = {}
    converted: list[str] = []
    for rt in reader.tensors:
        type_name = rt.tensor_type.name
        shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
        dt = gguf_dtype(type_name)
        data = rt.data
        if dt is None:
            dt, data = _dequantized(path, rt)
            converted.append(f"{rt.name} ({type_name} -> {dt})")
        try:
            tensors[rt.name] = param(rt.name, data, dt, shape=shape)
        except ValueError as e:
            raise ValueError(f"{path}: tensor '{rt.name}': {e}") from e
    if converted:
        warnings.warn(f"{path}: {len(converted)} tensors of types opdispatch does not hold, dequantized at load: "
                      f"{', '.join(converted)}", stacklevel=2)
    return meta, tensors


def _dequantized(path: Any, rt: Any) -> tuple[str, np.ndarray]:
    """(dtype, values) of a tensor whose ggml type the dtype table lacks: gguf's dequantization, rounded to f16,
    or to bf16 where f16 would overflow (an F64 tensor becomes f32)."""
    gguf = _import_gguf()
    if rt.data.dtype.kind == "f":  # a plain float type (F64): no blocks to decode
        return "f32", rt.data.astype(np.float32)
    try:
        values = np.asarray(gguf.quants.dequantize(rt.data, rt.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor '{rt.name}' has type {rt.tensor_type.name}, which opdispatch does not "
                         "hold and gguf cannot dequantize (requantize the file, e.g. with llama-quantize)") from None
    with np.errstate(over="ignore"):
        half = values.astype(np.float16)
    if np.count_nonzero(np.isinf(half)) > np.count_nonzero(np.isinf(values)):
        return "bf16", from_float("bf16", values)
    return "f16", half


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
