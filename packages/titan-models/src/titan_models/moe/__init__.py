"""Mixture-of-experts feed-forward layers, their routing and load balancing, for any model family."""

from titan_models.moe.args import SCORE_FUNCS, MoEArgs, check_moe_args
from titan_models.moe.biased_experts import BiasedSwiGLUExperts, clamped_swiglu
from titan_models.moe.experts import GroupedExperts, experts_for_loop, experts_grouped_mm, grouped_mm_applies
from titan_models.moe.flops import moe_flops_per_token
from titan_models.moe.init import moe_init_std
from titan_models.moe.layer import MoE
from titan_models.moe.load_balance import (
    attach_aux_loss,
    expert_load,
    sequence_aux_loss,
    set_aux_loss_scale,
    update_expert_bias,
)
from titan_models.moe.params import count_active_parameters
from titan_models.moe.router import TokenChoiceRouter

__all__ = [
    "SCORE_FUNCS",
    "BiasedSwiGLUExperts",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "TokenChoiceRouter",
    "attach_aux_loss",
    "check_moe_args",
    "clamped_swiglu",
    "count_active_parameters",
    "expert_load",
    "experts_for_loop",
    "experts_grouped_mm",
    "grouped_mm_applies",
    "moe_flops_per_token",
    "moe_init_std",
    "sequence_aux_loss",
    "set_aux_loss_scale",
    "update_expert_bias",
]
