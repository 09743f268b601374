"""The shape of a Qwen3 model (dense or mixture-of-experts), as one dataclass shared by every flavor."""

from __future__ import annotations

from dataclasses import dataclass

from titan_models.args import ATTENTION_BACKENDS, MASK_TYPES
from titan_models.errors import ModelConfigError
from titan_models.moe import MoEArgs


def qwen3_moe_args(num_experts: int, top_k: int, route_norm: bool = True) -> MoEArgs:
    """Qwen3-MoE routing: softmax over all experts, the top k renormalised (`norm_topk_prob`), scores
    applied to the experts' outputs, no shared expert."""
    return MoEArgs(
        num_experts=num_experts, num_shared_experts=0, top_k=top_k, score_func="softmax",
        route_norm=route_norm, route_scale=1.0, score_before_experts=False,
    )  # fmt: skip


@dataclass
class Qwen3Args:
    """Hyper-parameters of a Qwen3 decoder.

    Unlike Llama, `head_dim` is its own field (Qwen3 0.6B has 16 heads of 128 over a width of 1024),
    queries and keys are RMS-normalised per head before the rotation (`qk_norm`), and the
    feed-forward width is given directly (`hidden_dim`). With `moe_args` set every block's
    feed-forward is a mixture of `moe_args.num_experts` experts of width `moe_inter_dim`.

    The field names Titan's trainer reads (`dim`, `n_layers`, `n_heads`, `kv_heads`, `head_dim`,
    `vocab_size`, `max_seq_len`, `context_len`, `eos_id`, `tie_word_embeddings`, `attn_backend`,
    `attn_mask_type`) mean what they mean for `titan_models.ModelArgs`.
    """

    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int | None = 8
    vocab_size: int = 151936
    head_dim: int = 128
    hidden_dim: int = 3072
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True
    # Positions the rotary table is built for: a run sets it to its longest sequence.
    max_seq_len: int = 4096
    # The longest sequence the flavor is published for (Hugging Face's max_position_embeddings).
    context_len: int | None = None
    tie_word_embeddings: bool = False
    depth_init: bool = True
    attn_backend: str = "sdpa"
    attn_mask_type: str = "causal"
    eos_id: int | None = None
    # Mixture of experts (see qwen3_moe_args), or None for a dense model.
    moe_args: MoEArgs | None = None
    moe_inter_dim: int = 768

    # Qwen3 has no rotary scaling; the field lets Titan's shared rotary table read these args.
    rope_scaling = None

    def __post_init__(self) -> None:
        if self.context_len is None:
            self.context_len = self.max_seq_len
        if self.n_heads % self.kv_heads:
            raise ModelConfigError(
                f"model: n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"model: head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ModelConfigError(
                f"model: attn_backend '{self.attn_backend}' is unknown; choose one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.attn_mask_type not in MASK_TYPES:
            raise ModelConfigError(
                f"model: attn_mask_type '{self.attn_mask_type}' is unknown; choose one of {', '.join(MASK_TYPES)}"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def moe_enabled(self) -> bool:
        return self.moe_args is not None

    @property
    def ffn_hidden_dim(self) -> int:
        """The dense feed-forward width (what Titan's shared blocks read)."""
        return self.hidden_dim
