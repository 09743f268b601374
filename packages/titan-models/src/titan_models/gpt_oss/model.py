"""The gpt-oss decoder: attention with sinks (sliding window on even layers), then a mixture of
biased, clamped SwiGLU experts, between RMSNorms.

The frame around the blocks (embedding, init, forward, parallelism hooks) is
`titan_models.decoder.Decoder`; routing and load balancing are `titan_models.moe.MoE`, with gpt-oss's
experts (`titan_models.moe.BiasedSwiGLUExperts`). Parameter names are torchtitan 0.2.2's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.decoder import Decoder
from titan_models.decoder_block import DecoderBlock
from titan_models.gpt_oss.args import GptOssArgs
from titan_models.gpt_oss.attention import GptOssAttention
from titan_models.gpt_oss.masks import GptOssMasks, SequenceShard, build_gpt_oss_masks
from titan_models.gpt_oss.rope import gpt_oss_rotary_table
from titan_models.gpt_oss.tensor_parallel_plan import HeadShardedSinks, gpt_oss_attention_tp_entries
from titan_models.moe import MoE
from titan_models.moe.biased_experts import BiasedSwiGLUExperts


def gpt_oss_block(layer: int, args: GptOssArgs) -> DecoderBlock:
    """Attention with sinks (windowed on sliding layers), then a mixture of biased, clamped SwiGLU experts."""
    experts = BiasedSwiGLUExperts(
        args.dim,
        args.moe_inter_dim,
        args.moe_args.num_experts,
        alpha=args.swiglu_alpha,
        limit=args.swiglu_limit,
    )
    return DecoderBlock(
        GptOssAttention(args, layer),
        dim=args.dim,
        norm_eps=args.norm_eps,
        moe=MoE(args.moe_args, args.dim, args.moe_inter_dim, experts=experts),
    )


class GptOssModel(Decoder):
    """A gpt-oss decoder with torchtitan 0.2.2's parameter names (frame, init and parallel hooks:
    `titan_models.decoder.Decoder`).

    Initialised as torchtitan's: every attention parameter (weights, biases, sinks) and every expert
    parameter with the block's depth-scaled std 0.02 / sqrt(2 (layer + 1)), the router gate too (its
    bias, which torchtitan 0.2.2 leaves as allocated, drawn like its weight).
    """

    input_projections = ()
    depth_scaled = tuple(f"{w}.{p}" for w in ("wq", "wk", "wv", "wo") for p in ("weight", "bias")) + (
        "attention.sinks",
    )

    def build_block(self, layer: int) -> nn.Module:
        return gpt_oss_block(layer, self.args)

    _sequence_shard = None

    def set_sequence_shard(self, shard: SequenceShard | None) -> None:
        """Attend over the whole sequence gathered through `shard` (context parallelism hands it for the
        step, then None): torch's ring attention has no sink and no window (see `gpt_oss.attention`)."""
        self._sequence_shard = shard

    def _rotary_table(self) -> torch.Tensor:
        return gpt_oss_rotary_table(self.args)

    def _attention_masks(
        self, doc_ids: torch.Tensor | None, seq_len: int, device: torch.device
    ) -> GptOssMasks:
        return build_gpt_oss_masks(self.args, doc_ids, seq_len, device, self._sequence_shard)

    def attention_tp_entries(self) -> dict[str, ParallelStyle]:
        return gpt_oss_attention_tp_entries()

    def tp_plan(
        self, *, sequence_parallel: bool = True, loss_parallel: bool = True
    ) -> dict[str, ParallelStyle]:
        """The shared decoder plan, with each attention's sinks sharded by head like its projections."""
        plan = super().tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        plan["layers.*.attention"] = HeadShardedSinks(plan.get("layers.*.attention"))
        return plan
