"""Qwen3.5's two RMSNorms: the zero-centred one of its blocks and attention heads, and the per-head one
that closes each linear-attention layer (before its silu gate).

The zero-centred norm scales by `1 + weight` (its weight starts at 0), so a checkpoint's weights are read
and written exactly as stored; holding `1 + weight` in a plain RMSNorm would round it on every export.
"""

from __future__ import annotations

import torch
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


class HeadRMSNorm(nn.Module):
    """`rms_norm(x) * weight` over each head's values (weight starts at 1): the linear layer's output norm,
    which the layer then gates by silu(z). The gate stays outside the module so that tensor parallelism's
    `SequenceParallel` style, which hands a module its first input only, can wrap the norm."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _rms_normalised(x, self.eps).type_as(x)
