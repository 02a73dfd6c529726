"""`opdispatch quantize` and the type mixture it follows (opdispatch.models.quantize, .mixture).

The mixture is checked against llama-quantize itself: tests/fixtures/llama_quantize_types.json
holds the type llama-quantize gave every tensor of three small Llamas (one of 8 experts) for each preset (made by
scripts/llama_quantize_types.py with llama.cpp's peer build; this test does not need it). The
command runs end to end for every target whose types opdispatch has encoders for: the K-quant
presets join as their encoders land in opdispatch.quants.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import attrs
import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from opdispatch import dtypes
from opdispatch.cli import main
from opdispatch.models.llama.model import LlamaModel
from opdispatch.models.llama.names import random_weights
from opdispatch.models.mixture import PRESETS, ModelFacts, targets, tensor_type
from opdispatch.models import quantize as quantize_module
from opdispatch.models.quantize import file_type, plan_types, read_source
from opdispatch.models.weights.gguf import gguf_dtype, load_gguf, read_gguf
from opdispatch.quants import FORMATS, iquants
from test_weights import logits, stacked_experts, tiny_cfg, write_llama_gguf

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "llama_quantize_types.json").read_text())
CFG = tiny_cfg(hidden=256, ffn=512, vocab=160)  # rows of 256 and 512 values: whole K-quant blocks


@pytest.mark.parametrize("model, target", [(m, t) for m, d in FIXTURE["models"].items() for t in d["types"]])
def test_mixture_picks_the_types_llama_quantize_picks(model: str, target: str) -> None:
    d = FIXTURE["models"][model]
    facts = ModelFacts(**d["facts"])
    got = [tensor_type(target, name, tuple(shape), facts) for name, shape in d["tensors"]]
    want = [gguf_dtype(t) for t in d["types"][target]]
    bad = [(name, w, g) for (name, _), w, g in zip(d["tensors"], want, got) if w != g]
    assert not bad, f"{len(bad)} of {len(got)} differ (tensor, llama-quantize, ours), first: {bad[:3]}"


def test_fixture_covers_every_preset_and_the_mixture_varies() -> None:
    for d in FIXTURE["models"].values():
        assert set(PRESETS) <= set(d["types"])
    mixed = FIXTURE["models"]["gqa4"]["types"]["Q4_K_M"]
    assert {t: mixed.count(t) for t in set(mixed)} == {"Q4_K": 97, "Q6_K": 17, "F32": 33}


def source_values(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as f32 values, GGUF names."""
    return {n: dtypes.to_host_float(t.dtype, t.host_view(t.data)) for n, t in read_gguf(path)[1].items()}


def runnable(target: str) -> bool:
    """Whether opdispatch has an encoder for every type `target` gives CFG's tensors."""
    facts = ModelFacts(CFG.layers, CFG.heads, CFG.kv_heads)
    shapes = {"token_embd.weight": (CFG.vocab, CFG.hidden), "output.weight": (CFG.vocab, CFG.hidden),
              "blk.1.ffn_down.weight": (CFG.hidden, CFG.ffn), "blk.1.attn_v.weight": (CFG.kv_dim, CFG.hidden),
              "blk.0.attn_q.weight": (CFG.hidden, CFG.hidden), "blk.0.ffn_up.weight": (CFG.ffn, CFG.hidden)}
    types = {tensor_type(target, n, s, facts) for n, s in shapes.items()}
    return all(not dtypes.dtype(t).is_quant or FORMATS[t].encode is not None for t in types)


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("src") / "tiny-f32.gguf"
    write_llama_gguf(path, CFG, random_weights(CFG, seed=int(np.random.default_rng().integers(2**31))), "f32")
    return path


