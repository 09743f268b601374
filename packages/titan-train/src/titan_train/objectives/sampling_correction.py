"""The correction for rollouts sampled by another engine (vllm): the gap between the probability the engine
sampled a token at and the trainer's own, as TRL 1.16 measures it (`sampling/sampling_logp_difference`) and
weighs each token's policy loss by (`vllm_importance_sampling_correction`, its four modes).
"""

from __future__ import annotations

import math

import torch


def importance_weights(
    logps: torch.Tensor,
    sampling: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float,
    clip_max: float,
) -> torch.Tensor:
    """Per token (B, T), or per sequence (B, 1), exp(trainer's - engine's log-prob) over the completion's
    tokens (the sequence modes: of their sum), clamped to [clip_min, clip_max] (`*_truncate`) or zeroed
    outside it (`*_mask`); clip_min 0 is no lower bound."""
    diff = torch.nan_to_num((logps - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min or None, max=clip_max)
    low = clip_min if clip_min else -math.inf
    return ratio.masked_fill((ratio < low) | (ratio > clip_max), 0.0)


def logp_gap(logps: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(sum, count, max) of |trainer's - engine's log-prob| over the completion tokens."""
    gap = (logps - sampling).abs()[mask.bool()]
    gap = gap[~torch.isnan(gap)]
    return gap.sum().item(), float(gap.numel()), gap.max().item() if gap.numel() else 0.0
