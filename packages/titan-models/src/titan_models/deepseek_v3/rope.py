"""DeepSeek's rotary table: plain RoPE on the rotated head dimensions, stretched by YaRN for long context."""

from __future__ import annotations

import math

import torch

from titan_models.deepseek_v3.args import DeepSeekV3Args


def _correction_dim(rotations: float, dim: int, theta: float, seq_len: int) -> float:
    """The frequency index whose wavelength fits `rotations` times into `seq_len` positions."""
    return dim * math.log(seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inverse_frequencies(args: DeepSeekV3Args) -> torch.Tensor:
    """(qk_rope_head_dim / 2,) inverse frequencies, with YaRN's stretch when `args.uses_yarn`.

    Frequencies that turn more than `beta_fast` times over `original_seq_len` are kept, those that turn
    fewer than `beta_slow` times are divided by `rope_factor`, and a linear ramp blends the band between.
    """
    dim, theta = args.qk_rope_head_dim, args.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not args.uses_yarn:
        return inv_freq
    low = max(math.floor(_correction_dim(args.beta_fast, dim, theta, args.original_seq_len)), 0)
    high = min(math.ceil(_correction_dim(args.beta_slow, dim, theta, args.original_seq_len)), dim - 1)
    if low == high:
        high += 0.001  # a one-index band: keep the ramp finite
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / args.rope_factor * (1 - keep) + inv_freq * keep


def deepseek_rotary_table(args: DeepSeekV3Args) -> torch.Tensor:
    """Complex table (max_seq_len, qk_rope_head_dim / 2), consecutive pairs rotated (Meta's layout)."""
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), yarn_inverse_frequencies(args))
    return torch.polar(torch.ones_like(angles), angles)
