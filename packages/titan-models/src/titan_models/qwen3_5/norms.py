"""Qwen3.5's two RMSNorms: the zero-centred one of its blocks and attention heads, and the gated one that
closes each linear-attention layer.

The zero-centred norm scales by `1 + weight` (its weight starts at 0), so a checkpoint's weights are read
and written exactly as stored; holding `1 + weight` in a plain RMSNorm would round it on every export.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCentredRMSNorm(nn.Module):
    """`rms_norm(x) * (1 + weight)`, computed in float32 and cast back to `x`'s dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms_normalised(x, self.eps) * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """`rms_norm(x) * weight * silu(gate)` over each head's values (weight starts at 1): the linear
    layer's output gate."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = self.weight * _rms_normalised(x, self.eps).type_as(x)
        return (normed * F.silu(gate.float())).type_as(x)
