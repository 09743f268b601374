"""Named Qwen3.5 shapes: debug flavors for the bundled test tokenizer, and published sizes.

The published shapes are those of the Hugging Face configs (the `text_config` of each Qwen/Qwen3.5-* folder,
as restated by public tools; copies in titan-models' tests/published_configs): 248,320 tokens, head_dim 256
with a quarter of it rotated (rope theta 10,000,000), RMSNorm epsilon 1e-6, a full-attention layer every
4th, linear layers of 16 query/key heads of 128; context 262,144. The small ones tie their embeddings.
"""

from __future__ import annotations

from dataclasses import replace

from titan_models.errors import ModelConfigError
from titan_models.qwen3_5.args import Qwen3_5Args, qwen3_5_moe_args

_PUBLISHED = dict(
    vocab_size=248320, head_dim=256, rope_theta=10_000_000, max_seq_len=4096, context_len=262144
)
_DEBUG = dict(
    dim=256,
    n_layers=8,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=2048,
    head_dim=64,
    hidden_dim=768,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    rope_theta=10_000_000,
    max_seq_len=4096,
)

QWEN3_5_FLAVORS: dict[str, Qwen3_5Args] = {
    "debugmodel": Qwen3_5Args(**_DEBUG),
    # Packed documents kept apart in both kinds of layer (block-causal attention, restarting state).
    "debugmodel_flex_attn": Qwen3_5Args(**_DEBUG, attn_backend="flex", attn_mask_type="block_causal"),
    "debugmodel_moe": Qwen3_5Args(
        **_DEBUG, moe_inter_dim=128, shared_hidden_dim=128, moe_args=qwen3_5_moe_args(8, 2)
    ),
    "0.8B": Qwen3_5Args(
        dim=1024,
        n_layers=24,
        n_heads=8,
        n_kv_heads=2,
        hidden_dim=3584,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
        **_PUBLISHED,
    ),
    "4B": Qwen3_5Args(
        dim=2560,
        n_layers=32,
        n_heads=16,
        n_kv_heads=4,
        hidden_dim=9216,
        linear_num_value_heads=32,
        tie_word_embeddings=True,
        **_PUBLISHED,
    ),
    "9B": Qwen3_5Args(
        dim=4096,
        n_layers=32,
        n_heads=16,
        n_kv_heads=4,
        hidden_dim=12288,
        linear_num_value_heads=32,
        **_PUBLISHED,
    ),
    "27B": Qwen3_5Args(
        dim=5120,
        n_layers=64,
        n_heads=24,
        n_kv_heads=4,
        hidden_dim=17408,
        linear_num_value_heads=48,
        **_PUBLISHED,
    ),
    "35B-A3B": Qwen3_5Args(
        dim=2048,
        n_layers=40,
        n_heads=16,
        n_kv_heads=2,
        hidden_dim=0,
        linear_num_value_heads=32,
        moe_inter_dim=512,
        shared_hidden_dim=512,
        moe_args=qwen3_5_moe_args(256, 8),
        **_PUBLISHED,
    ),
    "397B-A17B": Qwen3_5Args(
        dim=4096,
        n_layers=60,
        n_heads=32,
        n_kv_heads=2,
        hidden_dim=0,
        linear_num_value_heads=64,
        moe_inter_dim=1024,
        shared_hidden_dim=1024,
        moe_args=qwen3_5_moe_args(512, 10),
        **_PUBLISHED,
    ),
}


def qwen3_5_args(flavor: str) -> Qwen3_5Args:
    """A fresh copy of a Qwen3.5 flavor's args (callers may change fields such as max_seq_len)."""
    if flavor not in QWEN3_5_FLAVORS:
        raise ModelConfigError(
            f"model: unknown qwen3_5 flavor '{flavor}'; choose one of {', '.join(QWEN3_5_FLAVORS)}"
        )
    return replace(QWEN3_5_FLAVORS[flavor])