@pytest.mark.parametrize("target", [t for t in targets() if runnable(t)])
def test_quantized_model_runs_like_itself_dequantized(target: str, f32_gguf: Path, tmp_path: Path, capsys,
                                                      rng: np.random.Generator) -> None:
    """`opdispatch quantize` in every type it can write: the bytes are llama-quantize's of the source values, the
    types the mixture's, the metadata copied; the file runs within 1e-2 of its own values as f32 (CPU reference)."""
    out = tmp_path / "out.gguf"
    assert main(["quantize", str(f32_gguf), str(out), target]) == 0
    printed, err = capsys.readouterr()
    n = len(read_gguf(f32_gguf)[1])
    assert f"\r[{'#' * 30}] {n}/{n} done" in err and re.search(r"\] 3/\d+ blk\.0\.", err)
    head = rf"^wrote {re.escape(str(out))}: {target} \(general\.file_type {file_type(target)}\), "
    assert re.search(head, printed, re.M)

    meta_in, _ = read_gguf(f32_gguf)
    meta, tensors = read_gguf(out)
    assert meta["general.file_type"] == file_type(target) and meta["general.quantization_version"] == 2
    assert {k: v for k, v in meta.items() if not k.startswith("general.")} == {
        k: v for k, v in meta_in.items() if not k.startswith("general.")}
    plan = plan_types(read_source(f32_gguf), target)
    src = source_values(f32_gguf)
    for name, t in tensors.items():
        assert t.dtype.name == plan[name] == tensor_type(target, name, t.shape, ModelFacts(CFG.layers, CFG.heads,
                                                                                          CFG.kv_heads))
        assert t.dtype.name == "f32" or t.ndim == 2  # 1-d tensors (norms) stay f32
        np.testing.assert_array_equal(t.data, file_bytes(t.dtype.name, src[name]))

    assert_runs_like_f32(out, rng)


def file_bytes(dt: str, values: np.ndarray) -> np.ndarray:
    """The bytes llama-quantize writes for values in dt: dtypes.quantize's, but iq4_nl's (quantize_iq4_nl, 7 scale
    tries a block: tests/test_iquants.py checks it against llama-quantize's own bytes)."""
    if dt == "iq4_nl":
        return iquants.encode_iq4_nl_file(values.reshape(*values.shape[:-1], -1, 32)).reshape(-1)
    return dtypes.from_float(dt, values).view(np.uint8).reshape(-1)


def assert_runs_like_f32(path: Path, rng: np.random.Generator) -> None:
    """The GGUF model at path gives logits within 1e-2 (of max |logit|) of its own values as f32 (CPU reference)."""
    cfg, params = load_gguf(path)
    cfg = attrs.evolve(cfg, cache_dtype="f32")
    f32 = {n: dtypes.to_host_float(t.dtype, t.host_view(t.data)) for n, t in params.items()}
    prompt = rng.integers(0, cfg.vocab, 9).tolist()
    got = logits(LlamaModel(cfg, params), prompt)
    ref = logits(LlamaModel(attrs.evolve(cfg, dtype="f32"), f32), prompt)
    err = np.abs(got - ref).max()
    assert np.isfinite(got).all() and err <= 1e-2 * np.abs(ref).max(), f"{err:.3g} of {np.abs(ref).max():.3g}"


def test_mxfp4_moe_file_holds_the_experts_in_mxfp4(tmp_path: Path, capsys, rng: np.random.Generator) -> None:
    """MXFP4_MOE (gpt-oss's file type) of a MoE model: the stacked experts mxfp4, every other matrix q8_0 (the
    output too), the router and norms f32, as llama-quantize writes it; the file runs like its values as f32."""
    cfg = tiny_cfg(ffn=64, experts=4, experts_used=2)
    src, out = tmp_path / "moe-f32.gguf", tmp_path / "moe-mxfp4.gguf"
    write_llama_gguf(src, cfg, stacked_experts(cfg, random_weights(cfg, seed=int(rng.integers(2**31)))), "f32")
    assert main(["quantize", str(src), str(out), "MXFP4_MOE"]) == 0
    capsys.readouterr()
    types = {name: t.dtype.name for name, t in read_gguf(out)[1].items()}
    experts = {n for n in types if "_exps." in n}
    assert len(experts) == 3 * cfg.layers and {types[n] for n in experts} == {"mxfp4"}
    matrices = {n for n in types if n not in experts and n.endswith(".weight") and "norm" not in n}
    assert {n: types[n] for n in matrices if types[n] != "q8_0"} == {
        f"blk.{i}.ffn_gate_inp.weight": "f32" for i in range(cfg.layers)}
    assert types["output.weight"] == "q8_0"
    assert_runs_like_f32(out, rng)


