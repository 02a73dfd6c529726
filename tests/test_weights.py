"""Weight loaders (opdispatch.models.weights.*) on files written by the gguf and safetensors packages.

The GGUF files are written by gguf's own GGUFWriter, quantized by gguf's own
quantizer and named through gguf's own TensorNameMap: implementations nobody
here wrote. The safetensors files are written by the safetensors package, and
by hand for the malformed cases.
"""

from __future__ import annotations

import json
import re
import struct
import warnings
from pathlib import Path
from typing import Any

import attrs
import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from opdispatch import dtypes
from opdispatch.dtypes import from_float
from opdispatch.quants import FORMATS
from opdispatch.backends.cuda.devices import H200
from opdispatch.cli import main as cli_main
from opdispatch.compiler import compile
from opdispatch.models.generate import Generator
from opdispatch.models.llama.config import LlamaConfig
from opdispatch.models.llama.model import LlamaModel
from opdispatch.models.llama.names import random_weights, weight_shapes
from opdispatch.models.llama.stored import weight_types
from opdispatch.models.mixture import ModelFacts, tensor_type
from opdispatch.models.weights.gguf import gguf_dtype, load_gguf, read_gguf, unpermute_qk
from opdispatch.models.weights.names import GGUF_LAYER_TO_HF, GGUF_TO_HF, gguf_name_to_hf
from opdispatch.models.weights.safetensors import load_safetensors
from opdispatch.models.weights.state_dict import load_state_dict, state_dict_arrays
from opdispatch.ops.base import ENCODABLE
from opdispatch.testing.metrics import nmse
from opdispatch.tensor import Tensor
from test_kquants import HALVES

QUANTS = {"q4_0": GT.Q4_0, "q4_1": GT.Q4_1, "q5_0": GT.Q5_0, "q5_1": GT.Q5_1, "q8_0": GT.Q8_0}
GGUF_TYPE = {"f32": GT.F32, "f16": GT.F16, "bf16": GT.BF16, **QUANTS}


