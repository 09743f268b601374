"""The shape of a Llama model, as one dataclass shared by every flavor."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelArgs:
    """Hyper-parameters of a Llama 2/3 transformer.

    `n_kv_heads=None` means plain multi-head attention; a smaller value gives grouped-query
    attention. The feed-forward width follows Llama's rule: 2/3 of 4*dim, scaled by
    `ffn_dim_multiplier`, rounded up to a multiple of `multiple_of`.
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
    max_seq_len: int = 2048
    # Scaled init of output projections by depth, as in Llama pretraining.
    depth_init: bool = True
    attn_backend: str = "sdpa"

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"model: dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"model: n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
