"""Qwen3 (dense and mixture-of-experts): model, flavors, Hugging Face weights and config, sizes."""

from titan_models.moe.flops import moe_flops_per_token
from titan_models.qwen3.args import Qwen3Args, qwen3_moe_args
from titan_models.qwen3.flavors import QWEN3_FLAVORS, qwen3_args
from titan_models.qwen3.hf_adapter import Qwen3StateDictAdapter
from titan_models.qwen3.hf_config import args_from_hf_config, hf_config_differences, to_hf_config
from titan_models.qwen3.model import Qwen3Model

__all__ = [
    "QWEN3_FLAVORS",
    "Qwen3Args",
    "Qwen3Model",
    "Qwen3StateDictAdapter",
    "args_from_hf_config",
    "hf_config_differences",
    "moe_flops_per_token",
    "qwen3_args",
    "qwen3_moe_args",
    "to_hf_config",
]
