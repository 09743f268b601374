"""The Qwen3 decoder: Llama's block with per-head RMS-normalised queries and keys, half-split rotary
embeddings, a head width of its own, and optionally a mixture-of-experts feed-forward.

Everything Qwen3 shares with Llama is Titan's: the attention kernels and masks, the rotary table,
SwiGLU, and the frame around the blocks (weight initialisation, forward, parallelism hooks) from
`titan_models.decoder.Decoder`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.attention import Attention
from titan_models.decoder import Decoder
from titan_models.decoder_block import DecoderBlock
from titan_models.feed_forward import FeedForward
from titan_models.half_split_rotary import apply_rotary_half_split
from titan_models.moe import MoE
from titan_models.qwen3.args import Qwen3Args
from titan_models.qwen3.tensor_parallel_plan import qk_norm_tp_entries
from titan_models.tensor_parallel_plan import gqa_tp_entries


class Qwen3Attention(Attention):
    """Grouped-query attention with RMSNorm over each query and key head before the rotation."""

    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def project(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xq, xk, xv = self.heads(x)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rotary_half_split(xq, xk, freqs_cis)
        return xq, xk, xv


def qwen3_block(args: Qwen3Args) -> DecoderBlock:
    """Qwen3's attention, then its SwiGLU (`feed_forward`) or, in MoE flavors, its `moe`."""
    moe = args.moe_args is not None
    return DecoderBlock(
        Qwen3Attention(args),
        dim=args.dim,
        norm_eps=args.norm_eps,
        moe=MoE(args.moe_args, dim=args.dim, hidden_dim=args.moe_inter_dim) if moe else None,
        feed_forward=None if moe else FeedForward(args.dim, args.hidden_dim),
    )


class Qwen3Model(Decoder):
    """A Qwen3 decoder with torchtitan 0.2.2's parameter names (frame, init and parallel hooks:
    `titan_models.decoder.Decoder`)."""

    def build_block(self, layer: int) -> nn.Module:
        return qwen3_block(self.args)

    def attention_tp_entries(self) -> dict[str, ParallelStyle]:
        """Heads split Megatron-style, the QK norms split by head (see `qwen3.tensor_parallel_plan`)."""
        return gqa_tp_entries() | (qk_norm_tp_entries() if self.args.qk_norm else {})
