"""Parameter counts (total and active per token) and training FLOPs per token of models with MoE layers.

A token passes through `top_k` of a layer's `num_experts` routed experts (plus the shared ones), so
the parameters it uses are the total less the routed experts it skips. FLOPs follow Titan's Llama
rule (`titan_models.flops_per_token`: 6 per non-embedding parameter plus the attention scores) with
the active count: 6 * N_active + 12 * layers * heads * head_dim * seq_len. Works on the meta device.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from titan_models.flops import count_parameters, flops_per_token


def inactive_expert_parameters(model: nn.Module) -> int:
    """Parameters of the routed experts a token does not visit, summed over `model.moe_layers()`."""
    skipped = 0
    for moe in model.moe_layers().values():
        per_expert = sum(p.numel() for p in moe.experts.parameters()) // moe.args.num_experts
        skipped += per_expert * (moe.args.num_experts - moe.args.top_k)
    return skipped


def active_parameters(model: nn.Module, *, exclude_embedding: bool = False) -> int:
    """Parameters one token's forward uses: all but the unvisited routed experts (`count_parameters`'s
    rules for the embedding and a tied output matrix)."""
    return count_parameters(model, exclude_embedding=exclude_embedding) - inactive_expert_parameters(model)


def moe_flops_per_token(args: Any, model: nn.Module, seq_len: int) -> int:
    """Training FLOPs per token from the active parameters (see the module docstring)."""
    active = active_parameters(model)
    embedding = active - active_parameters(model, exclude_embedding=True)
    return flops_per_token(args, active, embedding, seq_len)
