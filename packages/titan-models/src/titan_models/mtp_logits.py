"""Multi-token prediction's logits: a training forward of a model with D MTP depths returns the main logits
and each depth's, concatenated along the sequence; a loss splits them back (any family with depths)."""

from __future__ import annotations

import torch


def split_mtp_logits(logits: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """The main logits then each MTP depth's, from a training forward's (B, (1 + D) * seq_len, V)."""
    total = logits.shape[1]
    if total % seq_len:
        raise ValueError(
            f"logits of {total} positions are not a whole number of {seq_len}-position sequences"
        )
    return [logits[:, i * seq_len : (i + 1) * seq_len] for i in range(total // seq_len)]
