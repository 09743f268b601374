"""The MoE feed-forward: route, group tokens by expert, run the experts, put tokens back and combine."""

from __future__ import annotations

import torch
from torch import nn

from titan_models.feed_forward import FeedForward
from titan_models.moe.args import MoEArgs
from titan_models.moe.experts import GroupedExperts
from titan_models.moe.load_balance import attach_aux_loss, sequence_aux_loss
from titan_models.moe.router import TokenChoiceRouter


def _recomputing() -> bool:
    """Whether this forward runs inside backward: activation checkpointing recomputing it (every AC mode
    recomputes there). Its tokens were counted by the forward it repeats."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """Token-choice top-k routed experts plus always-on shared experts, with torchtitan 0.2.2's names.

    Parameters: `router.gate.weight` (E, dim), `experts.w1/w2/w3` (stacked, see `GroupedExperts`),
    `shared_experts.w1/w2/w3.weight` (one SwiGLU of width hidden * num_shared_experts). Buffers:
    `expert_bias` (E,) float32, saved in checkpoints, only when `load_balance_coeff` is set;
    `tokens_per_expert` (E,) float32, not saved, counted for `update_expert_bias` by training forwards
    only: not in eval mode (validation), not when activation checkpointing recomputes a forward.
    """

    def __init__(self, args: MoEArgs, dim: int, hidden_dim: int, experts: nn.Module | None = None):
        super().__init__()
        self.args = args
        # Under tensor parallelism, weighting the experts' outputs by the router's scores after the
        # experts needs those outputs whole on every tp rank (a partial sum would give the router a
        # partial gradient); weighting the tokens before them leaves the output a partial sum, which the
        # model's tp_plan reduce-scatters with the split shared experts' (moe/tensor_parallel_plan.py).
        # Read by titan-parallel's expert styles (see titan_parallel.protocols.HasMoELayers).
        self.tp_output_whole = not args.score_before_experts
        self.router = TokenChoiceRouter(dim, args)
        # A family whose experts compute another function (gpt-oss: biased, clamped SwiGLU) passes its
        # own module with the same forward contract (see `titan_models.moe.experts`).
        self.experts = experts or GroupedExperts(dim, hidden_dim, args.num_experts, args.use_grouped_mm)
        self.shared_experts = (
            FeedForward(dim, hidden_dim * args.num_shared_experts) if args.num_shared_experts > 0 else None
        )
        self.load_balance_coeff = args.load_balance_coeff
        self.expert_bias: torch.Tensor | None
        if args.load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        # Factor on the sequence-wise loss's gradient (`MoEArgs.aux_loss_scale`).
        self.aux_loss_scale = args.aux_loss_scale
        # The last forward's sequence-wise loss (detached), for metrics; None when it is off.
        self.last_aux_loss: torch.Tensor | None = None

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """Zero the expert bias and the token counts (on `buffer_device`), as at the start of training."""
        device = buffer_device or self.tokens_per_expert.device
        with torch.device(device):
            self.tokens_per_expert = torch.zeros(self.args.num_experts)
            if self.expert_bias is not None:
                self.expert_bias = torch.zeros(self.args.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim)."""
        batch, seq_len, dim = x.shape
        top_k, num_experts = self.args.top_k, self.args.num_experts
        flat = x.reshape(-1, dim)
        weights, indices, scores = self.router(flat, self.expert_bias)

        # A scatter-add, not bincount: its output shape is static, so a dry run traces it on fake tensors.
        choices = indices.view(-1)
        counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, choices, torch.ones_like(choices)
        )
        if self.training and not _recomputing():
            with torch.no_grad():
                self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))

        # Stable sort keeps each expert's rows in token order, which makes the result deterministic.
        order = torch.argsort(indices.view(-1), stable=True)
        routed = flat[order // top_k]
        if self.args.score_before_experts:
            routed = (routed.float() * weights.view(-1)[order].unsqueeze(-1)).to(x.dtype)
        routed_out = self.experts(routed, counts)

        # Back to (token, choice) order: a gather by the inverse permutation.
        per_choice = routed_out[torch.argsort(order)].view(-1, top_k, dim)
        if self.args.score_before_experts:
            out = per_choice.sum(dim=1)
        else:
            out = (per_choice.float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        out = out.view(batch, seq_len, dim)

        coeff = self.args.seq_aux_loss_coeff
        self.last_aux_loss = None
        if coeff > 0 and torch.is_grad_enabled():
            aux = sequence_aux_loss(scores, indices, batch, top_k)
            self.last_aux_loss = aux.detach()
            out = attach_aux_loss(out, aux, coeff * self.aux_loss_scale)
        return out
