"""The DeepSeek-V3 decoder: MLA attention, then a dense SwiGLU (first blocks) or an MoE, between RMSNorms."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.decoder import Decoder
from titan_models.decoder_block import DecoderBlock
from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.deepseek_v3.attention import MultiHeadLatentAttention
from titan_models.deepseek_v3.rope import deepseek_rotary_table
from titan_models.deepseek_v3.tensor_parallel_plan import mla_tp_entries
from titan_models.feed_forward import FeedForward
from titan_models.moe import MoE


def deepseek_v3_block(layer: int, args: DeepSeekV3Args) -> DecoderBlock:
    """MLA attention, then a dense SwiGLU `feed_forward` in the first `n_dense_layers` blocks, `moe` after."""
    moe = args.is_moe_layer(layer)
    return DecoderBlock(
        MultiHeadLatentAttention(args),
        dim=args.dim,
        norm_eps=args.norm_eps,
        moe=MoE(args.moe_args, args.dim, args.moe_inter_dim) if moe else None,
        feed_forward=None if moe else FeedForward(args.dim, args.inter_dim),
    )


class DeepSeekV3Model(Decoder):
    """A DeepSeek-V2/V3 decoder with torchtitan 0.2.2's parameter names (frame, init and parallel hooks:
    `titan_models.decoder.Decoder`). Its tensor-parallel plan leaves experts to expert parallelism."""

    input_projections = (
        "wq.weight",
        "wq_a.weight",
        "wq_b.weight",
        "wkv_a.weight",
        "wkv_b.weight",
        "w1.weight",
    )
    # Drawn in float32 whatever the parameter dtype, as this family's init always has.
    init_draw_dtype = torch.float32

    def build_block(self, layer: int) -> nn.Module:
        return deepseek_v3_block(layer, self.args)

    def final_norm_eps(self) -> float | None:
        return self.args.final_norm_eps

    def _rotary_table(self) -> torch.Tensor:
        return deepseek_rotary_table(self.args)

    def attention_tp_entries(self) -> dict[str, ParallelStyle]:
        return mla_tp_entries(low_rank_q=self.args.q_lora_rank > 0)
