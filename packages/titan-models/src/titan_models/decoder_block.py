"""The block every family repeats: pre-norm attention, then a pre-norm feed-forward that is a SwiGLU or a
mixture of experts. A family passes its own attention (its masks, sinks or windows travel through it)
and its own feed-forward or experts module; the rest (names `attention`, `feed_forward` or `moe`,
`attention_norm`, `ffn_norm`, as torchtitan 0.2.2 names them) is built here once."""

from __future__ import annotations

import torch
from torch import nn

from titan_models.errors import ModelConfigError


class DecoderBlock(nn.Module):
    """`h = x + attention(attention_norm(x))`, then `h + ffn(ffn_norm(h))`, where `ffn` is the block's
    `moe` (a `titan_models.moe.MoE`, found by the model's `moe_layers()`) or its dense `feed_forward`.

    `mask` is whatever the family's `Decoder._attention_masks` builds; the block hands it to `attention`.
    """

    def __init__(
        self,
        attention: nn.Module,
        *,
        dim: int,
        norm_eps: float,
        feed_forward: nn.Module | None = None,
        moe: nn.Module | None = None,
    ):
        super().__init__()
        if (feed_forward is None) == (moe is None):
            raise ModelConfigError("model: a DecoderBlock takes exactly one of feed_forward and moe")
        self.attention = attention
        self.moe_enabled = moe is not None
        if self.moe_enabled:
            self.moe = moe
        else:
            self.feed_forward = feed_forward
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))
