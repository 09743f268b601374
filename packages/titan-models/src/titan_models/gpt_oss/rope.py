"""gpt-oss's rotary table: YaRN over `original_seq_len` positions, with YaRN's attention scale.

Frequencies that turn more than `ntk_beta` times over the original length are kept, those that turn
fewer than `ntk_alpha` times are divided by `rope_factor`, and a linear ramp (not rounded to whole
indices, as published) blends the band between. YaRN's attention scale, 0.1 ln(factor) + 1, multiplies
both the cosine and the sine, so queries and keys are each scaled by it: the table's complex entries
have that magnitude. The layout is half-split (`titan_models.half_split_rotary`), as gpt-oss's checkpoints.
"""

from __future__ import annotations

import math

import torch

from titan_models.gpt_oss.args import GptOssArgs


def yarn_inverse_frequencies(args: GptOssArgs) -> tuple[torch.Tensor, float]:
    """(head_dim / 2,) inverse frequencies and the attention scale (1.0 without YaRN)."""
    dim, base = args.head_dim, args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if args.rope_factor <= 1.0:
        return inv_freq, 1.0
    half = dim / 2

    def band_edge(turns: float) -> float:
        return half * math.log(args.original_seq_len / (turns * 2 * math.pi)) / math.log(base)

    low, high = band_edge(args.ntk_beta), band_edge(args.ntk_alpha)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0: high frequency, kept (extrapolated); ramp 1: low frequency, interpolated.
    scaled = inv_freq / args.rope_factor * ramp + inv_freq * (1 - ramp)
    return scaled, 0.1 * math.log(args.rope_factor) + 1.0


def gpt_oss_rotary_table(args: GptOssArgs) -> torch.Tensor:
    """Complex table (max_seq_len, head_dim / 2) of magnitude YaRN's attention scale."""
    inv_freq, scale = yarn_inverse_frequencies(args)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), inv_freq)
    return torch.polar(torch.full_like(angles, scale), angles)
