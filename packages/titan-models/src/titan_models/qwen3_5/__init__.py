"""Qwen3.5 (dense and mixture-of-experts, the text model): Gated DeltaNet hybrids; model, flavors, Hugging
Face weights and config."""

from titan_models.qwen3_5.args import Qwen3_5Args, qwen3_5_moe_args
from titan_models.qwen3_5.flavors import QWEN3_5_FLAVORS, qwen3_5_args
from titan_models.qwen3_5.flops import qwen3_5_flops_per_token
from titan_models.qwen3_5.hf_adapter import Qwen3_5StateDictAdapter
from titan_models.qwen3_5.hf_config import args_from_hf_config, hf_config_differences, to_hf_config
from titan_models.qwen3_5.model import HybridMasks, Qwen3_5Model

__all__ = [
    "QWEN3_5_FLAVORS",
    "HybridMasks",
    "Qwen3_5Args",
    "Qwen3_5Model",
    "Qwen3_5StateDictAdapter",
    "args_from_hf_config",
    "hf_config_differences",
    "qwen3_5_args",
    "qwen3_5_flops_per_token",
    "qwen3_5_moe_args",
    "to_hf_config",
]
