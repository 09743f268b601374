"""Named model shapes (flavors), as published."""

from __future__ import annotations

from dataclasses import replace

from titan_models.args import ModelArgs

LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
    ),
}


def llama3_args(flavor: str) -> ModelArgs:
    """A fresh copy of a Llama 3 flavor's args (callers may change fields such as max_seq_len)."""
    if flavor not in LLAMA3_FLAVORS:
        raise KeyError(f"model: unknown llama3 flavor '{flavor}'; choose one of {sorted(LLAMA3_FLAVORS)}")
    return replace(LLAMA3_FLAVORS[flavor])
