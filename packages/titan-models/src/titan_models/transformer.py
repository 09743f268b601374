"""The Llama transformer: blocks of attention and SwiGLU feed-forward between RMSNorms."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.args import ModelArgs
from titan_models.attention import Attention
from titan_models.attention_masks import AttentionMask
from titan_models.decoder import Decoder
from titan_models.feed_forward import FeedForward
from titan_models.tensor_parallel_plan import gqa_tp_entries

__all__ = ["FeedForward", "Transformer", "TransformerBlock"]


class TransformerBlock(nn.Module):
    """One repeated block: pre-norm attention then pre-norm feed-forward, each residual."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(Decoder):
    """A Llama 2/3 decoder (see `titan_models.decoder.Decoder` for the frame, init and parallel hooks)."""

    def build_block(self, layer: int) -> nn.Module:
        return TransformerBlock(self.args)

    def attention_tp_entries(self) -> dict[str, ParallelStyle]:
        return gqa_tp_entries()
