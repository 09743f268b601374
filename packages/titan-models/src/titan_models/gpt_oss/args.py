"""The shape of a gpt-oss model (OpenAI's gpt-oss-20b and -120b), with torchtitan 0.2.2's field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from titan_models.decoder_args import DecoderArgs
from titan_models.moe import MoEArgs


def gpt_oss_moe_args(num_experts: int) -> MoEArgs:
    """gpt-oss routing: a biased linear gate, softmax over all experts, the top 4 renormalised (the same
    weights as a softmax over the 4 chosen logits, as published), the experts' outputs weighted after
    them, no shared expert; the auxiliary-loss-free expert bias moves by 1e-3 per step, as torchtitan's
    gpt-oss trainer registers it."""
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        score_func="softmax",
        route_norm=True,
        route_scale=1.0,
        gate_bias=True,
        score_before_experts=False,
        top_k=4,
        load_balance_coeff=1e-3,
    )


@dataclass
class GptOssArgs(DecoderArgs):
    """Hyper-parameters of a gpt-oss decoder (shared fields: `titan_models.decoder_args.DecoderArgs`).

    Every block is attention then a mixture of experts. Attention has biases on q/k/v/o, grouped-query
    heads of width `head_dim` (64, not dim / n_heads), one learned sink logit per head, and on even
    layers (0, 2, ...) a causal window of `sliding_window_size` positions (a query sees itself and the
    127 before it). Rotary embeddings use YaRN (`rope_factor` over `original_seq_len`, NTK-by-parts
    band `ntk_alpha`..`ntk_beta`, attention scaled by (0.1 ln factor + 1)^2). Each expert is a SwiGLU
    with biases, gate and up interleaved in `mlp1`, clamped at `swiglu_limit`.

    `attn_backend`: "flex" runs flex attention (sinks through its log-sum-exp) where it can train (CUDA);
    "sdpa" runs an explicit softmax with the sink as an extra column (torch's SDPA has no sink term),
    the path used on CPU.
    """

    attention_backends: ClassVar[tuple[str, ...]] = ("sdpa", "flex")

    # gpt-oss-20b's shape where it differs from the shared defaults.
    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int | None = 8
    vocab_size: int = 201088
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    max_seq_len: int = 131072
    context_len: int | None = 131072
    # Flex attention as torchtitan's gpt-oss (its only kernel); where flex cannot train (CPU) the
    # explicit-softmax path runs instead (`gpt_oss.masks`).
    attn_backend: str = "flex"
    # gpt-oss's own fields (torchtitan 0.2.2's names).
    head_dim: int = 64
    moe_args: MoEArgs = field(default_factory=lambda: gpt_oss_moe_args(32))
    moe_inter_dim: int = 2880
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    sliding_window_size: int = 128
    original_seq_len: int = 4096
    rope_factor: float = 32.0
    ntk_alpha: float = 1.0
    ntk_beta: float = 32.0

    # No Llama-style rotary scaling: gpt-oss builds its own YaRN table (`gpt_oss.rope`).
    rope_scaling = None

    def family_checks(self) -> list[tuple[bool, str]]:
        return [
            (self.sliding_window_size >= 1, f"sliding_window_size ({self.sliding_window_size}) must be >= 1"),
            (self.rope_factor >= 1, f"rope_factor ({self.rope_factor}) must be >= 1 (1: no YaRN)"),
            (self.swiglu_limit > 0, f"swiglu_limit ({self.swiglu_limit}) must be positive"),
        ]

    @property
    def moe_enabled(self) -> bool:
        return True

    @property
    def ffn_hidden_dim(self) -> int:
        """The experts' width (what Titan's shared code reads as the feed-forward width)."""
        return self.moe_inter_dim

    @property
    def context_parallel_refusal(self) -> str | None:
        """Why context parallelism cannot split this attention, if it cannot (the trainer refuses cp > 1).

        Causal attention splits: each rank attends over the group's gathered keys and values with masks
        from global positions (`gpt_oss.masks`). Block-causal document ids come from each rank's own
        tokens, which do not know where earlier documents began, so they would be wrong."""
        if self.attn_mask_type == "block_causal":
            return (
                "cannot be split by context parallelism with attn_mask_type 'block_causal': document ids would be "
                "counted on each rank's slice of the sequence; set context_parallel_degree to 1 or use causal masks"
            )
        return None

    # Keys and values are gathered, never rotated (`titan_parallel.sequence_shard`).
    context_parallel_rotate_methods: ClassVar[tuple[str, ...]] = ("allgather",)

    def uses_sliding_window(self, layer: int) -> bool:
        """Even layers attend within the window, odd ones over the whole context (as published)."""
        return layer % 2 == 0
