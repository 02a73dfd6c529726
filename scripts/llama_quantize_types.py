"""Make tests/fixtures/llama_quantize_types.json: the type llama-quantize gives every tensor of small Llamas.

For each model shape below, writes a random f32 Llama GGUF (a fake SentencePiece
vocabulary, so llama.cpp's loader takes it), runs ``llama-quantize`` (llama.cpp's
peer build on PATH: ``. /work/peer/env.sh``) for every file type of
opdispatch.models.mixture.PRESETS and, with ``--pure``, for a few single types,
and records the type of each tensor of each output file. tests/test_quantize.py
checks opdispatch.models.mixture.tensor_type against it without llama-quantize.

Usage: python scripts/llama_quantize_types.py [OUT.json]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

from opdispatch.models.mixture import PRESETS

#: name -> (hidden, layers, heads, kv_heads, ffn, vocab, tied, experts). "gqa4": 16 layers (every use_more_bits
#: case), 4 query heads a KV head; "odd": rows of 320 and 640 values (no whole 256-value blocks: the
#: K-quants fall back), tied embeddings (token_embd takes the output's type), 2 query heads a KV head;
#: "moe8": 8 experts (the mixture's 8-expert rules; the experts stacked in 3-d tensors, MXFP4_MOE's).
MODELS = {
    "gqa4": (256, 16, 4, 1, 512, 300, False, 0),
    "odd": (320, 8, 4, 2, 640, 300, True, 0),
    "moe8": (256, 8, 4, 2, 256, 300, False, 8),
}
#: llama-quantize --pure TYPE -> the opdispatch dtype name that stands for it
PURE = {"Q4_0": "q4_0", "Q8_0": "q8_0", "Q4_K_M": "q4_K", "Q6_K": "q6_K"}


def write_model(path: Path, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                tied: bool, experts: int) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_rope_dimension_count(hidden // heads)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
    w.add_file_type(0)
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    toks += [f"t{i}" for i in range(vocab - len(toks))]
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    kv = hidden // heads * kv_heads

    def mat(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    mat("token_embd.weight", vocab, hidden)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, hidden)):
            mat(f"blk.{i}.{name}.weight", rows, cols)
        if experts:
            mat(f"blk.{i}.ffn_gate_inp.weight", experts, hidden)
            for name, rows, cols in (("ffn_gate_exps", ffn, hidden), ("ffn_up_exps", ffn, hidden),
                                     ("ffn_down_exps", hidden, ffn)):
                mat(f"blk.{i}.{name}.weight", experts, rows, cols)
        else:
            for name, rows, cols in (("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
                mat(f"blk.{i}.{name}.weight", rows, cols)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not tied:
        mat("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def types_of(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def quantize(src: Path, dst: Path, ftype: str, pure: bool) -> dict[str, str]:
    cmd = ["llama-quantize", *(["--pure"] if pure else []), str(src), str(dst), ftype, "2"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return types_of(dst)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/llama_quantize_types.json")
    fixture: dict[str, object] = {"source": "llama-quantize (llama.cpp peer build), scripts/llama_quantize_types.py",
                                  "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model, (hidden, layers, heads, kv_heads, ffn, vocab, tied, experts) in MODELS.items():
            src = Path(tmp) / f"{model}-f32.gguf"
            write_model(src, hidden, layers, heads, kv_heads, ffn, vocab, tied, experts)
            reader = gguf.GGUFReader(str(src))
            tensors = [[t.name, [int(d) for d in reversed(t.shape.tolist())]] for t in reader.tensors]
            runs = {name: quantize(src, Path(tmp) / "q.gguf", name, False) for name in PRESETS}
            runs |= {dtype: quantize(src, Path(tmp) / "q.gguf", ftype, True) for ftype, dtype in PURE.items()}
            fixture["models"][model] = {  # type: ignore[index]
                "facts": {"n_layers": layers, "n_head": heads, "n_head_kv": kv_heads, "n_expert": experts,
                          "tied": tied},
                "tensors": tensors,
                "types": {target: [got[name] for name, _ in tensors] for target, got in runs.items()},
            }
    out.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
