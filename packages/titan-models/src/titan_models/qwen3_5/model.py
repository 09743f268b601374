"""The Qwen3.5 decoder: three of every four blocks mix tokens with Gated DeltaNet linear attention, the
fourth with gated full attention; every block then a SwiGLU or, in MoE flavors, routed experts and a gated
shared expert; zero-centred RMSNorms throughout.

The frame (embedding, forward, init, parallelism hooks) is `titan_models.decoder.Decoder` and the block
is the shared `DecoderBlock`, its norms swapped for zero-centred ones. Every block is given a
`HybridMasks`: full attention reads the attention mask, linear attention the document ids, so packed
documents stay apart in both kinds of layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.attention_masks import (
    AttentionMask,
    build_attention_mask,
    document_mask,
    documents_from_positions,
    flex_can_run,
)
from titan_models.decoder import Decoder
from titan_models.decoder_block import DecoderBlock
from titan_models.errors import ModelConfigError
from titan_models.feed_forward import FeedForward
from titan_models.init import INPUT_PROJECTIONS, Filler, trunc_normal
from titan_models.qwen3_5.args import Qwen3_5Args
from titan_models.qwen3_5.attention import GatedAttention
from titan_models.qwen3_5.linear_attention import GatedDeltaNet
from titan_models.qwen3_5.moe import GatedSharedExpertMoE
from titan_models.qwen3_5.norms import ZeroCentredRMSNorm
from titan_models.qwen3_5.tensor_parallel_plan import HeadShardedParameters, qwen3_5_attention_tp_entries
from titan_models.rope import rotary_frequencies


@dataclass(frozen=True)
class HybridMasks:
    """What each block takes: the full-attention mask, the (batch, seq) document ids the linear layers
    restart at (None: one document per row), and under context parallelism this rank's `SequenceShard`
    (`titan_parallel.sequence_shard`), over which the linear layers gather the whole sequence."""

    attention: AttentionMask
    documents: torch.Tensor | None
    sequence_shard: Any = None


class Qwen3_5Block(DecoderBlock):
    """The shared block with zero-centred norms around a linear or a full attention."""

    def __init__(self, args: Qwen3_5Args, layer: int):
        moe = args.moe_args is not None
        super().__init__(
            GatedDeltaNet(args) if args.is_linear(layer) else GatedAttention(args),
            dim=args.dim,
            norm_eps=args.norm_eps,
            moe=GatedSharedExpertMoE(args.moe_args, args.dim, args.moe_inter_dim, args.shared_hidden_dim)
            if moe
            else None,
            feed_forward=None if moe else FeedForward(args.dim, args.hidden_dim),
        )
        self.attention_norm = ZeroCentredRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = ZeroCentredRMSNorm(args.dim, eps=args.norm_eps)


def _zeros(t: torch.Tensor, g: torch.Generator) -> None:
    nn.init.zeros_(t)


def _ones(t: torch.Tensor, g: torch.Generator) -> None:
    nn.init.ones_(t)


def _log_uniform_decay(t: torch.Tensor, g: torch.Generator) -> None:
    # A = exp(A_log) drawn uniformly in [1, 16]: per-head decay rates of different speeds.
    t.uniform_(1.0, 16.0, generator=g).log_()


def _conv_uniform(t: torch.Tensor, g: torch.Generator) -> None:
    bound = 1.0 / math.sqrt(t.shape[-1])  # nn.Conv1d's default for a depthwise kernel
    t.uniform_(-bound, bound, generator=g)


class Qwen3_5Model(Decoder):
    """A Qwen3.5 text decoder (frame, init and parallel hooks: `titan_models.decoder.Decoder`).

    Initialisation: zero-centred norms at 0 (a scale of 1), the linear layers' gated norm at 1, `A_log`
    the log of U(1, 16), `dt_bias` 1, the convolution U(-1/sqrt(taps), 1/sqrt(taps)); projections as
    Titan's other families (0.02 for inputs, depth-scaled for outputs)."""

    input_projections = (
        *INPUT_PROJECTIONS,
        *(f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
    )

    def __init__(self, args: Qwen3_5Args):
        super().__init__(args)
        self.norm = ZeroCentredRMSNorm(args.dim, eps=args.norm_eps)

    def build_block(self, layer: int) -> nn.Module:
        return Qwen3_5Block(self.args, layer)

    def parameter_filler(self, name: str) -> Filler | None:
        if name.endswith("attention.norm.weight"):
            return _ones  # the linear layers' gated norm scales by its weight itself
        if name.endswith("norm.weight"):
            return _zeros
        if name.endswith("A_log"):
            return _log_uniform_decay
        if name.endswith("dt_bias"):
            return _ones
        if name.endswith("conv_weight"):
            return _conv_uniform
        if ".shared_expert" in name:  # the shared expert and its gate, which Titan's MoE rule does not name
            if name.endswith(("w2.weight", "w3.weight")):
                depth = int(name.split(".")[1]) + 1 if self.args.depth_init else self.args.n_layers
                return trunc_normal(0.02 / (2 * depth) ** 0.5)
            return trunc_normal(0.02)
        return None

    def _rotary_table(self) -> torch.Tensor:
        a = self.args
        return rotary_frequencies(a.rotary_dim, a.max_seq_len, a.rope_theta)

    @classmethod
    def takes_positions(cls) -> bool:
        return True

    _sequence_shard = None

    def set_sequence_shard(self, shard: Any) -> None:
        """Under context parallelism (handed for the step, then None): the linear layers run over the whole
        sequence gathered through `shard`; full attention stays torch's ring attention."""
        self._sequence_shard = shard

    def _attention_masks(self, doc_ids: torch.Tensor | None, seq_len: int, device: torch.device) -> Any:
        documents = doc_ids if self.args.attn_mask_type == "block_causal" else None
        return HybridMasks(build_attention_mask(self.args, doc_ids, device), documents, self._sequence_shard)

    def _forward_at(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        documents = documents_from_positions(positions)
        use_flex = self.args.attn_backend == "flex" and flex_can_run(tokens.device)
        masks = HybridMasks(document_mask(self.args, documents, use_flex), documents)
        return self._blocks_forward(tokens, self.freqs_cis[positions], masks)

    def hidden_matrices(self) -> dict[str, int]:
        """The shared rule's matrices without the convolutions' taps (channels x taps: one small filter
        per channel, not a matrix Muon should orthogonalise)."""
        return {n: d for n, d in super().hidden_matrices().items() if not n.endswith("conv_weight")}

    def attention_tp_entries(self) -> dict[str, ParallelStyle]:
        return qwen3_5_attention_tp_entries()

    def tp_plan(
        self, *, sequence_parallel: bool = True, loss_parallel: bool = True
    ) -> dict[str, ParallelStyle]:
        """The shared decoder plan with both kinds of layer split by head (`qwen3_5.tensor_parallel_plan`);
        MoE flavors are refused: their gated shared expert has no split yet."""
        if self.args.moe_args is not None:
            raise ModelConfigError(
                "model: qwen3_5 MoE flavors have no tensor-parallel plan yet (the gated shared expert is not "
                "split); train them with tp=1 (expert parallelism splits their experts)"
            )
        plan = super().tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        plan["layers.*.attention"] = HeadShardedParameters(plan.get("layers.*.attention"))
        return plan
