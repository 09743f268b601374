"""The shape of a Llama model, as one dataclass shared by every flavor."""

from __future__ import annotations

from dataclasses import dataclass

from titan_models.errors import ModelConfigError

ATTENTION_BACKENDS = ("sdpa", "flex", "flash", "varlen")
MASK_TYPES = ("causal", "block_causal")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's stretch of the rotary frequencies for long context.

    Wavelengths shorter than `original_max_seq_len / high_freq_factor` are kept, those longer than
    `original_max_seq_len / low_freq_factor` are divided by `factor`, and the band between is
    interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass
class ModelArgs:
    """Hyper-parameters of a Llama 2/3 transformer.

    `n_kv_heads=None` means plain multi-head attention; a smaller value gives grouped-query
    attention. The feed-forward width follows Llama's rule: 2/3 of 4*dim, scaled by
    `ffn_dim_multiplier`, rounded up to a multiple of `multiple_of`.

    `attn_mask_type="block_causal"` keeps packed documents apart: a token attends only to earlier
    tokens of its own document, documents being separated by `eos_id` (which the trainer takes
    from the tokenizer).
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Positions the rotary table is built for: a run sets it to its longest sequence.
    max_seq_len: int = 2048
    # The longest sequence the flavor is published for (Hugging Face's max_position_embeddings), which
    # a run's max_seq_len must not exceed; None: max_seq_len.
    context_len: int | None = None
    # The feed-forward width when it does not follow Llama's rule (a Hugging Face config's
    # intermediate_size); None: the rule below.
    ffn_hidden_dim_override: int | None = None
    # Llama 3.2 1B/3B share one matrix between the token embedding and the output projection.
    tie_word_embeddings: bool = False
    # Scaled init of output projections by depth, as in Llama pretraining.
    depth_init: bool = True
    attn_backend: str = "sdpa"
    attn_mask_type: str = "causal"
    eos_id: int | None = None

    def __post_init__(self) -> None:
        if self.context_len is None:
            self.context_len = self.max_seq_len
        if self.dim % self.n_heads:
            raise ModelConfigError(f"model: dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ModelConfigError(
                f"model: n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(
                f"model: head_dim = dim / n_heads = {self.head_dim} must be even for rotary embeddings"
            )
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
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_hidden_dim_override is not None:
            return self.ffn_hidden_dim_override
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
