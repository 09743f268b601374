"""DeepSeek-V2/V3: multi-head latent attention, YaRN, dense then MoE blocks; flavors, FLOPs and HF mapping."""

from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.deepseek_v3.flavors import DEEPSEEK_V3_FLAVORS, deepseek_v3_args
from titan_models.deepseek_v3.flops import deepseek_flops_per_token
from titan_models.deepseek_v3.hf_adapter import DeepSeekV3StateDictAdapter
from titan_models.deepseek_v3.hf_config import args_from_hf_config, hf_config_differences, to_hf_config
from titan_models.deepseek_v3.model import DeepSeekV3Model, deepseek_v3_block
from titan_models.deepseek_v3.tensor_parallel_plan import mla_tp_entries

__all__ = [
    "DEEPSEEK_V3_FLAVORS",
    "DeepSeekV3Args",
    "deepseek_v3_block",
    "DeepSeekV3Model",
    "DeepSeekV3StateDictAdapter",
    "args_from_hf_config",
    "deepseek_flops_per_token",
    "deepseek_v3_args",
    "hf_config_differences",
    "mla_tp_entries",
    "to_hf_config",
]
