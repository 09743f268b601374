"""Qwen3.5-MoE's feed-forward: Titan's routed experts (`titan_models.moe.MoE`) plus one shared expert whose
output is scaled per token by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

import torch
from torch import nn

from titan_models.feed_forward import FeedForward
from titan_models.moe import MoE, MoEArgs


class GatedSharedExpertMoE(MoE):
    """`MoE(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`; the routed part (router, experts,
    load balancing, expert parallelism) is `MoE`'s, with no shared experts of its own."""

    def __init__(self, args: MoEArgs, dim: int, hidden_dim: int, shared_hidden_dim: int):
        super().__init__(args, dim, hidden_dim)
        self.shared_expert = FeedForward(dim, shared_hidden_dim)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared
