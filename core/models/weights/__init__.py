"""Weight loaders, one module per format: gguf, safetensors, state_dict; names maps GGUF's names to HF's.

Every loader returns {name: param} under Hugging Face's Llama names, the
names LlamaModel takes, each tensor in the format it is stored in (block
formats as raw bytes, never dequantized): file-backed params are read-only
views of a memory map, so loading copies nothing until a backend uploads.
Malformed input raises ValueError naming the file and the tensor. More in
docs/models.md.
"""
