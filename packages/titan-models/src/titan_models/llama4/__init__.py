"""Llama 4 (text): model with interleaved MoE and iRoPE attention, flavors, Hugging Face weights and config."""

from titan_models.llama4.args import Llama4Args, llama4_moe_args
from titan_models.llama4.flavors import LLAMA4_FLAVORS, llama4_args
from titan_models.llama4.hf_adapter import Llama4StateDictAdapter
from titan_models.llama4.hf_config import args_from_hf_config, hf_config_differences, to_hf_config
from titan_models.llama4.model import Llama4Model
from titan_models.moe.flops import moe_flops_per_token

__all__ = [
    "LLAMA4_FLAVORS",
    "Llama4Args",
    "Llama4Model",
    "Llama4StateDictAdapter",
    "args_from_hf_config",
    "hf_config_differences",
    "llama4_args",
    "llama4_moe_args",
    "moe_flops_per_token",
    "to_hf_config",
]
