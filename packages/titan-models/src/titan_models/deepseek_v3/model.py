"""The DeepSeek-V3 decoder: MLA attention, then a dense SwiGLU (first blocks) or an MoE, between RMSNorms."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.decoder import Decoder
from titan_models.decoder_block import DecoderBlock
from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.deepseek_v3.attention import MultiHeadLatentAttention
from titan_models.deepseek_v3.mtp import MultiTokenPredictionHead
from titan_models.deepseek_v3.rope import deepseek_rotary_table
from titan_models.deepseek_v3.tensor_parallel_plan import mla_tp_entries, mtp_tp_entries
from titan_models.errors import ModelError
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
    `titan_models.decoder.Decoder`). Its tensor-parallel plan leaves experts to expert parallelism.
    With `num_mtp_layers`, `mtp` holds the multi-token-prediction depths (`deepseek_v3.mtp`), whose
    logits a training forward appends along the sequence; under pipeline parallelism they sit on the last
    stage, fed the token embeddings the stages before it carry (`_blocks_forward`)."""

    input_projections = (
        "wq.weight",
        "wq_a.weight",
        "wq_b.weight",
        "wkv_a.weight",
        "wkv_b.weight",
        "w1.weight",
        "eh_proj.weight",
    )
    # Drawn in float32 whatever the parameter dtype, as this family's init always has.
    init_draw_dtype = torch.float32

    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        self.mtp = MultiTokenPredictionHead(args, self.build_block) if args.num_mtp_layers else None

    def _blocks_forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, masks: Any) -> torch.Tensor:
        """With MTP depths, a pipeline stage before the last passes on [h; Emb(t)] (B, T, 2 * dim): the
        hidden state beside the token embeddings, which the depths on the last stage read k places ahead.

        The depths share the first stage's embedding; carrying its output (rather than the token ids to
        a copy of the table on the last stage) sends the depths' gradient back through the stages into
        the one embedding weight, so no stage holds a second copy to keep in step.
        """
        if not self.args.num_mtp_layers:
            return super()._blocks_forward(x, freqs_cis, masks)
        if self.tok_embeddings is not None:
            h = embedded = self.tok_embeddings(x)
        else:
            h, embedded = x.chunk(2, dim=-1)
        for block in self.layers.values():
            h = block(h, freqs_cis, masks)
        if self.output is None:
            if self.mtp is not None:
                raise ModelError(
                    "model: the MTP depths sit on a pipeline stage without the output head they share; "
                    "do not split the stages at 'mtp'"
                )
            return torch.cat([h, embedded], dim=-1)
        logits = self.output(self.norm(h))
        if self.mtp is None or not self.training:
            return logits
        if self.tok_embeddings is not None:
            # The whole model re-embeds: under sequence parallelism `embedded` is split along the sequence.
            ahead = self.mtp(
                h, lambda k: self.tok_embeddings(torch.roll(x, -k, dims=1)), self.output, freqs_cis, masks
            )
        else:
            ahead = self.mtp(h, lambda k: torch.roll(embedded, -k, dims=1), self.output, freqs_cis, masks)
        return torch.cat([logits, *ahead], dim=1)

    def pipeline_units(self) -> list[str]:
        """The MTP depths after the output head they share: on the last stage."""
        units = super().pipeline_units()
        return units if self.mtp is None else [*units, "mtp"]

    def moe_layers(self) -> dict[str, nn.Module]:
        layers = super().moe_layers()
        if self.mtp is not None:
            layers |= {f"mtp.layers.{i}.block.moe": depth.block.moe for i, depth in self.mtp.layers.items()}
        return layers

    def build_block(self, layer: int) -> nn.Module:
        return deepseek_v3_block(layer, self.args)

    def record_max_logits(self, on: bool) -> None:
        """Have every MLA keep its largest logit per head (QK-clip reads it: `latent_query_key_heads`)."""
        for attention in self.latent_query_key_heads().values():
            attention.record_max_logits(on)

    def latent_query_key_heads(self) -> dict[str, MultiHeadLatentAttention]:
        """Attention FQN -> its MLA (the MTP depths' included), whose up-projections QK-clip scales."""
        heads = {f"layers.{name}.attention": block.attention for name, block in self.layers.items()}
        if self.mtp is not None:
            heads |= {
                f"mtp.layers.{i}.block.attention": d.block.attention for i, d in self.mtp.layers.items()
            }
        return heads

    def final_norm_eps(self) -> float | None:
        return self.args.final_norm_eps

    def _rotary_table(self) -> torch.Tensor:
        return deepseek_rotary_table(self.args)

    def tp_plan(
        self, *, sequence_parallel: bool = True, loss_parallel: bool = True
    ) -> dict[str, ParallelStyle]:
        plan = super().tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        if self.mtp is None:
            return plan
        return plan | mtp_tp_entries(plan, sequence_parallel=sequence_parallel)

    def attention_tp_entries(self) -> dict[str, ParallelStyle]:
        return mla_tp_entries(low_rank_q=self.args.q_lora_rank > 0)
