"""The half-split rotary layout: each head's first half rotates against its second half.

Titan's Llama rotates consecutive pairs (Meta's layout). Qwen3 and gpt-oss checkpoints, Hugging Face's and
torchtitan's alike, pair dimension i with i + head_dim / 2, so those families keep that layout and their
weights need no permutation either way. The rotation itself is Titan's: the halves are viewed as
pairs, rotated, and viewed back.
"""

from __future__ import annotations

import torch

from titan_models.rope import rotary_rows, rotate


def _halves_as_pairs(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def _pairs_as_halves(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def apply_rotary_half_split(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `xq`, `xk` (batch, seq, heads, head_dim) by position, in the half-split layout."""
    cos_sin = rotary_rows(freqs_cis, xq.shape[1])
    return (
        _pairs_as_halves(rotate(_halves_as_pairs(xq), cos_sin)),
        _pairs_as_halves(rotate(_halves_as_pairs(xk), cos_sin)),
    )
