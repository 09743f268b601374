"""The block Llama, Qwen3 and Llama 4 repeat: pre-norm attention, then a pre-norm feed-forward that is
a SwiGLU or, where the family puts one, a mixture of experts. Only the attention differs between them,
so a family passes its own and the rest (names `attention`, `feed_forward` or `moe`, `attention_norm`,
`ffn_norm`, as torchtitan 0.2.2 names them) is built here once."""

from __future__ import annotations

import torch
from torch import nn

from titan_models.feed_forward import FeedForward
from titan_models.moe import MoE, MoEArgs


class DecoderBlock(nn.Module):
    """`h = x + attention(attention_norm(x))`, then `h + ffn(ffn_norm(h))`, where `ffn` is `moe` when
    `moe_args` is given and a SwiGLU `feed_forward` of width `ffn_hidden_dim` otherwise."""

    def __init__(
        self,
        attention: nn.Module,
        *,
        dim: int,
        norm_eps: float,
        ffn_hidden_dim: int,
        moe_args: MoEArgs | None = None,
        moe_hidden_dim: int | None = None,
    ):
        super().__init__()
        self.attention = attention
        self.moe_enabled = moe_args is not None
        if self.moe_enabled:
            self.moe = MoE(moe_args, dim=dim, hidden_dim=moe_hidden_dim)
        else:
            self.feed_forward = FeedForward(dim, ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))
