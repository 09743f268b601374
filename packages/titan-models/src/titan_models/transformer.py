"""The Llama transformer: blocks of attention and SwiGLU feed-forward between RMSNorms."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.args import ModelArgs
from titan_models.attention import Attention
from titan_models.decoder import Decoder
from titan_models.decoder_block import DecoderBlock
from titan_models.feed_forward import FeedForward
from titan_models.tensor_parallel_plan import gqa_tp_entries

__all__ = ["FeedForward", "Transformer", "TransformerBlock"]


class TransformerBlock(DecoderBlock):
    """One repeated Llama block: pre-norm attention then a pre-norm SwiGLU, each residual."""

    def __init__(self, args: ModelArgs):
        super().__init__(
            Attention(args),
            dim=args.dim,
            norm_eps=args.norm_eps,
            feed_forward=FeedForward(args.dim, args.ffn_hidden_dim),
        )


class Transformer(Decoder):
    """A Llama 2/3 decoder (see `titan_models.decoder.Decoder` for the frame, init and parallel hooks)."""

    def build_block(self, layer: int) -> nn.Module:
        return TransformerBlock(self.args)

    def attention_tp_entries(self) -> dict[str, ParallelStyle]:
        return gqa_tp_entries()

    def record_max_logits(self, on: bool) -> None:
        """Have every attention keep its largest logit per head (QK-clip reads it: `query_key_heads`)."""
        for block in self.layers.values():
            block.attention.record_max_logits(on)

    def query_key_heads(self) -> dict[str, tuple[nn.Parameter, nn.Parameter, torch.Tensor]]:
        """Attention FQN -> (wq weight, wk weight, max_logits): the logits are q.k / sqrt(head_dim) of
        rotated linear projections, so scaling a head's rows scales its logits."""
        return {
            f"layers.{name}.attention": (b.attention.wq.weight, b.attention.wk.weight, b.attention.max_logits)
            for name, b in self.layers.items()
        }
