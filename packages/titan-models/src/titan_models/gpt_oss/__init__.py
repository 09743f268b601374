"""gpt-oss (OpenAI's gpt-oss-20b and -120b): model, flavors, rotary table and masks."""

from titan_models.gpt_oss.args import GptOssArgs, gpt_oss_moe_args
from titan_models.gpt_oss.attention import GptOssAttention, sink_attention_eager, sink_attention_flex
from titan_models.gpt_oss.flavors import GPT_OSS_FLAVORS, gpt_oss_args
from titan_models.gpt_oss.flops import gpt_oss_flops_per_token
from titan_models.gpt_oss.hf_adapter import GptOssStateDictAdapter
from titan_models.gpt_oss.hf_config import args_from_hf_config, hf_config_differences, to_hf_config
from titan_models.gpt_oss.masks import GptOssMasks, build_gpt_oss_masks
from titan_models.gpt_oss.model import GptOssModel, gpt_oss_block
from titan_models.gpt_oss.rope import gpt_oss_rotary_table, yarn_inverse_frequencies

__all__ = [
    "GPT_OSS_FLAVORS",
    "GptOssArgs",
    "GptOssAttention",
    "gpt_oss_block",
    "GptOssMasks",
    "GptOssModel",
    "GptOssStateDictAdapter",
    "args_from_hf_config",
    "build_gpt_oss_masks",
    "gpt_oss_args",
    "gpt_oss_flops_per_token",
    "gpt_oss_moe_args",
    "gpt_oss_rotary_table",
    "hf_config_differences",
    "sink_attention_eager",
    "sink_attention_flex",
    "to_hf_config",
    "yarn_inverse_frequencies",
]
