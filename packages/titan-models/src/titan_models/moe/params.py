"""Parameter counts of MoE models: all parameters, and those a single token actually uses."""

from __future__ import annotations

from torch import nn


def count_active_parameters(model: nn.Module, *, exclude_embedding: bool = False) -> int:
    """Parameters one token goes through: everything except the routed experts it is not sent to.

    Each MoE layer contributes its router, shared experts and `top_k / num_experts` of its routed
    experts. Works on the meta device. `exclude_embedding` leaves out `tok_embeddings` (a lookup).
    """
    total = sum(p.numel() for p in model.parameters())
    for moe in model.moe_layers().values():
        routed = sum(p.numel() for p in moe.experts.parameters())
        total -= routed - routed * moe.args.top_k // moe.args.num_experts
    if exclude_embedding and getattr(model, "tok_embeddings", None) is not None:
        total -= model.tok_embeddings.weight.numel()
    return total
