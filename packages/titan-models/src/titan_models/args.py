"""The shape of a Llama model, as one dataclass shared by every flavor."""

from __future__ import annotations

from dataclasses import dataclass

from titan_models.decoder_args import ATTENTION_BACKENDS, MASK_TYPES, DecoderArgs

__all__ = ["ATTENTION_BACKENDS", "MASK_TYPES", "ModelArgs", "RopeScaling", "llama_ffn_width"]


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
class ModelArgs(DecoderArgs):
    """Hyper-parameters of a Llama 2/3 transformer (shared fields: `titan_models.decoder_args.DecoderArgs`).

    The feed-forward width follows Llama's rule: 2/3 of 4*dim, scaled by `ffn_dim_multiplier`,
    rounded up to a multiple of `multiple_of`.
    """

    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_scaling: RopeScaling | None = None
    # The feed-forward width when it does not follow Llama's rule (a Hugging Face config's
    # intermediate_size); None: the rule below.
    ffn_hidden_dim_override: int | None = None

    def family_checks(self) -> list[tuple[bool, str]]:
        return [
            (self.dim % self.n_heads == 0, f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        ]

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_hidden_dim_override is not None:
            return self.ffn_hidden_dim_override
        return llama_ffn_width(self.dim, self.ffn_dim_multiplier, self.multiple_of)


def llama_ffn_width(dim: int, multiplier: float | None, multiple_of: int, divide_by: int = 1) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim, times `multiplier`, divided by `divide_by` (Llama 4's
    experts), rounded up to `multiple_of`."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    if divide_by != 1:
        hidden = int(hidden / divide_by)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
