"""A Qwen3.5 shape as Hugging Face's `config.json` states it: written as `Qwen3_5ForCausalLM` /
`Qwen3_5MoeForCausalLM` write it, read from those or from a published image-text folder
(`Qwen3_5ForConditionalGeneration`), whose `text_config` holds the text model beside a vision tower that
Titan does not build (skipped, and said so)."""

from __future__ import annotations

import logging
from typing import Any

from titan_models import hf_config_fields as shared
from titan_models.qwen3_5.args import Qwen3_5Args, qwen3_5_moe_args

logger = logging.getLogger(__name__)

_HF_DEFAULTS = shared.DECODER_HF_DEFAULTS | {
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
_TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
_IMAGE_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_LINEAR_KEYS = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


def to_hf_config(
    args: Qwen3_5Args, *, bos_id: int | None = None, eos_id: int | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The `config.json` of the equivalent text-only Hugging Face model."""
    moe = args.moe_args
    config = shared.decoder_hf_config(
        args,
        architecture="Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM",
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
    )
    del config["rope_theta"], config["rope_scaling"]
    config |= {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(args.rope_theta),
            "partial_rotary_factor": args.partial_rotary_factor,
        },
        "layer_types": list(args.block_types),
        "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_num_key_heads": args.linear_num_key_heads,
        "linear_num_value_heads": args.linear_num_value_heads,
    }
    if moe is None:
        config["intermediate_size"] = args.hidden_dim
    else:
        config |= {
            "moe_intermediate_size": args.moe_inter_dim,
            "shared_expert_intermediate_size": args.shared_hidden_dim,
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
        }
    return shared.add_token_ids(config, args, bos_id, eos_id, dtype)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: `config` itself, or the `text_config` of an image-text folder, whose
    vision tower (`vision_config`) is skipped."""
    if config.get("model_type") not in _IMAGE_TEXT_TYPES:
        return config
    logger.info(
        "qwen3_5: %s holds a vision tower (vision_config); Titan builds the text model only and skips it",
        config.get("architectures", [config["model_type"]])[0],
    )
    text = {"model_type": _IMAGE_TEXT_TYPES[config["model_type"]], **config.get("text_config", {})}
    if "tie_word_embeddings" in config:
        text.setdefault("tie_word_embeddings", config["tie_word_embeddings"])
    return text


def _get(config: dict[str, Any], key: str) -> Any:
    return config.get(key, _HF_DEFAULTS.get(key))


def _rope(config: dict[str, Any]) -> tuple[float, float]:
    params = config.get("rope_parameters") or {}
    factor = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.25))
    return shared.rope_from_config(config)[0], float(factor)


def _unsupported(config: dict[str, Any]) -> list[str]:
    config = text_config(config)
    problems = shared.basic_problems(lambda key: _get(config, key), _TEXT_TYPES, "Qwen3.5")
    _, scaling = shared.rope_from_config(config)
    if scaling is not None:
        problems.append(
            f"rope_parameters.rope_type '{scaling['rope_type']}' (Titan's Qwen3.5 has no rotary scaling)"
        )
    if config.get("mlp_only_layers"):
        problems.append(
            f"mlp_only_layers {config['mlp_only_layers']} (every layer is MoE in Titan's Qwen3.5-MoE)"
        )
    return problems + shared.missing_keys(config)


def args_from_hf_config(config: dict[str, Any], **overrides: Any) -> Qwen3_5Args:
    """The Qwen3_5Args of the text model a Hugging Face `config.json` describes (refusing what Titan
    cannot compute)."""
    shared.refuse_unsupported(_unsupported(config))
    config = text_config(config)
    args = shared.decoder_args_from_config(config, lambda key: _get(config, key), max_seq_len_cap=4096)
    theta, factor = _rope(config)
    args |= dict(
        rope_theta=theta,
        partial_rotary_factor=factor,
        head_dim=_get(config, "head_dim"),
        hidden_dim=config.get("intermediate_size", 0),
        **{key: _get(config, key) for key in _LINEAR_KEYS},
    )
    args["full_attention_interval"] = config.get("full_attention_interval", 4)
    stated = tuple(config.get("layer_types") or ())
    # A list that follows the interval rule is kept as the rule, so the args equal the flavor's.
    if stated and stated != Qwen3_5Args(**args).block_types:
        args["layer_types"] = stated
    if config["model_type"] == "qwen3_5_moe_text":
        args |= dict(
            moe_inter_dim=config["moe_intermediate_size"],
            shared_hidden_dim=config["shared_expert_intermediate_size"],
            moe_args=qwen3_5_moe_args(config["num_experts"], config["num_experts_per_tok"]),
        )
    return Qwen3_5Args(**{**args, **overrides})


def _computed_fields(args: Qwen3_5Args) -> dict[str, Any]:
    """The config fields that change the function a model computes, named as config.json names them."""
    config = to_hf_config(args)
    fields = {
        k: v
        for k, v in config.items()
        if k
        not in ("architectures", "max_position_embeddings", "hidden_act", "attention_bias", "rope_parameters")
        and k not in ("bos_token_id", "eos_token_id", "torch_dtype")
    }
    fields |= {"rope_theta": float(args.rope_theta), "partial_rotary_factor": args.partial_rotary_factor}
    return fields


hf_config_differences = shared.differences_checker(
    unsupported=_unsupported, args_from_config=args_from_hf_config, computed_fields=_computed_fields
)
