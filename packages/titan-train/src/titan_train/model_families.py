"""The families Titan ships (Llama 2 and 3, DeepSeek-V3, Qwen3, Llama 4, gpt-oss, Qwen3.5), registered under
torchtitan 0.2.2's model names (`--model.name deepseek_v3 --model.flavor debugmodel`): the one titan-train
module that names a family.

`titan_train.registry` registers `FAMILIES` through `register_model_family`, the function a user's own
family goes through, so the names exist wherever the registry does. For the mixture-of-experts families,
parameter counts are the model's total (memory and checkpoints hold every expert) and FLOPs per token count
only the parameters a token goes through (`titan_models.moe.count_active_parameters`), so throughput and
MFU are right for MoE.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

import titan_models
from titan_models import deepseek_v3, gpt_oss, llama4, qwen3, qwen3_5
from titan_models.moe import count_active_parameters
from titan_train.model_family import HFMapping, ModelFamily
from titan_train.vllm_serving import attention_gap, chunk_gap, linear_attention_gap, mla_gap


def _on_meta(build: Callable[[Any], nn.Module], args: Any) -> nn.Module:
    # eos_id only names the token that separates packed documents; DeepSeek refuses block_causal without it.
    with torch.device("meta"):
        return build(replace(args, eos_id=0) if args.eos_id is None else args)


def _active_flops(build: Callable[[Any], nn.Module]) -> Callable[[Any, int, int, int], float]:
    """FLOPs per token of Qwen3/Llama 4 from the active parameters of a meta-device model of `args`
    (the registry's total and embedding counts include every expert, which a token does not use).
    A partial of a module-level function, not a closure: a dry run sends the plan to worker processes."""
    return functools.partial(_moe_flops, build)


def _moe_flops(
    build: Callable[[Any], nn.Module], args: Any, total: int, embedding: int, seq_len: int
) -> float:
    return qwen3.moe_flops_per_token(args, _on_meta(build, args), seq_len)


def _deepseek_flops(args: Any, total: int, embedding: int, seq_len: int) -> float:
    model = _on_meta(deepseek_v3.DeepSeekV3Model, args)
    active = count_active_parameters(model)
    embedding_active = active - count_active_parameters(model, exclude_embedding=True)
    return deepseek_v3.deepseek_flops_per_token(args, active, embedding_active, seq_len)


def _gpt_oss_flops(args: Any, total: int, embedding: int, seq_len: int) -> float:
    model = _on_meta(gpt_oss.GptOssModel, args)
    active = count_active_parameters(model)
    embedding_active = active - count_active_parameters(model, exclude_embedding=True)
    return gpt_oss.gpt_oss_flops_per_token(args, active, embedding_active, seq_len)


def _qwen3_5_flops(args: Any, total: int, embedding: int, seq_len: int) -> float:
    return qwen3_5.qwen3_5_flops_per_token(args, _on_meta(qwen3_5.Qwen3_5Model, args), seq_len)


def _attention_vllm_gap(args: Any, device_type: str, dtype: str) -> str | None:
    return attention_gap(args.head_dim, device_type)


def _mla_vllm_gap(args: Any, device_type: str, dtype: str) -> str | None:
    return mla_gap(args.kv_lora_rank + args.qk_rope_head_dim, device_type)


def _llama4_vllm_gap(args: Any, device_type: str, dtype: str) -> str | None:
    return attention_gap(args.head_dim, device_type) or chunk_gap(args.attn_chunk_size, device_type)


def _qwen3_5_vllm_gap(args: Any, device_type: str, dtype: str) -> str | None:
    if device_type == "cpu" and dtype != "bfloat16":
        return (
            f"a {dtype} Gated DeltaNet on CPU (its CPU kernel runs bfloat16 only); set checkpoint.export_dtype = "
            "'bfloat16'"
        )
    return linear_attention_gap(
        args.linear_key_head_dim, args.linear_value_head_dim, device_type
    ) or attention_gap(args.head_dim, device_type)


def _hf(module: Any, adapter: Callable[..., Any]) -> HFMapping:
    return HFMapping(
        adapter=adapter,
        args_from_config=module.args_from_hf_config,
        config_differences=module.hf_config_differences,
    )


DEFAULT_FAMILY = "llama3"  # model.name's default, as torchtitan's

_LLAMA_HF = HFMapping(
    adapter=titan_models.LlamaStateDictAdapter,
    args_from_config=titan_models.args_from_hf_config,
    config_differences=titan_models.hf_config_differences,
)

FAMILIES = (
    ModelFamily(
        "llama3",
        titan_models.LLAMA3_FLAVORS,
        titan_models.Transformer,
        titan_models.flops_per_token,
        hf=_LLAMA_HF,
        vllm_gap=_attention_vllm_gap,
    ),
    ModelFamily(
        "llama2",
        titan_models.LLAMA2_FLAVORS,
        titan_models.Transformer,
        titan_models.flops_per_token,
        hf=_LLAMA_HF,
        vllm_gap=_attention_vllm_gap,
    ),
    ModelFamily(
        "deepseek_v3",
        deepseek_v3.DEEPSEEK_V3_FLAVORS,
        deepseek_v3.DeepSeekV3Model,
        _deepseek_flops,
        hf=_hf(deepseek_v3, deepseek_v3.DeepSeekV3StateDictAdapter),
        vllm_gap=_mla_vllm_gap,
    ),
    ModelFamily(
        "qwen3",
        qwen3.QWEN3_FLAVORS,
        qwen3.Qwen3Model,
        _active_flops(qwen3.Qwen3Model),
        hf=_hf(qwen3, qwen3.Qwen3StateDictAdapter),
        vllm_gap=_attention_vllm_gap,
    ),
    ModelFamily(
        "llama4",
        llama4.LLAMA4_FLAVORS,
        llama4.Llama4Model,
        _active_flops(llama4.Llama4Model),
        hf=_hf(llama4, llama4.Llama4StateDictAdapter),
        vllm_gap=_llama4_vllm_gap,
    ),
    # Hugging Face import/export arrives with the gpt-oss weight mapping (hf=None until then).
    ModelFamily(
        "gpt_oss",
        gpt_oss.GPT_OSS_FLAVORS,
        gpt_oss.GptOssModel,
        _gpt_oss_flops,
        hf=_hf(gpt_oss, gpt_oss.GptOssStateDictAdapter),
        vllm_gap=_attention_vllm_gap,
    ),
    # Dense and MoE flavors alike: Gated DeltaNet hybrids (titan_models.qwen3_5).
    ModelFamily(
        "qwen3_5",
        qwen3_5.QWEN3_5_FLAVORS,
        qwen3_5.Qwen3_5Model,
        _qwen3_5_flops,
        hf=_hf(qwen3_5, qwen3_5.Qwen3_5StateDictAdapter),
        vllm_gap=_qwen3_5_vllm_gap,
    ),
)
