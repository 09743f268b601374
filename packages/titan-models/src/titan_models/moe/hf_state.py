"""The expert-bias export policy of every family whose Hugging Face class has no place for it.

The load-balancing state is training state: the token counts (`moe.tokens_per_expert`) are never
exported, and the expert bias (`moe.expert_bias`, auxiliary-loss-free balancing) has no counterpart
in the Hugging Face classes of Llama 4, Qwen3-MoE and gpt-oss. Their adapters therefore leave both
out of an export and name the bias as state the format cannot hold (`hf_unheld_state`: titan_ckpt
keeps it under `titan.` keys and refuses or warns where it is not zero), and an import starts the
bias at zero. DeepSeek-V3's class holds the bias (`e_score_correction_bias`): its adapter maps it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from titan_models.moe.args import MoEArgs

EXPERT_BIAS = "moe.expert_bias"
TRAINING_STATE = (EXPERT_BIAS, "moe.tokens_per_expert")


def keeps_expert_bias(moe_args: MoEArgs | None) -> bool:
    """Whether a model built with `moe_args` has an expert bias (balancing on: `load_balance_coeff` set)."""
    return moe_args is not None and moe_args.load_balance_coeff is not None


def hf_unheld_state(moe_args: MoEArgs | None) -> tuple[str, ...]:
    """The state names (suffixes) an export cannot hold: the expert bias where the model keeps one."""
    return (EXPERT_BIAS,) if keeps_expert_bias(moe_args) else ()


def without_training_state(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """`state_dict` without the load-balancing state (`TRAINING_STATE`), for a class that holds none of it."""
    return {name: t for name, t in state_dict.items() if not name.endswith(TRAINING_STATE)}


def zero_expert_biases(moe_args: MoEArgs | None, blocks: Iterable[str]) -> dict[str, Tensor]:
    """A zero float32 expert bias for each MoE block prefix in `blocks` (`"layers.3."`), where the model
    keeps one ({} where not): an imported model starts balancing from scratch."""
    if not keeps_expert_bias(moe_args):
        return {}
    return {f"{b}{EXPERT_BIAS}": torch.zeros(moe_args.num_experts, dtype=torch.float32) for b in blocks}
