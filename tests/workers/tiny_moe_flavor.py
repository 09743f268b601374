"""An `experimental.custom_import` module: registers `qwen3 tiny_moe` (2 layers of 8 experts, top 2, dim 64),
small enough for multi-process tests of the MoE wiring."""

from dataclasses import replace

from titan_models import qwen3
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
