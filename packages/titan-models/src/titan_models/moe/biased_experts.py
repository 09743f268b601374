"""gpt-oss's routed experts: SwiGLUs with biases on both projections, gate and up interleaved in one
matrix, the gate clamped above and the up projection clamped both ways.

Expert e computes `mlp2_weight[e] @ swiglu(mlp1_weight[e] @ x + mlp1_bias[e]) + mlp2_bias[e]` where
swiglu(h) = g * sigmoid(alpha * g) * (u + 1) with g = min(h[0::2], limit), u = clamp(h[1::2], -limit,
limit). Same forward contract as `titan_models.moe.experts.GroupedExperts` (rows grouped by expert,
counts per expert), which titan-parallel's expert and tensor parallelism rely on; `tp_split_dims`
tells it how to split each weight over tensor-parallel ranks (contiguous chunks of `mlp1`'s rows keep
gate/up pairs together).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from titan_models.moe.experts import _ContiguousGrad, grouped_mm_applies


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of interleaved (gate, up) columns; half as many columns out."""
    gate = h[..., ::2].clamp(max=limit)
    up = h[..., 1::2].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


class _ScaleForwardOnly(torch.autograd.Function):
    """`x / factor` forward, gradient passed unscaled: a bias added once to a sum of `factor` parts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: int) -> torch.Tensor:
        return x / factor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _hidden_shards(weight: torch.Tensor) -> int:
    """Into how many parts tensor parallelism split the experts' hidden dim (dim 1 of `mlp1_weight`)."""
    if not isinstance(weight, DTensor):
        return 1
    parts = 1
    for i, placement in enumerate(weight.placements):
        if placement == Shard(1):
            parts *= weight.device_mesh.size(i)
    return parts


class BiasedSwiGLUExperts(nn.Module):
    """`num_experts` clamped SwiGLUs with biases, stacked (torchtitan 0.2.2's gpt-oss names and shapes)."""

    # Which dim of each weight holds the hidden units (None: not split, the output bias).
    tp_split_dims = {"mlp1_weight": 1, "mlp1_bias": 1, "mlp2_weight": 2, "mlp2_bias": None}

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, *, alpha: float = 1.702, limit: float = 7.0
    ):
        super().__init__()
        self.num_experts, self.hidden_dim = num_experts, hidden_dim
        self.alpha, self.limit = alpha, limit
        self.mlp1_weight = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.mlp1_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.mlp2_weight = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.mlp2_bias = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """(T, dim) outputs for expert-grouped rows `x` (T, dim); rows past the counted ones give zeros."""
        w1, b1, w2, b2 = (
            p.to_local() if isinstance(p, DTensor) else p
            for p in (self.mlp1_weight, self.mlp1_bias, self.mlp2_weight, self.mlp2_bias)
        )
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        w1, b1, w2, b2 = (p.to(x.dtype) for p in (w1, b1, w2, b2))
        # With the hidden dim split over tp ranks each holds a partial sum that is added up afterwards:
        # the output bias, whole on every rank, is added as 1/parts of itself.
        parts = _hidden_shards(self.mlp1_weight)
        if parts > 1:
            b2 = _ScaleForwardOnly.apply(b2, parts)
        counts = num_tokens_per_expert
        if not grouped_mm_applies(x, 2 * w2.shape[-1]) or not grouped_mm_applies(x, w2.shape[-1]):
            return self._for_loop(w1, b1, w2, b2, x, counts)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        rows = torch.arange(x.shape[0], device=x.device)
        # Each row's expert, without a host sync; rows past the last offset are masked out below.
        expert = torch.searchsorted(offsets, rows.to(torch.int32), right=True).clamp(max=counts.shape[0] - 1)
        counted = (rows < offsets[-1]).unsqueeze(-1)
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets) + b1[expert]
        h = clamped_swiglu(h, self.alpha, self.limit)
        out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets) + b2[expert]
        return _ContiguousGrad.apply(torch.where(counted, out, 0.0))

    def _for_loop(self, w1, b1, w2, b2, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert by expert (one host sync for the counts), for shapes the grouped matmul cannot take."""
        sizes = counts.tolist()
        used = sum(sizes)
        outs = []
        for e, rows in enumerate(torch.split(x[:used], sizes, dim=0)):
            h = clamped_swiglu(rows @ w1[e].T + b1[e], self.alpha, self.limit)
            outs.append(h @ w2[e].T + b2[e])
        outs.append(x.new_zeros(x.shape[0] - used, x.shape[1]))
        return torch.cat(outs, dim=0)
