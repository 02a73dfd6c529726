"""The Llama tensor split rule: which weights each rank of a tensor split holds (Megatron-style).

Per layer, over N devices:
- q_proj, k_proj, v_proj by rows (column-parallel): rank r holds heads r*heads/N.. and KV heads
  r*kv_heads/N..; its KV cache holds those KV heads; its attention runs on its heads alone;
- o_proj by columns (row-parallel): the rank's heads' columns; its product is a partial sum of the
  output, summed over the ranks by all_reduce_sum before the residual add;
- gate_proj, up_proj by rows and down_proj by columns, likewise (experts' stacks along their ffn axis);
- the embedding, the norms, the MoE router and the LM head are held whole by every rank (replicated), so
  every rank computes the same logits and picks the same greedy token.
A block format split along K (o_proj, down_proj) keeps whole blocks per rank, else PlacementError.
"""

from __future__ import annotations

from typing import Sequence

from ...hookspecs import Device
from ...shard import Shard, shard_cols, shard_rows
from ...tensor import Tensor
from .model import LlamaModel

#: weight names (after "model.layers.{i}.") split by rows (column-parallel) and by columns (row-parallel)
BY_ROWS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
           "mlp.up_proj.weight", "mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight")
BY_COLS = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.experts.down_proj.weight")


def shard_weight(name: str, t: Tensor, shard: Shard) -> Tensor:
    """Rank shard.rank's part of the weight `name` (a replicated weight: `t` itself)."""
    if name.endswith(BY_ROWS):
        return shard_rows(t, shard)
    if name.endswith(BY_COLS):
        return shard_cols(t, shard)
    return t


def tensor_split(model: LlamaModel, devices: Sequence[str | Device]) -> list[LlamaModel]:
    """One LlamaModel per device (rank), holding its shards of `model`'s weights and its part of the KV cache
    (see the module docstring). Replicated weights are `model`'s params themselves, and the ranks share
    `model`'s sampling states (next_tokens, token_log): each rank writes the same tokens in its own copy.
    PlacementError if the heads, KV heads or ffn features do not divide among the devices, or a block
    format's K would not split into whole blocks."""
    names = tuple(d if isinstance(d, str) else d.name for d in devices)
    if model.shard is not None:
        raise ValueError(f"llama: tensor_split takes a whole model, not rank {model.shard.rank} of a split")
    cfg = model.cfg
    for n, what in ((cfg.heads, "the attention heads"), (cfg.kv_heads, "the KV heads"), (cfg.ffn, "the ffn features")):
        Shard(0, names).part(n, what)  # before any weight is cut
    ranks = []
    for rank in range(len(names)):
        shard = Shard(rank, names)
        weights = {name: shard_weight(name, t, shard) for name, t in model.params.items()}
        if model.rope_freqs is not None:
            weights["rope_freqs.weight"] = model.rope_freqs
        part = LlamaModel(model.cfg, weights, max_seqs=model.max_seqs, stack_qkv=model.stack_qkv, shard=shard)
        part.next_tokens, part.next_f32, part.token_log = model.next_tokens, model.next_f32, model.token_log
        ranks.append(part)
    return ranks