def values(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    """Random float32, no zeros, magnitudes over a few octaves (so blocks differ in scale)."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-3, 4, shape[:-1] + (1,)))
    return (x * scale).astype(np.float32)


def stored(x: np.ndarray, dt: str) -> np.ndarray:
    """x in GGUF's storage of dt, made by gguf itself (raw uint8 for bf16 and the block formats)."""
    if dt == "f32":
        return x.astype(np.float32)
    if dt == "f16":
        return x.astype(np.float16)
    return gguf.quants.quantize(x, GGUF_TYPE[dt])


def gguf_values(raw: np.ndarray, dt: str) -> np.ndarray:
    """What gguf decodes its storage of dt to (float32)."""
    return np.asarray(gguf.quants.dequantize(raw, GGUF_TYPE[dt]), dtype=np.float32)


def write_gguf(path: Path, tensors: dict[str, np.ndarray], meta: dict[str, Any] | None = None,
               types: dict[str, str] | None = None) -> None:
    """A GGUF file by gguf's GGUFWriter: float arrays stored as types[name] (f32 by default)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (meta or {}).items():
        getattr(w, f"add_{key}")(value)
    for name, x in tensors.items():
        dt = (types or {}).get(name, "f32")
        w.add_tensor(name, stored(x, dt), raw_dtype=GGUF_TYPE[dt] if dt in QUANTS or dt == "bf16" else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------
# Our block formats against gguf's quantizer (and, on ties, ggml's C reference)


@pytest.mark.parametrize("fmt", sorted(QUANTS))
def test_quantize_matches_gguf_quantizer_byte_for_byte(fmt: str, rng: np.random.Generator) -> None:
    cases = {
        "normal": values(rng, (64, 256)),
        "uniform": rng.uniform(-1, 1, (64, 256)).astype(np.float32),
        "heavy tails": np.clip(rng.standard_cauchy((64, 256)), -1e3, 1e3).astype(np.float32),
        # values on a coarse grid put x*id on exact half-integers: rounding ties in every block
        "quarter grid": (rng.integers(-40, 41, (64, 256)) / 4).astype(np.float32),
        "integers": rng.integers(-127, 128, (64, 256)).astype(np.float32),
        "tiny (f16 subnormal d)": (rng.standard_normal((64, 256)) * 1e-6).astype(np.float32),
    }
    for case, x in cases.items():
        ours = dtypes.quantize(fmt, x)
        theirs = gguf.quants.quantize(x, QUANTS[fmt])
        bad = np.argwhere((ours != theirs).reshape(64, -1, dtypes.dtype(fmt).block_bytes).any(-1))
        assert not bad.size, f"{fmt} {case}: {len(bad)} blocks differ from gguf's, first (row, block) {bad[0]}"
        np.testing.assert_array_equal(dtypes.dequantize(fmt, ours), gguf_values(theirs, fmt), err_msg=f"{fmt} {case}")


@pytest.mark.parametrize("fmt", sorted(QUANTS))
def test_signed_zero_ties_follow_ggml_c_reference(fmt: str, rng: np.random.Generator) -> None:
    """Where gguf-py and ggml's quantize_row_*_ref part ways, we follow the C reference.

    They differ only on the sign of a zero scale or minimum: (1) in an all-zero
    block ggml's q4_0/q5_0 keep their starting max = +0.0f, so d = +0/-8 = -0
    (f16 0x8000) whatever the zeros' signs; gguf-py takes x[argmax|x|], the
    first element, whose sign flips d's. (2) q4_1/q5_1 take the first minimum
    (strict `<`), so with -0.0 before +0.0 m = -0 and with +0.0 first m = +0;
    numpy's min reduction (gguf-py) does not promise which zero it returns.
    Decoded values are equal either way. (Checked against the C functions
    compiled with gcc -ffp-contract=off: these are the C's bytes.)
    """
    zeros = np.zeros((1, 32), np.float32)
    zeros[0, ::2] = -0.0  # starts with -0.0
    ours = dtypes.quantize(fmt, zeros)
    d = ours[0, :2].view("<f2")[0]
    if fmt in ("q4_0", "q5_0"):
        assert ours[0, :2].tolist() == [0x00, 0x80]  # -0: +0.0f / -8
    else:
        assert d == 0 and not np.signbit(d)  # q8_0: +0 / 127; q4_1/q5_1: max - min = -0 - -0 = +0
    if fmt in ("q4_1", "q5_1"):
        ones = values(rng, (1, 32))
        ones[0] = np.abs(ones[0]) + 1
        neg_first, pos_first = ones.copy(), ones.copy()
        neg_first[0, 3], neg_first[0, 9] = -0.0, 0.0
        pos_first[0, 3], pos_first[0, 9] = 0.0, -0.0
        assert dtypes.quantize(fmt, neg_first)[0, 2:4].tolist() == [0x00, 0x80]  # m = -0
        assert dtypes.quantize(fmt, pos_first)[0, 2:4].tolist() == [0x00, 0x00]  # m = +0
    np.testing.assert_array_equal(dtypes.dequantize(fmt, ours), 0.0)


# ---------------------------------------------------------------------------
# GGUF tensors


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16", *sorted(QUANTS)])
def test_gguf_tensors_load_as_stored(dt: str, tmp_path: Path, rng: np.random.Generator) -> None:
    arrays = {"a.weight": values(rng, (3, 5, 64)), "b.weight": values(rng, (7, 96)), "c.weight": values(rng, (128,))}
    path = tmp_path / f"{dt}.gguf"
    write_gguf(path, arrays, {"block_count": 1}, types={n: dt for n in arrays})
    meta, tensors = read_gguf(path)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 1
    reader = gguf.GGUFReader(str(path))
    for rt in reader.tensors:
        t = tensors[rt.name]
        x = arrays[rt.name]
        assert isinstance(t, Tensor) and t.shape == x.shape and t.dtype.name == dt  # ne reversed = numpy order
        raw = np.ascontiguousarray(stored(x, dt)).view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(t.data, raw)  # byte-identical: no conversion
        assert not t.data.flags.owndata and not t.data.flags.writeable  # a view of the read-only memmap
        host = dtypes.to_host_float(dt, t.host_view(t.data))
        if dt in QUANTS:
            np.testing.assert_array_equal(host, gguf_values(stored(x, dt), dt).reshape(x.shape))
        elif dt == "bf16":
            np.testing.assert_array_equal(host, x.astype(ml_dtypes.bfloat16).astype(np.float32))
        else:
            np.testing.assert_array_equal(host, x.astype(dtypes.dtype(dt).numpy).astype(np.float32))


def block_rows(rng: np.random.Generator, dt: str, rows: int, cols: int) -> np.ndarray:
    """rows x cols values of block format dt as raw blocks: quantized by opdispatch where it has an encoder, else
    random K-quant blocks with modest f16 scales (test_kquants.HALVES), else random bytes."""
    if FORMATS[dt].encode is not None:
        return dtypes.quantize(dt, values(rng, (rows, cols), cols ** -0.5))
    d = dtypes.dtype(dt)
    raw = rng.integers(0, 256, (rows * cols // d.block_size, d.block_bytes), np.uint8)
    for at in HALVES.get(dt, ()):
        scale = rng.uniform(-1, 1, len(raw)) * 2e-3 / cols ** 0.5
        raw[:, at:at + 2] = scale.astype("<f2").view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def write_raw_gguf(path: Path, tensors: dict[str, tuple[str, np.ndarray]], meta: dict[str, Any] | None = None) -> None:
    """A GGUF of {name: (ggml type name, data)}: float/int arrays as they are, block formats as raw bytes."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (meta or {}).items():
        getattr(w, f"add_{key}")(value)
    for name, (type_name, data) in tensors.items():
        raw = data.dtype == np.uint8 or type_name == "BF16"
        w.add_tensor(name, data.view(np.uint8) if type_name == "BF16" else data,
                     raw_dtype=GT[type_name] if raw else None)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def test_gguf_every_table_type_loads_as_stored_in_one_file(tmp_path: Path, rng: np.random.Generator) -> None:
    """One file mixing every type of the dtype table (floats, integers, each block format): each loads as stored."""
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for name, dt in dtypes.DTYPES.items():
        if dt.is_quant:
            data = block_rows(rng, name, 3, 512)
        elif dt.is_int:
            data = rng.integers(-100, 100, (3, 7)).astype(dt.numpy)
        else:
            data = from_float(name, values(rng, (3, 7)))
        tensors[f"t.{name}"] = (name.upper(), data)
    path = tmp_path / "mixed.gguf"
    write_raw_gguf(path, tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is converted
        _, loaded = read_gguf(path)
    for name, (type_name, data) in tensors.items():
        t = loaded[name]
        assert t.dtype.name == name[2:] == gguf_dtype(type_name)
        np.testing.assert_array_equal(t.data, np.ascontiguousarray(data).view(np.uint8).reshape(-1))
        assert not t.data.flags.owndata  # a view of the memory map: no conversion


def test_gguf_foreign_types_are_dequantized_at_load_with_one_warning(tmp_path: Path,
                                                                     rng: np.random.Generator) -> None:
    """Types gguf knows and the dtype table lacks become f16, or bf16 where a value is past f16's range (MXFP4's
    power-of-two scales reach that; once the table holds mxfp4 it loads as stored instead), in one warning."""
    foreign = [t for t in (GT.TQ1_0, GT.TQ2_0) if gguf_dtype(t.name) is None]
    assert foreign, "the dtype table holds the ternary formats now: pick other foreign types for this test"
    small, large = values(rng, (4, 256)), values(rng, (2, 256), 1e6)
    big_type = gguf_dtype("MXFP4") or "bf16"  # stored as mxfp4 if the table has it, else dequantized to bf16
    tensors = {"a.weight": ("F32", small), "big.weight": ("MXFP4", gguf.quants.quantize(large, GT.MXFP4))}
    for t in foreign:
        tensors[f"{t.name.lower()}.weight"] = (t.name, gguf.quants.quantize(small, t))
    path = tmp_path / "foreign.gguf"
    write_raw_gguf(path, tensors)
    with pytest.warns(UserWarning) as record:
        _, loaded = read_gguf(path)
    assert len(record) == 1
    msg = str(record[0].message)
    n = len(foreign) + (big_type == "bf16")
    assert f": {n} tensors of types opdispatch does not hold, dequantized at load: " in msg
    assert ("big.weight (MXFP4 -> bf16)" in msg) == (big_type == "bf16") and "a.weight" not in msg
    assert all(f"{t.name.lower()}.weight ({t.name} -> f16)" in msg for t in foreign)
    for name, (type_name, raw) in tensors.items():
        t = loaded[name]
        want_type = {"F32": "f32", "MXFP4": big_type}.get(type_name, "f16")
        assert t.dtype.name == want_type
        want = np.asarray(gguf.quants.dequantize(raw, GT[type_name]), np.float32)
        assert t.shape == want.shape
        if t.dtype.is_quant:  # held as stored
            np.testing.assert_array_equal(t.data, raw.reshape(-1))
            continue
        np.testing.assert_array_equal(dtypes.to_host_float(t.dtype, t.host_view(t.data)),
                                      dtypes.to_host_float(t.dtype, from_float(t.dtype, want)))
    assert np.abs(dtypes.to_host_float(loaded["big.weight"].dtype, loaded["big.weight"].host_view(
        loaded["big.weight"].data))).max() > 65504  # the bf16 case is one: f16 would overflow


def test_gguf_type_gguf_cannot_dequantize_is_refused_naming_the_tensor(tmp_path: Path,
                                                                       rng: np.random.Generator) -> None:
    assert gguf_dtype("Q1_0") is None
    block, size = gguf.GGML_QUANT_SIZES[GT.Q1_0]
    path = tmp_path / "q1.gguf"
    write_raw_gguf(path, {"token_embd.weight": ("F32", values(rng, (4, 32))),
                          "blk.0.attn_q.weight": ("Q1_0", rng.integers(0, 256, (2, 2 * size), dtype=np.uint8))})
    with pytest.raises(ValueError, match=r"q1\.gguf: tensor 'blk\.0\.attn_q\.weight' has type Q1_0, which opdispatch "
                                         r"does not hold and gguf cannot dequantize"):
        read_gguf(path)


def tensor_layout(path: Path) -> tuple[int, list[tuple[str, int, int, int]]]:
    """(data start, [(name, info offset, data begin, data end)]) of a GGUF file, by gguf's reader."""
    reader = gguf.GGUFReader(str(path))
    return reader.data_offset, [(t.name, t.field.offset, t.data_offset, t.data_offset + t.n_bytes)
                                for t in reader.tensors]


def test_gguf_truncated_anywhere_is_a_clear_error(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "full.gguf"
    arrays = {"token_embd.weight": values(rng, (8, 64)), "blk.0.attn_q.weight": values(rng, (64, 64)),
              "blk.0.ffn_up.weight": values(rng, (32, 64))}
    write_gguf(path, arrays, {"block_count": 1, "embedding_length": 64},
               types={"blk.0.attn_q.weight": "q4_0", "blk.0.ffn_up.weight": "q8_0"})
    data = path.read_bytes()
    data_start, layout = tensor_layout(path)
    data_end = max(end for *_, end in layout)
    # every cut inside the header, and cuts at random and at the edges of each tensor's data
    cuts = set(range(data_start + 1)) | set(rng.integers(data_start, data_end, 60).tolist())
    cuts |= {c for _, _, b, e in layout for c in (b + 1, e - 1)}
    cut_path = tmp_path / "cut.gguf"
    for cut in sorted(cuts):
        cut_path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=re.escape(str(cut_path))) as err:
            read_gguf(cut_path)
        if cut >= data_start:  # the header is whole: the first tensor cut off is named
            first = min((b, name) for name, _, b, e in layout if cut < e)[1]
            assert f"tensor '{first}'" in str(err.value) and "runs past the end of the file" in str(err.value)
    # The alignment padding after the last tensor is not data: cutting it loses nothing.
    cut_path.write_bytes(data[:data_end])
    assert set(read_gguf(cut_path)[1]) == set(arrays)


def test_gguf_corrupt_headers_are_clear_errors(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "ok.gguf"
    write_gguf(path, {"token_embd.weight": values(rng, (8, 64)), "blk.0.attn_k.weight": values(rng, (32, 64))},
               {"block_count": 1}, types={"blk.0.attn_k.weight": "q5_1"})
    data = bytearray(path.read_bytes())
    _, layout = tensor_layout(path)
    name, info, _, _ = layout[1]
    # tensor info: u64 name length, name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset
    n_dims_at = info + 8 + len(name)
    type_at = n_dims_at + 4 + 8 * 2
    bad = tmp_path / "bad.gguf"

    def expect(mutated: bytes | bytearray, pattern: str) -> None:
        bad.write_bytes(mutated)
        with pytest.raises(ValueError, match=pattern):
            read_gguf(bad)

    expect(b"", r"bad\.gguf: not a readable GGUF file")
    expect(b"GGML" + bytes(data[4:]), r"bad\.gguf: not a readable GGUF file \(ValueError: GGUF magic invalid")
    wrong_type = data.copy()
    wrong_type[type_at:type_at + 4] = struct.pack("<I", 99)
    expect(wrong_type, r"bad\.gguf: tensor 'blk\.0\.attn_k\.weight' has unknown ggml type 99")
    far = data.copy()
    far[type_at + 4:type_at + 12] = struct.pack("<Q", 1 << 40)
    expect(far, r"tensor 'blk\.0\.attn_k\.weight' \(Q5_1, ne \[64, 32\], 1536 bytes at byte \d+\) runs past the end")
    misaligned = data.copy()
    misaligned[type_at + 4:type_at + 12] = struct.pack("<Q", 7)
    expect(misaligned, r"tensor 'blk\.0\.attn_k\.weight': data offset 7 is not a multiple of the alignment 32")
    odd_row = data.copy()
    odd_row[n_dims_at + 4:n_dims_at + 12] = struct.pack("<Q", 48)  # ne[0] 48: not whole 32-value blocks
    expect(odd_row, r"tensor 'blk\.0\.attn_k\.weight' \(Q5_1, ne \[48, 32\]\): ne\[0\] is not a multiple of its "
                    r"block size 32")
    huge_name = data.copy()
    huge_name[info:info + 8] = struct.pack("<Q", 1 << 62)  # a name length past the end of the file
    expect(huge_name, r"bad\.gguf: truncated: a read of \d+ x uint8 at byte \d+ ends at byte \d+, past the end")
    huge_count = data.copy()
    huge_count[8:16] = struct.pack("<Q", 1 << 50)  # tensor count
    expect(huge_count, r"bad\.gguf: ")


# ---------------------------------------------------------------------------
# A tiny Llama in GGUF, as llama.cpp's converter writes one


def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute of q_proj/k_proj rows (HF rotate-half -> ggml pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stacked_experts(cfg: LlamaConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """random_weights' Mixtral names (one expert at a time) -> the stacked names GGUF and LlamaModel use."""
    out = {n: w for n, w in weights.items() if ".block_sparse_moe." not in n}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out[p + "mlp.gate.weight"] = weights[p + "block_sparse_moe.gate.weight"]
        for proj, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            out[p + f"mlp.experts.{proj}.weight"] = np.stack(
                [weights[p + f"block_sparse_moe.experts.{e}.{w}.weight"] for e in range(cfg.experts)])
    return out


def write_llama_gguf(path: Path, cfg: LlamaConfig, weights: dict[str, np.ndarray], matrix_type: str,
                     *, tied: bool = False, meta: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """cfg and HF-named float weights as a llama GGUF, as llama.cpp's converter writes one.

    Q/K rows permuted, names by gguf's TensorNameMap, norms and the MoE router
    f32, other matrices in matrix_type by gguf's quantizer. Returns the values
    the file holds, HF names and order (each weight after its storage round trip).
    """
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.layers)
    tensors, types, held = {}, {}, {}
    for hf, w in weights.items():
        if tied and hf == "lm_head.weight":
            continue
        name = "rope_freqs.weight" if hf == "rope_freqs.weight" else names.get_name(hf, try_suffixes=(".weight",))
        dt = "f32" if w.ndim == 1 or hf.endswith(".mlp.gate.weight") else matrix_type
        if ".q_proj." in hf or ".k_proj." in hf:
            n_head = cfg.heads if ".q_proj." in hf else cfg.kv_heads
            tensors[name] = hf_to_gguf_permute(w, n_head)
        else:
            tensors[name] = w
        types[name] = dt
        raw = stored(w, dt)
        held[hf] = (gguf_values(raw, dt) if dt in QUANTS or dt == "bf16" else raw.astype(np.float32)).reshape(w.shape)
    header = {"block_count": cfg.layers, "context_length": cfg.max_ctx, "embedding_length": cfg.hidden,
              "feed_forward_length": cfg.ffn, "head_count": cfg.heads, "head_count_kv": cfg.kv_heads,
              "rope_freq_base": cfg.rope_base, "layer_norm_rms_eps": cfg.rms_eps,
              "rope_dimension_count": cfg.head_dim, "token_list": [f"<t{i}>" for i in range(cfg.vocab)]}
    if cfg.experts:
        header |= {"expert_count": cfg.experts, "expert_used_count": cfg.experts_used}
    write_gguf(path, tensors, header | (meta or {}), types)
    return held


def logits(model: LlamaModel, prompt: list[int], n_decode: int = 2) -> np.ndarray:
    """Prefill logits of `prompt`, then those of n_decode steps feeding back the prefill's argmax (on cpu)."""
    gen = Generator(model, "cpu")
    out = [gen.forward(prompt)]
    for _ in range(n_decode):
        out.append(gen.forward([int(np.argmax(out[-1][-1]))]))
    return np.concatenate(out)


def assert_same_logits(got: np.ndarray, ref: np.ndarray, rel: float = 1e-5) -> None:
    err = np.abs(got - ref).max()
    assert err <= rel * np.abs(ref).max(), f"max |logit diff| {err:.3g} of max |logit| {np.abs(ref).max():.3g}"
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def tiny_cfg(**kw: Any) -> LlamaConfig:
    base = dict(vocab=160, hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, rope_base=5000.0,
                rms_eps=float(np.float32(1e-6)), max_ctx=64, dtype="f32", cache_dtype="f32")
    return LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("matrix_type", ["f32", "f16", "bf16", *sorted(QUANTS)])
def test_tiny_llama_gguf_runs_like_its_float_weights(matrix_type: str, moe: bool, tmp_path: Path,
                                                     rng: np.random.Generator) -> None:
    """Load a GGUF as llama.cpp writes one; its logits equal those of the same values as f32 HF weights."""
    cfg = tiny_cfg(**({"ffn": 64, "experts": 4, "experts_used": 2} if moe else {}))
    weights = random_weights(cfg, seed=int(rng.integers(2**31)))
    if moe:
        weights = stacked_experts(cfg, weights)
    path = tmp_path / "tiny.gguf"
    held = write_llama_gguf(path, cfg, weights, matrix_type)

    loaded_cfg, params = load_gguf(path)
    for f in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "rope_base", "rms_eps", "max_ctx",
              "experts", "experts_used"):
        assert getattr(loaded_cfg, f) == getattr(cfg, f), f
    assert loaded_cfg.rope_mode == "normal"  # Q/K rows as the converter stored them
    assert set(params) == set(weights)
    for name, t in params.items():
        assert t.name == name and t.shape == weights[name].shape
        assert t.dtype.name == ("f32" if t.ndim == 1 or name.endswith(".mlp.gate.weight") else matrix_type)

    prompt = rng.integers(0, cfg.vocab, 9).tolist()
    got = logits(LlamaModel(attrs.evolve(loaded_cfg, cache_dtype="f32"), params), prompt)
    ref = logits(LlamaModel(cfg, held), prompt)  # the same values as f32, HF rows, neox RoPE
    assert_same_logits(got, ref)

    # rope_mode="neox" gives HF's rows back: the same logits with neox RoPE.
    neox_cfg, neox = load_gguf(path, rope_mode="neox")
    assert neox_cfg.rope_mode == "neox"
    assert_same_logits(logits(LlamaModel(attrs.evolve(neox_cfg, cache_dtype="f32"), neox), prompt), ref)
    # The comparison sees RoPE: the file's rows run with neox RoPE are far off.
    wrong = logits(LlamaModel(attrs.evolve(loaded_cfg, cache_dtype="f32", rope_mode="neox"), params), prompt)
    assert np.abs(wrong - ref).max() > 1e-2 * np.abs(ref).max()


# A quantized GGUF on the GPU: block formats all the way to the kernels

GPU_CFG = dict(vocab=512, hidden=256, heads=4, kv_heads=2, ffn=512, max_ctx=128)  # head_dim 64: CUDA flash attention
GPU_CFG_LAYERS = tiny_cfg().layers


#: the block formats the GPU tests write a GGUF in: gguf's own quantizer for the legacy five, `opdispatch quantize`
#: for the others. Left out: q8_K (no GPU kernel takes it as a weight: it is ggml's K-quant activation type) and
#: the grid I-quants (iq2_xxs ... iq1_m), which no quantizer here writes (opdispatch only dequantizes them)
GPU_FORMATS = tuple(q for q in ENCODABLE if q != "q8_K")
#: logits NMSE of cuda0 against the CPU reference on the same file: a few 1e-5 a matmul from b's rounding
#: (docs/conformance.md: Q8_1_NMSE = 1.55e-5 on uniform b), over 2 layers, the LM head and softmax's spread
LOGITS_NMSE = 1e-3


def quantized_gguf_model(path: Path, matrix_type: str, seed: int) -> tuple[LlamaModel, LlamaModel]:
    """(the GGUF's model as loaded, in its block formats; the f32 model of the weights before quantization).

    matrix_type: a block format (every matrix in it) or a preset of `opdispatch quantize` (Q4_K_M: its mixture).
    """
    cfg = tiny_cfg(**GPU_CFG)
    weights = random_weights(cfg, seed=seed)
    if matrix_type in QUANTS:
        write_llama_gguf(path, cfg, weights, matrix_type)
    else:
        source = path.with_name(path.stem + "-f32.gguf")
        write_llama_gguf(source, cfg, weights, "f32")
        assert cli_main(["quantize", str(source), str(path), matrix_type]) == 0
    loaded_cfg, params = load_gguf(path)
    held = {t.dtype.name for t in params.values() if t.ndim == 2}
    assert held == ({matrix_type} if matrix_type in dtypes.DTYPES else set(weight_types(cfg, matrix_type).values()))
    return LlamaModel(attrs.evolve(loaded_cfg, cache_dtype="f32"), params), LlamaModel(cfg, weights)


def steps_on(model: LlamaModel, prompt: list[int], feed: list[int], device: str) -> np.ndarray:
    """Logits of a prefill of `prompt`, then of one decode step per token of `feed`, on `device`."""
    gen = Generator(model, device)
    return np.concatenate([gen.forward(prompt)] + [gen.forward([t]) for t in feed])


def assert_planned_on_the_gpu(plan: Any, model: LlamaModel) -> None:
    """Every block-format weight of `model` (the matmuls' and the embedding) is read on the GPU in its own format;
    nothing falls back to the CPU and no weight is converted or moved on the way."""
    reads = {(n.srcs[0].base.name, n.srcs[0].dtype.name, s.device.kind) for s in plan.steps
             if s.kind in ("kernel", "fused") for n in s.nodes
             if n.op in ("mul_mat", "get_rows") and n.srcs[0].dtype.is_quant}
    weights = {(t.name, t.dtype.name, "cuda") for t in model.params.values() if t.dtype.is_quant}
    apart = {w for w in weights if not re.search(r"\.[qkv]_proj\.", w[0])}  # q, k, v may be read stacked as qkv
    assert apart <= reads and {r[1:] for r in reads} == {w[1:] for w in weights}
    assert len(reads) >= 1 + GPU_CFG_LAYERS * 5 + 1  # embedding, (stacked qkv or q, k, v), o, gate, up, down, head
    assert not [s for s in plan.steps if s.kind == "copy"]
    assert {s.device.kind for s in plan.steps if s.kind in ("kernel", "fused")} == {"cuda"}


@pytest.mark.parametrize("matrix_type", GPU_FORMATS)
def test_quantized_gguf_is_planned_on_the_gpu_in_its_block_format(matrix_type: str, tmp_path: Path,
                                                                  rng: np.random.Generator) -> None:
    """On an H200 (planned without one) every matmul and the embedding read the file's blocks on the GPU, for
    every format the GPU tests write (GPU_FORMATS: the grid I-quants and q8_K left out, see there)."""
    model, _ = quantized_gguf_model(tmp_path / "q.gguf", matrix_type, int(rng.integers(2**31)))
    for n_tokens in (1, 12):  # decode (quantized mat-vec) and prefill (mmq or dequantized tiles into cuBLAS)
        assert_planned_on_the_gpu(compile(model.build(n_tokens, 0)[0], H200), model)


#: the file types of `opdispatch quantize` the GPU tests write (llama-quantize's mixtures; on GPU_CFG, 2 query heads a
#: KV head and 2 layers: Q4_K_M's second layer q6_K attn_v and ffn_down, IQ4_*'s first ffn_down q5_K... see
#: weight_types)
GPU_PRESETS = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS")


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_preset_gguf_is_planned_on_the_gpu_in_its_block_formats(preset: str, tmp_path: Path,
                                                                rng: np.random.Generator) -> None:
    model, _ = quantized_gguf_model(tmp_path / "q.gguf", preset, int(rng.integers(2**31)))
    for n_tokens in (1, 12):
        assert_planned_on_the_gpu(compile(model.build(n_tokens, 0)[0], H200), model)


def runs_on_cuda_like_the_cpu_reference(model: LlamaModel, f32_model: LlamaModel, what: str,
                                        rng: np.random.Generator) -> None:
    """A prefill and 8 greedy decode steps on cuda0 and on the CPU reference, the same file: logits NMSE within
    LOGITS_NMSE (printed beside the format's own NMSE against the f32 weights); the decode step's plan reads
    every block on the GPU."""
    prompt = rng.integers(0, model.cfg.vocab, 12).tolist()
    gen = Generator(model, "cpu")
    feed = [int(np.argmax(gen.forward(prompt)[-1]))]
    for _ in range(7):
        feed.append(int(np.argmax(gen.forward(feed[-1:])[-1])))
    cpu = steps_on(model, prompt, feed, "cpu")
    gpu_model = LlamaModel(model.cfg, model.params)  # the same block-format params, a cache of its own
    gpu = steps_on(gpu_model, prompt, feed, "cuda0")
    err, fmt_err = nmse(gpu, cpu), nmse(cpu, steps_on(f32_model, prompt, feed, "cpu"))
    print(f"gguf {what} on cuda0: logits NMSE {err:.2g} against the CPU reference on the same file "
          f"({len(cpu)} positions); the format's own NMSE against the f32 weights {fmt_err:.2g}")
    assert np.isfinite(gpu).all() and err <= LOGITS_NMSE
    assert_planned_on_the_gpu(Generator(gpu_model, "cuda0").step(1, len(prompt))[0], gpu_model)


@pytest.mark.gpu
@pytest.mark.parametrize("matrix_type", GPU_FORMATS)
def test_quantized_gguf_runs_on_cuda_like_the_cpu_reference(matrix_type: str, tmp_path: Path,
                                                            rng: np.random.Generator) -> None:
    """A Llama GGUF in each format of GPU_FORMATS (gguf's quantizer for the legacy five, `opdispatch quantize`
    for the others; the grid I-quants and q8_K left out, see there) runs on cuda0 from its blocks, as the CPU
    reference runs it.

    The GPU's quantized kernels round what the weights multiply (to int8 with
    a scale per 32 values for a decode step's mat-vec and mmq, to f16 for
    dequant_cublas), as ggml's do; the CPU reference dequantizes exactly and
    sums in float64. Logits NMSE <= LOGITS_NMSE, far below what the format
    itself costs, printed beside it (the f32 weights' logits).
    """
    model, f32_model = quantized_gguf_model(tmp_path / "q.gguf", matrix_type, int(rng.integers(2**31)))
    runs_on_cuda_like_the_cpu_reference(model, f32_model, matrix_type, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_preset_gguf_from_opdispatch_quantize_decodes_on_cuda_like_the_cpu_reference(
        preset: str, tmp_path: Path, rng: np.random.Generator) -> None:
    """`opdispatch quantize ... Q4_K_M` (q4_K matrices, q6_K for the LM head and the use_more_bits layers'
    attn_v and ffn_down), and the other file types of GPU_PRESETS: every mul_mat and get_rows of the decode step
    reads its blocks on cuda0 in their own types, no step falls back to the CPU, and the logits are within
    LOGITS_NMSE of the CPU reference on the file."""
    model, f32_model = quantized_gguf_model(tmp_path / "q.gguf", preset, int(rng.integers(2**31)))
    runs_on_cuda_like_the_cpu_reference(model, f32_model, preset, rng)


def test_tiny_llama_in_the_q4_k_m_mixture_runs_like_its_values(tmp_path: Path, rng: np.random.Generator) -> None:
    """A file as llama-quantize's Q4_K_M lays one out (q4_K, q6_K for output and the use_more_bits layers' attn_v
    and ffn_down, f32 norms), random blocks: each matrix loads in its own type and the model runs like the
    same values as f32 (decoded by gguf, HF rows)."""
    cfg = tiny_cfg(hidden=256, ffn=512)
    facts = ModelFacts(cfg.layers, cfg.heads, cfg.kv_heads)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.layers)
    tensors, held = {}, {}
    for hf, shape in weight_shapes(cfg).items():
        name = names.get_name(hf, try_suffixes=(".weight",))
        dt = tensor_type("Q4_K_M", name, shape, facts)
        if dt == "f32":
            data = rng.uniform(0.8, 1.2, shape).astype(np.float32)
            tensors[name], held[hf] = ("F32", data), data
            continue
        raw = block_rows(rng, dt, *shape)
        tensors[name] = (dt.upper(), raw)
        x = np.asarray(gguf.quants.dequantize(raw, GT[dt.upper()]), np.float32)
        held[hf] = unpermute_qk(x, cfg.heads if ".q_proj." in hf else cfg.kv_heads) if (
            ".q_proj." in hf or ".k_proj." in hf) else x
    path = tmp_path / "q4_k_m.gguf"
    write_raw_gguf(path, tensors, {"block_count": cfg.layers, "context_length": cfg.max_ctx,
                                   "embedding_length": cfg.hidden, "feed_forward_length": cfg.ffn,
                                   "head_count": cfg.heads, "head_count_kv": cfg.kv_heads,
                                   "rope_freq_base": cfg.rope_base, "layer_norm_rms_eps": cfg.rms_eps})
    loaded_cfg, params = load_gguf(path)
    assert loaded_cfg.dtype == "q4_K"  # the commonest type of the layer matrices
    types = {n: t.dtype.name for n, t in params.items()}
    assert types["lm_head.weight"] == "q6_K" and types["model.embed_tokens.weight"] == "q4_K"
    assert [types[f"model.layers.{i}.self_attn.v_proj.weight"] for i in range(2)] == ["q4_K", "q6_K"]
    assert [types[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(2)] == ["q4_K", "q6_K"]
    model = LlamaModel(attrs.evolve(loaded_cfg, cache_dtype="f32"), params)
    assert model.layers[0].wqkv is not None and model.layers[1].wqkv is None  # q4_K q/k with a q6_K v: apart
    assert model.layers[1].wqk is not None  # q and k still stacked
    prompt = rng.integers(0, cfg.vocab, 9).tolist()
    ref = logits(LlamaModel(cfg, held), prompt)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    assert_same_logits(logits(model, prompt), ref)


def test_gguf_neox_mode_unpermutes_to_hf_rows(tmp_path: Path, rng: np.random.Generator) -> None:
    cfg = tiny_cfg(layers=1)
    weights = random_weights(cfg, seed=int(rng.integers(2**31)))
    path = tmp_path / "tiny.gguf"
    held = write_llama_gguf(path, cfg, weights, "q8_0")
    _, params = load_gguf(path, rope_mode="neox")
    for proj in ("q_proj", "k_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        t = params[name]
        rows = t.data.reshape(t.shape[0], -1)
        np.testing.assert_array_equal(rows, gguf.quants.quantize(weights[name], GT.Q8_0))  # HF rows, same blocks
        np.testing.assert_array_equal(dtypes.dequantize("q8_0", rows), held[name])
    x = values(rng, (3 * 8, 5))
    np.testing.assert_array_equal(unpermute_qk(hf_to_gguf_permute(x, 3), 3), x)


def test_gguf_tied_embeddings(tmp_path: Path, rng: np.random.Generator) -> None:
    cfg = tiny_cfg(layers=1)
    path = tmp_path / "tied.gguf"
    held = write_llama_gguf(path, cfg, random_weights(cfg, seed=int(rng.integers(2**31))), "q4_0", tied=True)
    loaded_cfg, params = load_gguf(path)
    assert "lm_head.weight" not in params and params["model.embed_tokens.weight"].dtype.name == "q4_0"
    assert "lm_head.weight" not in held  # the reference ties too
    prompt = rng.integers(0, cfg.vocab, 5).tolist()
    assert_same_logits(logits(LlamaModel(attrs.evolve(loaded_cfg, cache_dtype="f32"), params), prompt),
                       logits(LlamaModel(cfg, held), prompt))


def test_gguf_rope_scaling(tmp_path: Path, rng: np.random.Generator) -> None:
    """Linear scaling from rope.scaling.factor and Llama 3's rope_freqs tensor, as llama.cpp reads them."""
    cfg = tiny_cfg(layers=1)
    factors = rng.uniform(1, 8, cfg.head_dim // 2).astype(np.float32)
    weights = random_weights(cfg, seed=int(rng.integers(2**31))) | {"rope_freqs.weight": factors}
    path = tmp_path / "scaled.gguf"
    held = write_llama_gguf(path, cfg, weights, "f16",
                            meta={"rope_scaling_type": gguf.RopeScalingType.LINEAR, "rope_scaling_factor": 4.0})
    loaded_cfg, params = load_gguf(path)
    assert loaded_cfg.rope_freq_scale == 0.25
    np.testing.assert_array_equal(params["rope_freqs.weight"].host_view(params["rope_freqs.weight"].data), factors)
    prompt = rng.integers(0, cfg.vocab, 12).tolist()
    ref_cfg = attrs.evolve(cfg, rope_freq_scale=0.25, rope_freq_factors=tuple(factors.tolist()))
    del held["rope_freqs.weight"]
    ref = logits(LlamaModel(ref_cfg, held), prompt)
    assert_same_logits(logits(LlamaModel(attrs.evolve(loaded_cfg, cache_dtype="f32"), params), prompt), ref)
    plain = logits(LlamaModel(cfg, held), prompt)
    assert np.abs(plain - ref).max() > 1e-3 * np.abs(ref).max()  # the scaling shows in the logits

    write_gguf(path, {"token_embd.weight": values(rng, (16, 64))},
               {"block_count": 1, "embedding_length": 64, "head_count": 4, "feed_forward_length": 96,
                "rope_scaling_type": gguf.RopeScalingType.YARN, "rope_scaling_factor": 4.0})
    with pytest.raises(ValueError, match=r"scaled\.gguf: rope scaling 'yarn' is not supported \(linear only\)"):
        load_gguf(path)


def test_gguf_names_agree_with_gguf_tensor_name_map() -> None:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3)
    hf_names = list(GGUF_TO_HF.values()) + [f"model.layers.2.{v}.weight" for v in GGUF_LAYER_TO_HF.values()]
    for hf in hf_names:
        gg = names.get_name(hf, try_suffixes=(".weight",))
        assert gg is not None, hf
        assert gguf_name_to_hf(gg) == hf
    assert gguf_name_to_hf("blk.0.ffn_gate_exps.weight") == "model.layers.0.mlp.experts.gate_proj.weight"
    assert gguf_name_to_hf("rope_freqs.weight") == "rope_freqs.weight"  # LlamaModel takes GGUF's name
    assert gguf_name_to_hf("blk.0.attn_q.bias") is None


def test_gguf_moe_metadata_and_stacked_experts(tmp_path: Path, rng: np.random.Generator) -> None:
    cfg = tiny_cfg(layers=1)
    w = random_weights(cfg, seed=int(rng.integers(2**31)))
    n_exp, used = 4, 2
    tensors = {"token_embd.weight": w["model.embed_tokens.weight"], "output_norm.weight": w["model.norm.weight"],
               "output.weight": w["lm_head.weight"], "blk.0.ffn_gate_inp.weight": values(rng, (n_exp, cfg.hidden)),
               "blk.0.ffn_gate_exps.weight": values(rng, (n_exp, cfg.ffn, cfg.hidden)),
               "blk.0.ffn_up_exps.weight": values(rng, (n_exp, cfg.ffn, cfg.hidden)),
               "blk.0.ffn_down_exps.weight": values(rng, (n_exp, cfg.hidden, cfg.ffn))}
    path = tmp_path / "moe.gguf"
    meta = {"block_count": 1, "context_length": 64, "embedding_length": cfg.hidden, "feed_forward_length": cfg.ffn,
            "head_count": cfg.heads, "head_count_kv": cfg.kv_heads, "expert_count": n_exp, "expert_used_count": used}
    write_gguf(path, tensors, meta, types={n: "q8_0" for n in tensors if "_exps" in n})
    loaded, params = load_gguf(path)
    assert (loaded.experts, loaded.experts_used) == (n_exp, used)
    assert params["model.layers.0.mlp.gate.weight"].shape == (n_exp, cfg.hidden)
    for proj, shape in (("gate_proj", (n_exp, cfg.ffn, cfg.hidden)), ("up_proj", (n_exp, cfg.ffn, cfg.hidden)),
                        ("down_proj", (n_exp, cfg.hidden, cfg.ffn))):
        t = params[f"model.layers.0.mlp.experts.{proj}.weight"]
        assert t.shape == shape and t.dtype.name == "q8_0"


def test_gguf_config_errors(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "m.gguf"
    embed = {"token_embd.weight": values(rng, (16, 64))}
    write_gguf(path, embed, {"block_count": 1, "embedding_length": 64, "head_count": 4})
    with pytest.raises(ValueError, match=r"m\.gguf: metadata key 'llama\.feed_forward_length' is missing"):
        load_gguf(path)
    write_gguf(path, embed, {"block_count": 1, "embedding_length": 64, "head_count": 4, "feed_forward_length": 96,
                             "rope_dimension_count": 8})
    with pytest.raises(ValueError, match=r"'llama\.rope\.dimension_count' = 8 but embedding_length / head_count = 16"):
        load_gguf(path)
    write_gguf(path, {}, {"block_count": 1})
    with pytest.raises(ValueError, match=r"m\.gguf: tensor 'token_embd\.weight' is missing"):
        load_gguf(path)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tensor("token_embd.weight", values(rng, (16, 64)))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"general\.architecture is 'qwen2'; load_gguf reads 'llama' models"):
        load_gguf(path)
    write_gguf(path, {**embed, "blk.0.attn_q.bias": values(rng, (64,))},
               {"block_count": 1, "embedding_length": 64, "head_count": 4, "feed_forward_length": 96})
    with pytest.warns(UserWarning, match=r"kept under their GGUF names .*: blk\.0\.attn_q\.bias"):
        _, params = load_gguf(path)
    assert params["blk.0.attn_q.bias"].shape == (64,)


# ---------------------------------------------------------------------------
# safetensors


def st_bytes(entries: dict[str, tuple[str, list[int], bytes]], *, header: Any = None, pad: int = 0) -> bytes:
    """A safetensors file by hand: {name: (dtype, shape, data)} packed in order; `header` replaces the JSON."""
    meta, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dt, shape, data) in entries.items():
        meta[name] = {"dtype": dt, "shape": shape, "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    text = (json.dumps(meta) if header is None else header if isinstance(header, str) else json.dumps(header))
    head = text.encode() + b" " * pad
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def test_safetensors_written_by_the_package(tmp_path: Path, rng: np.random.Generator) -> None:
    from safetensors.numpy import save_file

    arrays = {"model.embed_tokens.weight": values(rng, (10, 64)),
              "model.layers.0.self_attn.q_proj.weight": values(rng, (64, 64)).astype(np.float16),
              "model.norm.weight": values(rng, (64,)), "scalar": np.array(rng.standard_normal(), np.float32)}
    path = tmp_path / "model.safetensors"
    save_file(arrays, str(path), metadata={"format": "pt"})
    params = load_safetensors(path)
    assert set(params) == set(arrays)
    for name, x in arrays.items():
        t = params[name]
        assert t.name == name and t.shape == x.shape and t.dtype.numpy == x.dtype
        np.testing.assert_array_equal(t.host_view(t.data), x)
        assert not t.data.flags.writeable  # a view of the read-only memmap


def test_safetensors_checkpoint_runs_in_llama_model(tmp_path: Path, rng: np.random.Generator) -> None:
    """An f16 HF checkpoint in two shards -> LlamaModel, equal to the model that converts the floats itself."""
    from safetensors.numpy import save_file

    cfg = tiny_cfg(dtype="f16")
    weights = random_weights(cfg, seed=int(rng.integers(2**31)))
    names = sorted(weights)
    for k, part in enumerate((names[::2], names[1::2])):
        save_file({n: weights[n] if weights[n].ndim == 1 else weights[n].astype(np.float16) for n in part},
                  str(tmp_path / f"model-{k}.safetensors"))
    params = load_safetensors(tmp_path)
    assert {t.dtype.name for n, t in params.items() if t.ndim == 2} == {"f16"}
    prompt = rng.integers(0, cfg.vocab, 7).tolist()
    assert_same_logits(logits(LlamaModel(cfg, params), prompt), logits(LlamaModel(cfg, weights), prompt))


def test_safetensors_bf16_by_hand(tmp_path: Path, rng: np.random.Generator) -> None:
    x = values(rng, (6, 32)).astype(ml_dtypes.bfloat16)
    y = values(rng, (3, 4, 8))
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(st_bytes({"w": ("BF16", [6, 32], x.tobytes()), "y": ("F32", [3, 4, 8], y.tobytes())}, pad=5))
    params = load_safetensors(path)
    assert params["w"].dtype.name == "bf16"
    np.testing.assert_array_equal(params["w"].host_view(params["w"].data), x)
    np.testing.assert_array_equal(params["y"].host_view(params["y"].data), y)


def test_safetensors_sharded_directory(tmp_path: Path, rng: np.random.Generator) -> None:
    from safetensors.numpy import save_file

    shards = {"model-00001-of-00002.safetensors": {"a": values(rng, (4, 32)), "b": values(rng, (8,))},
              "model-00002-of-00002.safetensors": {"c": values(rng, (2, 3, 32)).astype(np.float16)}}
    for fname, arrays in shards.items():
        save_file(arrays, str(tmp_path / fname))
    params = load_safetensors(tmp_path)  # no index: every shard
    assert set(params) == {"a", "b", "c"}
    c = shards["model-00002-of-00002.safetensors"]["c"]
    np.testing.assert_array_equal(params["c"].host_view(params["c"].data), c)

    index = tmp_path / "model.safetensors.index.json"
    weight_map = {n: f for f, arrays in shards.items() for n in arrays}
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert set(load_safetensors(tmp_path)) == {"a", "b", "c"}
    index.write_text(json.dumps({"weight_map": {**weight_map, "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match=r"tensor 'b' is listed in model-00002-of-00002\.safetensors but found in "
                                         r"model-00001"):
        load_safetensors(tmp_path)
    index.write_text(json.dumps({"weight_map": {**weight_map, "d": "model-00003-of-00003.safetensors"}}))
    with pytest.raises(ValueError, match=r"shard model-00003-of-00003\.safetensors is missing"):
        load_safetensors(tmp_path)
    index.unlink()
    save_file({"a": values(rng, (4, 32))}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'a' is in two shards, extra\.safetensors and model-00001"):
        load_safetensors(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty: no \*\.safetensors files"):
        load_safetensors(empty)


def test_safetensors_malformed_files_are_clear_errors(tmp_path: Path, rng: np.random.Generator) -> None:
    a, b = values(rng, (4, 32)), values(rng, (8,)).astype(np.float16)
    good = st_bytes({"a": ("F32", [4, 32], a.tobytes()), "b": ("F16", [8], b.tobytes())})
    path = tmp_path / "bad.safetensors"

    def expect(data: bytes, pattern: str) -> None:
        path.write_bytes(data)
        with pytest.raises(ValueError, match=pattern):
            load_safetensors(path)

    header_len = struct.unpack("<Q", good[:8])[0]
    expect(good[:-1], r"bad\.safetensors: tensor 'b': data_offsets \[512, 528\] fall outside the data area of 527 "
                      r"bytes .*truncated")
    expect(good[:8 + header_len + 100], r"tensor 'a': data_offsets \[0, 512\] fall outside the data area of 100")
    expect(good[:8 + header_len - 1], r"bad\.safetensors: header length \d+ runs past the end of the file")
    expect(good[:5], r"bad\.safetensors: 5 bytes, too short for a safetensors header length")
    expect(struct.pack("<Q", 1 << 63) + good[8:], r"header length 9223372036854775808 runs past the end")
    expect(st_bytes({"a": ("F32", [4, 32], a.tobytes())}, header='{"a": {"dtype": "F32", "shape": [4, 32'),
           r"bad\.safetensors: the header is not valid JSON")
    expect(struct.pack("<Q", 2) + b"\xff\xfe", r"the header is not valid JSON")  # not UTF-8
    expect(st_bytes({}, header=[1, 2]), r"the header is a JSON list, not an object")
    expect(st_bytes({"a": ("F32", [4, 32], a.tobytes())},
                    header={"a": {"dtype": "F32", "shape": [4, 32], "data_offsets": [0, 1 << 40]}}),
           r"tensor 'a': data_offsets \[0, 1099511627776\] fall outside the data area of 512 bytes")
    expect(st_bytes({"a": ("F32", [4, 32], a.tobytes())},
                    header={"a": {"dtype": "F32", "shape": [4, 32], "data_offsets": [-4, 508]}}),
           r"tensor 'a': data_offsets \[-4, 508\] fall outside")
    expect(st_bytes({"a": ("F32", [4, 32], a.tobytes())},
                    header={"a": {"dtype": "F32", "shape": [4, 31], "data_offsets": [0, 512]}}),
           r"tensor 'a': F32 \(4, 31\) takes 496 bytes but data_offsets \[0, 512\] hold 512")
    expect(st_bytes({"a": ("I64", [64], a.tobytes())}), r"tensor 'a' has dtype 'I64'; opdispatch loads F32, F16, BF16")
    expect(st_bytes({"a": ("F8_E4M3", [512], a.tobytes())}), r"tensor 'a' has dtype 'F8_E4M3'")
    expect(st_bytes({"a": ("F32", [4, -32], a.tobytes())}), r"tensor 'a': shape \[4, -32\] is not a list of "
                                                            r"non-negative integers")
    expect(st_bytes({"a": ("F32", [4, 32], a.tobytes())}, header={"a": {"dtype": "F32", "shape": [4, 32]}}),
           r"tensor 'a': needs dtype, shape and data_offsets")
    expect(st_bytes({"a": ("F32", [4, 32], a.tobytes())},
                    header={"a": {"dtype": "F32", "shape": [2, 32], "data_offsets": [0, 256]},
                            "b": {"dtype": "F32", "shape": [2, 32], "data_offsets": [128, 384]}}),
           r"tensors 'a' and 'b' overlap")


# ---------------------------------------------------------------------------
# state dicts


def test_state_dict_of_numpy_arrays(rng: np.random.Generator) -> None:
    sd = {"f32": values(rng, (4, 32)), "f16": values(rng, (4, 32)).astype(np.float16),
          "bf16": values(rng, (4, 32)).astype(ml_dtypes.bfloat16), "f64": values(rng, (4, 32)).astype(np.float64),
          "strided": values(rng, (8, 64))[::2, ::2]}
    params = load_state_dict(sd)
    for name, x in sd.items():
        t = params[name]
        assert t.name == name and t.shape == x.shape
        want = x.astype(np.float32) if x.dtype == np.float64 else x
        assert t.dtype.numpy == want.dtype
        np.testing.assert_array_equal(t.host_view(t.data), want)
    assert not np.shares_memory(params["f32"].data, sd["f32"])
    shared = load_state_dict({"f32": sd["f32"]}, copy=False)["f32"]
    assert np.shares_memory(shared.data, sd["f32"])
    with pytest.raises(ValueError, match=r"state dict tensor 'mask' has dtype bool"):
        load_state_dict({"mask": np.ones(4, bool)})


def test_state_dict_of_torch_tensors(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    x = values(rng, (6, 32))
    sd = {"f32": torch.from_numpy(x), "bf16": torch.from_numpy(x).to(torch.bfloat16),
          "f16": torch.from_numpy(x).half().t(), "param": torch.nn.Parameter(torch.from_numpy(x))}
    params = load_state_dict(sd)
    bf = params["bf16"]
    assert bf.dtype.name == "bf16"
    np.testing.assert_array_equal(bf.host_view(bf.data).view(np.int16), sd["bf16"].view(torch.int16).numpy())
    np.testing.assert_array_equal(params["f16"].host_view(params["f16"].data), x.astype(np.float16).T)
    np.testing.assert_array_equal(params["param"].host_view(params["param"].data), x)

    # A bf16 torch state dict runs like the model that rounds the same floats to bf16 itself.
    cfg = tiny_cfg(dtype="bf16", layers=1)
    weights = random_weights(cfg, seed=int(rng.integers(2**31)))
    sd = {n: torch.from_numpy(w) if w.ndim == 1 else torch.from_numpy(w).to(torch.bfloat16) for n, w in weights.items()}
    prompt = rng.integers(0, cfg.vocab, 7).tolist()
    assert_same_logits(logits(LlamaModel(cfg, load_state_dict(sd)), prompt), logits(LlamaModel(cfg, weights), prompt))


# ---------------------------------------------------------------------------
# transformers 5's formats: fused MoE experts in the state dict, RoPE in rope_parameters


def test_transformers_5_fused_experts_run_like_per_expert_weights(rng: np.random.Generator) -> None:
    """MixtralForCausalLM's state dict in transformers 5: experts.gate_up_proj (E, 2 ffn, hidden), gate rows first,
    and experts.down_proj (E, hidden, ffn), no ".weight"; the router is mlp.gate.weight."""
    cfg = tiny_cfg(ffn=64, experts=4, experts_used=2)
    per_expert = random_weights(cfg, seed=int(rng.integers(2**31)))  # transformers 4's names
    fused = {n: w for n, w in per_expert.items() if ".block_sparse_moe." not in n}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        ex = [f"{p}block_sparse_moe.experts.{e}." for e in range(cfg.experts)]
        fused[p + "mlp.gate.weight"] = per_expert[p + "block_sparse_moe.gate.weight"]
        fused[p + "mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([per_expert[e + "w1.weight"], per_expert[e + "w3.weight"]]) for e in ex])
        fused[p + "mlp.experts.down_proj"] = np.stack([per_expert[e + "w2.weight"] for e in ex])
    arrays = state_dict_arrays(fused)
    assert arrays["model.layers.1.mlp.experts.up_proj.weight"].shape == (4, 64, 64)
    np.testing.assert_array_equal(arrays["model.layers.1.mlp.experts.up_proj.weight"][2],
                                  per_expert["model.layers.1.block_sparse_moe.experts.2.w3.weight"])
    prompt = rng.integers(0, cfg.vocab, 7).tolist()
    ref = logits(LlamaModel(cfg, per_expert), prompt)
    np.testing.assert_array_equal(logits(LlamaModel(cfg, arrays), prompt), ref)
    np.testing.assert_array_equal(logits(LlamaModel(cfg, load_state_dict(fused)), prompt), ref)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' has shape \(4, 127, 64\)"):
        state_dict_arrays({"model.layers.0.mlp.experts.gate_up_proj": np.zeros((4, 127, 64), np.float32)})


def test_transformers_5_rope_parameters() -> None:
    """transformers 5 writes rope_theta and the scaling into one dict, rope_parameters (no rope_theta key)."""
    base = {"model_type": "llama", "vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256}
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    v4 = LlamaConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": scaling})
    v5 = LlamaConfig.from_hf({**base, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert v5 == v4 and v5.rope_base == 5e5 and v5.rope_freq_factors is not None
    plain = LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert (plain.rope_base, plain.rope_freq_factors, plain.rope_freq_scale) == (1e6, None, 1.0)
    mixtral = LlamaConfig.from_hf({**base, "model_type": "mixtral", "num_local_experts": 4,
                                   "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 2e4}})
    assert (mixtral.rope_base, mixtral.rope_freq_scale, mixtral.experts) == (2e4, 0.5, 4)
    with pytest.raises(ValueError, match="rope_parameters per layer type"):
        LlamaConfig.from_hf({**base, "rope_parameters": {"full_attention": {"rope_type": "default",
                                                                             "rope_theta": 1e4}}})
    with pytest.raises(ValueError, match="rope_scaling 'yarn'"):
        LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
