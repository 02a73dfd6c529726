"""The `opdispatch` command: info, ops, run, and its errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from opdispatch import manager
from opdispatch.cli import main
from opdispatch.models.llama import PRESETS, LlamaModel, Sampler, generate, random_weights


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info_lists_devices_and_plugins_in_order(capsys) -> None:
    code, out, _ = run_cli(capsys, "info")
    assert code == 0
    assert re.search(r"^  cpu +cpu ", out, re.M)
    listed = re.findall(r"^  \d+\. (\S+)", out, re.M)
    assert listed == [p.name for p in manager().order()]
    assert listed[-1] == "cpu"  # the reference is asked last
    assert "priority 0" in out and "entry point opdispatch.reference.plugin" in out
    if not any(d.kind == "cuda" for d in manager().devices()):
        assert "(no CUDA device: " in out


def test_ops_matrix_and_markdown(capsys, tmp_path: Path) -> None:
    path = tmp_path / "docs" / "ops.md"
    code, out, _ = run_cli(capsys, "ops", "--device", "cpu", "--markdown", str(path))
    assert code == 0
    assert re.search(r"^rms_norm +f32 +cpu:numpy$", out, re.M)
    assert re.search(r"^mul_mat +q8_0,f32 +cpu:numpy$", out, re.M)  # the weight dtype, then the activations
    assert not re.search(r"^(view|reshape|permute|transpose) ", out, re.M)  # views run no kernel
    text = path.read_text()
    assert "| op | dtype | cpu |" in text and "| rms_norm | f32 | cpu:numpy |" in text
    assert "- `rms_norm` (norm): RMS norm per row" in text


def test_ops_plans_for_a_gpu_description_without_one(capsys) -> None:
    code, out, _ = run_cli(capsys, "ops", "--device", "cuda0")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["op", "dtype", "cuda0"]
    # Every row names who runs it there, or says it falls back (or has no case).
    assert rows and all(re.search(r"\S+ +\S+ +\S", r) for r in rows)


def test_run_with_defaults_reports_plans_and_tokens_per_second(capsys) -> None:
    code, out, _ = run_cli(capsys, "run", "--device", "cpu")
    assert code == 0
    assert re.search(r"^prefill plan: \d+ nodes -> \d+ launches \(cpu \d+\); fusions: .+; copies: \d+; "
                     r"arena peak: cpu ", out, re.M)
    assert re.search(r"^decode plan: ", out, re.M)
    assert re.search(r"^prefill: 16 tokens in [\d.]+ ms = [\d.]+ tokens/s$", out, re.M)
    assert re.search(r"^decode: 31 tokens in [\d.]+ ms = [\d.]+ tokens/s", out, re.M)
    generated = re.search(r"generated: ([\d ]+)$", out, re.M)
    assert generated and len(generated.group(1).split()) == 32


def test_test_ops_is_the_conformance_harness(capsys) -> None:
    code, out, _ = run_cli(capsys, "test-ops", "-o", "rms_norm", "--device", "cpu")
    assert code == 0
    assert re.search(r"^rms_norm +\d+ +\d+ +0 ", out, re.M)


@pytest.mark.parametrize("argv", [("run", "--device", "tpu7"), ("ops", "--device", "tpu7"),
                                  ("test-ops", "--device", "tpu7")])
def test_unknown_device_is_a_usage_error(capsys, argv: tuple[str, ...]) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and not out
    assert re.fullmatch(r"opdispatch [\w-]+: error: unknown device 'tpu7' \(known: .*\bcpu\b.*\)\n", err)


def test_context_overflow_is_a_usage_error(capsys) -> None:
    code, _, err = run_cli(capsys, "run", "--tokens", "200")
    assert code == 2 and "fit the context of 128" in err


def test_python_dash_m_runs_the_same_command() -> None:
    done = subprocess.run([sys.executable, "-m", "opdispatch", "run", "--tokens", "3", "--prompt-len", "4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tokens/s" in done.stdout


def generated(out: str) -> list[int]:
    found = re.search(r"^prompt: \d+ tokens; generated: ([\d ]+)$", out, re.M)
    assert found, out
    return [int(t) for t in found.group(1).split()]


def test_run_moe_preset_with_sampling(capsys) -> None:
    argv = ("run", "--device", "cpu", "--preset", "tiny-moe", "--tokens", "6", "--prompt-len", "5",
            "--sample", "top-k", "--top-k", "5", "--temperature", "0.8", "--seed", "3")
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert re.search(r"^model: llama tiny-moe: .*ffn 64 x 4 experts \(2 used, renormalized\)", out, re.M)
    assert "sampling: top-k (k 5, temperature 0.8, seed 3)" in out
    assert re.search(r"^decode: 5 tokens in [\d.]+ ms = [\d.]+ tokens/s", out, re.M)
    assert re.fullmatch(r"generated 6/6 tokens in [\d.]+ s, [\d.]+ tokens/s \(wall clock.*\)\n", err)  # no TTY
    tokens = generated(out)
    # The same tokens as the library with the same seeds (weights, prompt, sampler).
    cfg = PRESETS["tiny-moe"]
    prompt = np.random.default_rng(3).integers(0, cfg.vocab, 5).tolist()
    ref = generate(LlamaModel(cfg, random_weights(cfg, 3)), prompt, 6, "cpu", sampler=Sampler("top-k", 5, seed=3,
                                                                                          temperature=0.8))
    assert tokens == list(ref.tokens)
    assert generated(run_cli(capsys, *argv)[1]) == tokens  # the seed repeats the run


def test_run_top_p_differs_from_greedy_and_1b_preset_is_accepted(capsys) -> None:
    _, greedy, _ = run_cli(capsys, "run", "--device", "cpu", "--tokens", "10")
    code, top_p, _ = run_cli(capsys, "run", "--device", "cpu", "--tokens", "10", "--sample", "top-p",
                             "--top-p", "0.95", "--temperature", "2")
    assert code == 0 and "sampling: top-p (p 0.95, temperature 2, seed 0)" in top_p
    assert generated(top_p) != generated(greedy)
    # 1b on the CPU reference takes minutes: check that the preset is taken (its context) and stops early.
    code, out, err = run_cli(capsys, "run", "--preset", "1b", "--tokens", "2100")
    assert code == 2 and not out and "fit the context of 2048" in err


@pytest.mark.parametrize("argv, message", [
    (("--gguf", "a.gguf", "--safetensors", "d"), "argument --safetensors: not allowed with argument --gguf"),
    (("--gguf", "a.gguf", "--preset", "tiny"), "argument --preset: not allowed with argument --gguf"),
    (("--sample", "top-p", "--top-p", "0"), "top_p must be in (0, 1], got 0.0"),
    (("--sample", "top-k", "--temperature", "-1"), "temperature must be > 0"),
    (("--gguf", "missing.gguf", "--dtype", "f16"), "loaded weights keep their stored types"),
    (("--gguf", "missing.gguf"), "--gguf: No such file or directory: missing.gguf"),
])
def test_run_flag_errors(capsys, argv: tuple[str, ...], message: str) -> None:
    code, out, err = run_cli(capsys, "run", "--device", "cpu", *argv)
    assert code == 2 and not out and message in err


def test_run_safetensors_without_config_json(capsys, tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "run", "--device", "cpu", "--safetensors", str(tmp_path))
    assert code == 2 and f"no config.json beside the weights ({tmp_path / 'config.json'})" in err


MIXTRAL_TINY = {"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "max_position_embeddings": 128, "hidden_act": "silu"}


def test_run_safetensors_mixtral_generates_like_the_preset(capsys, tmp_path: Path) -> None:
    pytest.importorskip("opdispatch.models.weights")
    from safetensors.numpy import save_file

    cfg = PRESETS["tiny-moe"]
    w = random_weights(cfg, 5)
    save_file(w, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_TINY))
    code, out, err = run_cli(capsys, "run", "--device", "cpu", "--safetensors", str(tmp_path), "--tokens", "5",
                             "--prompt-len", "4", "--seed", "5")
    assert code == 0, err
    assert re.search(rf"^model: llama safetensors {re.escape(str(tmp_path))}: .* x 4 experts", out, re.M)
    # embedding, norm, lm head, and per layer 2 norms, 4 attention matrices, the router and 3 stacked expert weights
    assert re.search(r"^weights: f32 x 23, [\d.]+ KiB, loaded in", out, re.M)
    prompt = np.random.default_rng(5).integers(0, cfg.vocab, 4).tolist()
    assert generated(out) == list(generate(LlamaModel(cfg, w), prompt, 5, "cpu").tokens)


def test_run_gguf_generates_like_its_hf_weights(capsys, tmp_path: Path) -> None:
    """A GGUF as llama.cpp's converter writes one (gguf's names, Q/K rows permuted): the tokens of the HF weights."""
    pytest.importorskip("opdispatch.models.weights")
    gguf = pytest.importorskip("gguf")
    cfg = PRESETS["tiny"]
    w = random_weights(cfg, 6)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.layers)
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    for key, value in (("block_count", cfg.layers), ("context_length", cfg.max_ctx), ("embedding_length", cfg.hidden),
                       ("feed_forward_length", cfg.ffn), ("head_count", cfg.heads), ("head_count_kv", cfg.kv_heads),
                       ("rope_freq_base", cfg.rope_base), ("layer_norm_rms_eps", cfg.rms_eps)):
        getattr(writer, f"add_{key}")(value)
    for hf, x in w.items():
        if ".q_proj." in hf or ".k_proj." in hf:  # convert_hf_to_gguf.py's LlamaModel.permute
            n_head = cfg.heads if ".q_proj." in hf else cfg.kv_heads
            x = x.reshape(n_head, 2, x.shape[0] // n_head // 2, x.shape[1]).swapaxes(1, 2).reshape(x.shape)
        writer.add_tensor(names.get_name(hf, try_suffixes=(".weight",)), x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code, out, err = run_cli(capsys, "run", "--device", "cpu", "--gguf", str(tmp_path / "tiny.gguf"),
                             "--tokens", "6", "--prompt-len", "4", "--seed", "6")
    assert code == 0, err
    assert re.search(r"^model: llama gguf .*rope normal base 10000, max_ctx 128;", out, re.M)
    prompt = np.random.default_rng(6).integers(0, cfg.vocab, 4).tolist()
    assert generated(out) == list(generate(LlamaModel(cfg, w), prompt, 6, "cpu").tokens)


def test_run_batch_generates_each_sequence_as_alone(capsys) -> None:
    code, out, err = run_cli(capsys, "run", "--device", "cpu", "--batch", "3", "--tokens", "4", "--prompt-len", "6")
    assert code == 0, err
    seqs = re.findall(r"^sequence (\d): prompt: 6 tokens; generated: ([\d ]+)$", out, re.M)
    assert [s for s, _ in seqs] == ["0", "1", "2"]
    assert re.search(r"^decode: 9 tokens \(3 sequences\) in [\d.]+ ms = [\d.]+ tokens/s \([\d.]+ ms/step\)", out, re.M)
    assert "generated 12/12 tokens" in err
    cfg = PRESETS["tiny"]
    prompts = np.random.default_rng(0).integers(0, cfg.vocab, (3, 6)).tolist()
    model = LlamaModel(cfg, random_weights(cfg, 0))
    assert [[int(t) for t in toks.split()] for _, toks in seqs] == [list(generate(model, p, 4, "cpu").tokens)
                                                                     for p in prompts]
    code, _, err = run_cli(capsys, "run", "--device", "cpu", "--batch", "0")
    assert code == 2 and "--batch 0 must be positive" in err
