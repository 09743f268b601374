"""The shape of a Qwen3.5 text model (dense or mixture-of-experts), as one dataclass shared by every flavor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titan_models.decoder_args import DecoderArgs
from titan_models.moe import MoEArgs

LAYER_TYPES = ("linear_attention", "full_attention")


def qwen3_5_moe_args(num_experts: int, top_k: int) -> MoEArgs:
    """Qwen3.5-MoE routing: softmax over every expert, the top k renormalised, scores applied to the experts'
    outputs; the shared expert is the family's own (`shared_hidden_dim`, with its sigmoid gate), so none
    here; no expert bias (the published checkpoints hold none)."""
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        top_k=top_k,
        score_func="softmax",
        route_norm=True,
        score_before_experts=False,
        load_balance_coeff=None,
        update_bias=False,
    )


@dataclass
class Qwen3_5Args(DecoderArgs):
    """Hyper-parameters of a Qwen3.5 decoder (shared fields: `titan_models.decoder_args.DecoderArgs`).

    Layer i is Gated DeltaNet linear attention unless `(i + 1) % full_attention_interval == 0`, where it
    is gated full attention (Qwen3.5's `layer_types` rule); `layer_types` states the list outright when a
    checkpoint does. Full attention rotates the first `partial_rotary_factor * head_dim` dimensions of each
    head. The linear layers have `linear_num_key_heads` query/key heads of `linear_key_head_dim`, each shared
    by `linear_num_value_heads / linear_num_key_heads` value heads of `linear_value_head_dim`, and a causal
    depthwise convolution of `linear_conv_kernel_dim` taps. With `moe_args` every feed-forward is routed
    experts of width `moe_inter_dim` plus one sigmoid-gated shared expert of width `shared_hidden_dim`.
    """

    # Qwen3.5-27B's attention shape where it differs from the shared defaults.
    n_heads: int = 24
    n_kv_heads: int | None = 4
    vocab_size: int = 248320
    norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    max_seq_len: int = 4096
    head_dim: int = 256
    hidden_dim: int = 17408
    partial_rotary_factor: float = 0.25
    full_attention_interval: int = 4
    layer_types: tuple[str, ...] | None = None
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 48
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    moe_args: MoEArgs | None = None
    moe_inter_dim: int = 512
    shared_hidden_dim: int = 512

    # Qwen3.5 has no rotary scaling; the field lets Titan's shared rotary table read these args.
    rope_scaling = None

    @property
    def block_types(self) -> tuple[str, ...]:
        """Each block's token mixer: `layer_types` when stated, else the every-`full_attention_interval` rule."""
        if self.layer_types is not None:
            return tuple(self.layer_types)
        interval = self.full_attention_interval
        return tuple(
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(self.n_layers)
        )

    def family_checks(self) -> list[tuple[bool, str]]:
        unknown = sorted(set(self.block_types) - set(LAYER_TYPES))
        return [
            (
                self.full_attention_interval >= 1,
                f"full_attention_interval ({self.full_attention_interval}) must be >= 1",
            ),
            (
                len(self.block_types) == self.n_layers,
                f"layer_types has {len(self.block_types)} entries but n_layers is {self.n_layers}",
            ),
            (not unknown, f"layer_types {unknown} are unknown; choose among {', '.join(LAYER_TYPES)}"),
            (
                self.linear_num_value_heads % self.linear_num_key_heads == 0,
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})",
            ),
            (
                self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
                f"partial_rotary_factor ({self.partial_rotary_factor}) must rotate an even number of the "
                f"head's {self.head_dim} dimensions",
            ),
        ]

    # Under context parallelism the linear layers gather the whole sequence (`set_sequence_shard`).
    context_parallel_rotate_methods: ClassVar[tuple[str, ...]] = ("allgather",)

    @property
    def context_parallel_refusal(self) -> str | None:
        """Packed documents under context parallelism: the linear layers would need every rank's
        document ids, which the sharded step does not gather."""
        if self.attn_mask_type == "block_causal":
            return (
                "packs documents (block_causal), whose boundaries the linear layers cannot see across "
                "context-parallel ranks yet; set context_parallel_degree to 1 or use a causal flavor"
            )
        return None

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each full-attention head rotate."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_enabled(self) -> bool:
        return self.moe_args is not None

    @property
    def ffn_hidden_dim(self) -> int:
        """The dense feed-forward width (what Titan's shared code reads)."""
        return self.hidden_dim

    def is_linear(self, layer: int) -> bool:
        """Whether block `layer` is Gated DeltaNet linear attention (else gated full attention)."""
        return self.block_types[layer] == "linear_attention"
