"""Named model shapes (flavors), as published by Meta for Llama 2, 3, 3.1 and 3.2."""

from __future__ import annotations

from dataclasses import replace

from titan_models.args import ModelArgs, RopeScaling
from titan_models.errors import ModelConfigError

# Llama 3.1 (8B, 70B, 405B) and 3.2 (1B, 3B) stretch rotary frequencies for 128k context.
# torchtitan 0.2.x applies the 3.1 stretch to every llama3 flavor, its debug model included, and so
# does Titan: a debug run computes the same function in both.
LLAMA31_ROPE_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192
)
LLAMA32_ROPE_SCALING = replace(LLAMA31_ROPE_SCALING, factor=32.0)
LLAMA31_CONTEXT = 131_072  # the 128K tokens the rotary stretch is published for

# max_seq_len is only the default size of the rotary table: a run builds it for its own seq_len.
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000, max_seq_len=8192, context_len=LLAMA31_CONTEXT)
_LLAMA3_8B = ModelArgs(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim_multiplier=1.3,
    multiple_of=1024,
    rope_scaling=LLAMA31_ROPE_SCALING,
    **_LLAMA3,
)
_LLAMA3_DEBUG = ModelArgs(
    dim=256,
    n_layers=6,
    n_heads=16,
    vocab_size=2048,
    rope_theta=500000,
    rope_scaling=LLAMA31_ROPE_SCALING,
    context_len=LLAMA31_CONTEXT,
)
_FLEX_BLOCK_CAUSAL = dict(attn_backend="flex", attn_mask_type="block_causal")
_VARLEN_BLOCK_CAUSAL = dict(attn_backend="varlen", attn_mask_type="block_causal")

LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": _LLAMA3_DEBUG,
    "debugmodel_flex_attn": replace(_LLAMA3_DEBUG, **_FLEX_BLOCK_CAUSAL),
    "debugmodel_varlen_attn": replace(_LLAMA3_DEBUG, **_VARLEN_BLOCK_CAUSAL),
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_scaling=LLAMA32_ROPE_SCALING,
        tie_word_embeddings=True,
        **_LLAMA3,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_scaling=LLAMA32_ROPE_SCALING,
        tie_word_embeddings=True,
        **_LLAMA3,
    ),
    "8B": _LLAMA3_8B,
    "8B_flex": replace(_LLAMA3_8B, **_FLEX_BLOCK_CAUSAL),  # torchtitan 0.2's name
    "8B_flex_attn": replace(_LLAMA3_8B, **_FLEX_BLOCK_CAUSAL),  # torchtitan 0.1's name
    "8B_varlen": replace(_LLAMA3_8B, **_VARLEN_BLOCK_CAUSAL),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_scaling=LLAMA31_ROPE_SCALING,
        **_LLAMA3,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_scaling=LLAMA31_ROPE_SCALING,
        **_LLAMA3,
    ),
}

_LLAMA2 = dict(vocab_size=32000, rope_theta=10000, max_seq_len=4096, multiple_of=256)

LLAMA2_FLAVORS: dict[str, ModelArgs] = {
    # Not a published shape: a tiny Llama 2 for development runs with the bundled test tokenizer.
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=10000),
    "7B": ModelArgs(dim=4096, n_layers=32, n_heads=32, **_LLAMA2),
    "13B": ModelArgs(dim=5120, n_layers=40, n_heads=40, **_LLAMA2),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        **{**_LLAMA2, "multiple_of": 4096},
    ),
}


def _copy_of(family: str, flavors: dict[str, ModelArgs], flavor: str) -> ModelArgs:
    if flavor not in flavors:
        raise ModelConfigError(
            f"model: unknown {family} flavor '{flavor}'; choose one of {', '.join(flavors)}"
        )
    return replace(flavors[flavor])


def llama3_args(flavor: str) -> ModelArgs:
    """A fresh copy of a Llama 3 flavor's args (callers may change fields such as max_seq_len)."""
    return _copy_of("llama3", LLAMA3_FLAVORS, flavor)


def llama2_args(flavor: str) -> ModelArgs:
    """A fresh copy of a Llama 2 flavor's args."""
    return _copy_of("llama2", LLAMA2_FLAVORS, flavor)
