"""Training FLOPs per token of models with MoE layers (Qwen3, Llama 4), from their active parameters.

A token passes through `top_k` of a layer's `num_experts` routed experts (plus the shared ones); the
active count is `titan_models.moe.count_active_parameters`. FLOPs follow Titan's Llama rule
(`titan_models.flops_per_token`: 6 per non-embedding parameter plus the attention scores) with that
count: 6 * N_active + 12 * layers * heads * head_dim * seq_len (torchtitan 0.2.2's formula for these
families; chunked attention layers are counted over the whole sequence, as torchtitan does).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from titan_models.flops import flops_per_token
from titan_models.moe.params import count_active_parameters


def moe_flops_per_token(args: Any, model: nn.Module, seq_len: int) -> int:
    """Training FLOPs per token of `model` (meta device is fine) at `seq_len`."""
    active = count_active_parameters(model)
    embedding = active - count_active_parameters(model, exclude_embedding=True)
    return flops_per_token(args, active, embedding, seq_len)
