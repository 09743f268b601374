"""An `experimental.custom_import` module: registers `qwen3 tiny_moe` (2 layers of 8 experts, top 2, dim 64)
and `gpt_oss tiny` (the same cut of gpt-oss), small enough for multi-process tests of the MoE wiring."""

from dataclasses import replace

from titan_models import gpt_oss, qwen3
from titan_train.registry import register_flavor

register_flavor(
    "qwen3",
    "tiny_moe",
    replace(
        qwen3.QWEN3_FLAVORS["debugmodel_moe"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        moe_inter_dim=64,
        moe_args=qwen3.qwen3_moe_args(8, 2),
    ),
)

# gpt-oss cut alike (2 layers of 8 experts of width 32, top 4, 4 heads of 16 over 2 key/value heads), its
# window shrunk to 16 positions so that at seq 64 the windowed layer attends to less than the whole sequence.
register_flavor(
    "gpt_oss",
    "tiny",
    replace(
        gpt_oss.GPT_OSS_FLAVORS["debugmodel"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=2048,
        moe_inter_dim=32,
        sliding_window_size=16,
        moe_args=gpt_oss.gpt_oss_moe_args(8),
    ),
)