@pytest.mark.parametrize("target", ["q4_0", "Q4_K_M", "IQ4_XS"])
def test_quantized_file_runs_in_opdispatch_run_with_its_type_counts(target: str, f32_gguf: Path, tmp_path: Path,
                                                                    capsys) -> None:
    """`opdispatch run --gguf` on a file of each kind: its summary line counts the tensors of each type the file
    holds (q4_0: embedding, output and 7 matrices a layer q4_0, llama-quantize --pure; the mixtures as planned)."""
    out = tmp_path / "q.gguf"
    assert main(["quantize", str(f32_gguf), str(out), target]) == 0
    capsys.readouterr()
    code = main(["run", "--device", "cpu", "--gguf", str(out), "--tokens", "2", "--prompt-len", "3"])
    printed, err = capsys.readouterr()
    assert code == 0, err
    counts = Counter(plan_types(read_source(f32_gguf), target).values())
    assert len(counts) >= 2 and counts["f32"] == 5  # 2 norms a layer and the last
    if target == "q4_0":
        assert counts == {"q4_0": 16, "f32": 5}
    line = re.search(r"^weights: (.*), [\d.]+ KiB, loaded in", printed, re.M)
    assert line and dict(re.findall(r"(\w+) x (\d+)", line.group(1))) == {k: str(v) for k, v in counts.items()}, (
        printed, counts)


def test_safetensors_source_gives_the_converters_file(tmp_path: Path, rng: np.random.Generator) -> None:
    """An HF checkpoint (bf16 matrices) -> q8_0: the tensors llama.cpp's converter layout gives the same values
    (gguf's own quantizer, Q/K rows permuted, gguf's names), byte for byte; the config in the metadata."""
    weights = random_weights(CFG, seed=int(rng.integers(2**31)))
    hf = tmp_path / "hf"
    hf.mkdir()
    bf16 = {n: w if w.ndim == 1 else w.astype(dtypes.BF16.numpy) for n, w in weights.items()}
    save_file(bf16, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": CFG.vocab, "hidden_size": CFG.hidden, "num_hidden_layers": CFG.layers,
        "num_attention_heads": CFG.heads, "num_key_value_heads": CFG.kv_heads, "intermediate_size": CFG.ffn,
        "rms_norm_eps": CFG.rms_eps, "rope_theta": CFG.rope_base, "max_position_embeddings": CFG.max_ctx}))
    out = tmp_path / "q8.gguf"
    assert quantize_module.quantize_model(hf, out, "q8_0") is not None
    ref = tmp_path / "ref.gguf"
    write_llama_gguf(ref, CFG, {n: w.astype(np.float32) for n, w in bf16.items()}, "q8_0")
    got, want = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}, {t.name: t for t in gguf.GGUFReader(
        str(ref)).tensors}
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].tensor_type == t.tensor_type, name
        np.testing.assert_array_equal(got[name].data, t.data, err_msg=name)
    cfg, _ = load_gguf(out)
    for f in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "rope_base", "rms_eps", "max_ctx"):
        assert getattr(cfg, f) == getattr(CFG, f), f


def test_quantize_errors(f32_gguf: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "x.gguf"
    assert main(["quantize", str(f32_gguf), str(out), "q9_0"]) == 2
    assert "opdispatch quantize: error: quantize: unknown type 'q9_0': one of F32, F16" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "none.gguf"), str(out), "q8_0"]) == 2
    assert "No such file or directory" in capsys.readouterr().err
    assert main(["quantize", str(f32_gguf), str(f32_gguf), "q8_0"]) == 2
    assert "is the input" in capsys.readouterr().err
    # a type without an encoder is refused before anything is written
    no_q8 = {**FORMATS, "q8_0": attrs.evolve(FORMATS["q8_0"], encode=None)}
    monkeypatch.setattr(quantize_module, "FORMATS", no_q8)
    assert main(["quantize", str(f32_gguf), str(out), "Q8_0"]) == 2
    err = capsys.readouterr().err
    assert f"quantize Q8_0: opdispatch cannot quantize to q8_0 yet (q8_0: {2 * 7 + 2} tensors)" in err
    assert not out.exists() and not Path(f"{out}.part").exists()
