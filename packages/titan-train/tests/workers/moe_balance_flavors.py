"""Registers the tiny MoE flavors of the balancing tests on import (the tests and their torchrun worker
import it alike): `deepseek_v3 tiny_balance`, both layers MoE with a shared expert, top 2 of 4, the
expert bias on and the sequence-wise aux loss at 0 (the runs set it with `model.moe_seq_aux_loss_coeff`);
`llama4 tiny_published`, Meta's attention (temperature tuning) at test size."""

from dataclasses import replace

from titan_models import deepseek_v3, llama4
from titan_models.moe import MoEArgs
from titan_train.registry import register_flavor

TINY_BALANCE = replace(
    deepseek_v3.DEEPSEEK_V3_FLAVORS["debugmodel"],
    dim=64,
    n_layers=2,
    n_dense_layers=0,
    n_heads=4,
    inter_dim=128,
    moe_inter_dim=64,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_args=MoEArgs(num_experts=4, num_shared_experts=1, top_k=2, score_before_experts=False),
)
TINY_PUBLISHED = replace(llama4.LLAMA4_FLAVORS["debugmodel_published"], dim=64, n_layers=2, n_heads=4)

register_flavor("deepseek_v3", "tiny_balance", TINY_BALANCE)
register_flavor("llama4", "tiny_published", TINY_PUBLISHED)
