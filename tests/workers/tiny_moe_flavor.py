"""An `experimental.custom_import` module: registers `qwen3 tiny_moe` (2 layers of 8 experts, top 2, dim 64)
and `gpt_oss tiny` (the same cut of gpt-oss), and `deepseek_v3 tiny_shared` (the same with a shared expert),
small enough for multi-process tests of the MoE wiring."""

from dataclasses import replace

from titan_models import deepseek_v3, gpt_oss, qwen3
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

# DeepSeek-V3's layer with shared experts: 2 MoE layers of 8 routed experts (top 2) and one shared expert,
# multi-head latent attention cut to dim 64; its expert bias moves as torchtitan's deepseek_v3 trainer moves it.
# Tokens are weighted before the experts (Llama 4's routing, torchtitan's MoEArgs default), the routing under
# which tensor parallelism splits the shared experts.
register_flavor(
    "deepseek_v3",
    "tiny_shared",
    replace(
        deepseek_v3.DEEPSEEK_V3_FLAVORS["debugmodel"],
        dim=64,
        inter_dim=128,
        moe_inter_dim=32,
        n_layers=2,
        n_dense_layers=0,
        n_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        moe_args=replace(
            deepseek_v3.DEEPSEEK_V3_FLAVORS["debugmodel"].moe_args,
            num_experts=8,
            num_shared_experts=1,
            top_k=2,
            score_before_experts=True,
        ),
    ),
)
