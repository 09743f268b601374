"""Rotary position embeddings: the frequency table and its application to queries and keys."""

from __future__ import annotations

import math

import torch

from titan_models.args import RopeScaling


def _scale_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's long-context stretch: slow down low frequencies, keep high ones, blend between."""
    wavelen = 2 * math.pi / inv_freq
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def rotary_frequencies(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Complex table `freqs_cis[position, pair] = exp(i * position * theta^(-2 pair / head_dim))`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = _scale_frequencies(inv_freq, scaling)
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `xq`, `xk` of shape (batch, seq, heads, head_dim) by position.

    Consecutive pairs of the head dimension form one complex number (Meta's layout); Hugging Face
    checkpoints use the half-split layout, which the weight mapping permutes into this one.
    """
    # Real arithmetic on (cos, sin) rather than a complex multiply: the same products, but compiled it
    # fuses with the casts around it, where a complex multiply runs as separate eager kernels.
    cos_sin = rotary_rows(freqs_cis, xq.shape[1])
    return rotate(xq, cos_sin), rotate(xk, cos_sin)


def rotary_rows(freqs_cis: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(cos, sin) for `rotate`: the table's first `seq_len` rows shared by the batch, or, for a table
    already gathered per token (batch, seq, pairs: packed conversations restart at 0), those rows."""
    if freqs_cis.dim() == 3:
        return torch.view_as_real(freqs_cis).unsqueeze(2)
    return torch.view_as_real(freqs_cis[:seq_len]).view(1, seq_len, 1, -1, 2)


def rotary_at(freqs_cis: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(cos, sin) rows of the table at per-row `positions` (batch, seq), shaped for `rotate`.

    Generation looks them up once per step for all blocks; rows of a left-padded batch have their
    own positions.
    """
    return torch.view_as_real(freqs_cis)[positions].unsqueeze(2)


def rotate(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (batch, seq, heads, head_dim) by `cos_sin` (1 or batch, seq, 1, head_dim / 2, 2)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = cos_sin[..., 0], cos_sin[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(3).type_as(x)
