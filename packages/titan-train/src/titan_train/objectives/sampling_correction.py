"""The correction for rollouts sampled by another engine (vllm): the gap between the probability the engine
sampled a token at and the trainer's own, as TRL 1.16 measures it (`sampling/sampling_logp_difference`) and
weighs each token's policy loss by (`vllm_importance_sampling_correction`, its four modes); `SamplingCorrection`
holds a step's sums of both.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


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


class SamplingCorrection:
    """A step's vllm importance-sampling weights of the generating policy (`old`) to the engine's sampling, and
    the gap between them summed for TRL's sampling/* metrics over every data-parallel rank."""

    def __init__(self, settings, dp_group, device: torch.device):
        self.settings, self.dp_group = settings, dp_group
        # |gap| sum, count, max; ratio sum, count, max of -ratio (its min), max
        self.sums = torch.tensor([0, 0, 0, 0, 0, -math.inf, 0], dtype=torch.float64, device=device)

    def weights(
        self, old: torch.Tensor, sampling: torch.Tensor | None, mask: torch.Tensor, *, counted: bool
    ) -> torch.Tensor | None:
        """The per-token (or per-sequence) weights, None without engine log-probs or with the correction off;
        the gap counted where the step generated (`counted`)."""
        g = self.settings
        if sampling is None:
            return None
        weights = importance_weights(
            old,
            sampling,
            mask,
            g.vllm_importance_sampling_mode,
            g.vllm_importance_sampling_clip_min,
            g.vllm_importance_sampling_clip_max,
        )
        if counted:
            total, count, largest = logp_gap(old, sampling, mask)
            flat = weights.flatten() if weights.shape[1] == 1 else weights[mask.bool()]
            s = self.sums
            s[0] += total
            s[1] += count
            s[2] = max(s[2].item(), largest)
            s[3] += flat.sum().item()
            s[4] += flat.numel()
            if flat.numel():
                s[5] = max(s[5].item(), -flat.min().item())
                s[6] = max(s[6].item(), flat.max().item())
        return weights if g.vllm_importance_sampling_correction else None

    def metrics(self) -> dict[str, float]:
        """TRL's sampling/* metrics of the step's generation, over every data-parallel rank."""
        s = self.sums.clone()
        if self.dp_group is not None:
            sums, tops = s[[0, 1, 3, 4]], s[[2, 5, 6]]
            dist.all_reduce(sums, group=self.dp_group)
            dist.all_reduce(tops, op=dist.ReduceOp.MAX, group=self.dp_group)
            s[[0, 1, 3, 4]], s[[2, 5, 6]] = sums, tops
        if s[1] == 0:
            return {}
        metrics = {
            "sampling/sampling_logp_difference/mean": s[0].item() / s[1].item(),
            "sampling/sampling_logp_difference/max": s[2].item(),
        }
        if self.settings.vllm_importance_sampling_correction and s[4] > 0:
            metrics["sampling/importance_sampling_ratio/min"] = -s[5].item()
            metrics["sampling/importance_sampling_ratio/mean"] = s[3].item() / s[4].item()
            metrics["sampling/importance_sampling_ratio/max"] = s[6].item()
        return metrics
