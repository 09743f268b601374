"""Token-choice top-k routing: which experts each token goes to, and with what weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.moe.args import MoEArgs


class TokenChoiceRouter(nn.Module):
    """Scores every expert for every token with one linear gate and picks the top k per token.

    The load-balancing bias only changes which experts are picked; the weights that scale the
    experts' outputs come from the unbiased scores (auxiliary-loss-free balancing).
    """

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.gate = nn.Linear(dim, args.num_experts, bias=args.gate_bias)
        self.args = args

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, experts) affinities, in float32 so a bf16 gate cannot blow up the softmax."""
        logits = self.gate(x).float()
        return torch.sigmoid(logits) if self.args.score_func == "sigmoid" else F.softmax(logits, dim=-1)

    def _limit_groups(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores outside each token's best `num_limited_groups` groups set to -inf."""
        a = self.args
        grouped = scores.view(-1, a.num_expert_groups, a.experts_per_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(a.num_limited_groups, dim=-1).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view_as(scores)

    def _top_k(self, choice: torch.Tensor) -> torch.Tensor:
        if self.args.num_expert_groups is not None:
            choice = self._limit_groups(choice)
        return choice.topk(self.args.top_k, dim=-1, sorted=False).indices

    def changed_by_bias(self, scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """How many tokens' chosen experts (`idx`, picked with the bias) differ from those the unbiased
        `scores` pick: what a model without the bias would route elsewhere."""
        unbiased = self._top_k(scores)
        return (unbiased.sort(dim=-1).values != idx.sort(dim=-1).values).any(dim=-1).sum()

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights (T, k) float32, expert indices (T, k) int64, all scores (T, E) float32) for x (T, dim)."""
        a = self.args
        scores = self.scores(x)
        if a.debug_force_load_balance:
            # Round-robin over experts: exact balance, for measuring throughput without routing skew.
            tokens = scores.shape[0]
            idx = torch.arange(tokens * a.top_k, device=x.device).view(tokens, a.top_k) % a.num_experts
        else:
            idx = self._top_k(scores if expert_bias is None else scores + expert_bias)
        weights = scores.gather(1, idx)
        if a.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, idx, scores
