"""Named gpt-oss shapes under torchtitan 0.2.2's flavor names: `debugmodel`, `20b`, `120b`.

20b and 120b are OpenAI's published models (config.json of openai/gpt-oss-20b and -120b): width 2880,
64 query heads and 8 key/value heads of 64, 201,088 tokens, experts of width 2880 routed top-4,
24 layers of 32 experts and 36 layers of 128 experts. The debug flavor is torchtitan's exactly (its
checkpoints' shapes): width 256, 4 layers of 8 experts, every other field the 20b's (201,088 tokens,
64 heads of 64, experts of width 2880).
"""

from __future__ import annotations

from dataclasses import replace

from titan_models.errors import ModelConfigError
from titan_models.gpt_oss.args import GptOssArgs, gpt_oss_moe_args

GPT_OSS_FLAVORS: dict[str, GptOssArgs] = {
    "debugmodel": GptOssArgs(dim=256, n_layers=4, moe_args=gpt_oss_moe_args(8)),
    "20b": GptOssArgs(n_layers=24, moe_args=gpt_oss_moe_args(32)),
    "120b": GptOssArgs(n_layers=36, moe_args=gpt_oss_moe_args(128)),
}


def gpt_oss_args(flavor: str) -> GptOssArgs:
    """A fresh copy of a gpt-oss flavor's args (callers may change fields such as max_seq_len)."""
    if flavor not in GPT_OSS_FLAVORS:
        raise ModelConfigError(
            f"model: unknown gpt_oss flavor '{flavor}'; choose one of {', '.join(GPT_OSS_FLAVORS)}"
        )
    return replace(GPT_OSS_FLAVORS[flavor])
