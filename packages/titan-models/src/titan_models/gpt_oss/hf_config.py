"""A gpt-oss shape as Hugging Face's `config.json` states it (`GptOssForCausalLM`): written as OpenAI's
published gpt-oss-20b/-120b folders write it, read, and compared field by field.

What Titan's gpt-oss computes and a config could state otherwise, refused in one line: attention without
biases, another sliding-window pattern than the published one (sliding on even layers, full on odd),
rotary scaling other than YaRN with its published attention factor, YaRN's `truncate` (Titan keeps the
ramp's band edges unrounded, as published).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from titan_models import hf_config_fields as shared
from titan_models.gpt_oss.args import GptOssArgs, gpt_oss_moe_args

# What GptOssConfig assumes for a key the config.json leaves out.
_HF_DEFAULTS = shared.DECODER_HF_DEFAULTS | {
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "swiglu_alpha": 1.702,
    "num_experts_per_tok": 4,
    "head_dim": 64,
    "rope_theta": 150000.0,
}
_MODEL_TYPES = ("gpt_oss",)


def layer_types(n_layers: int) -> list[str]:
    """The published attention pattern: sliding on even layers (0, 2, ...), full on odd ones."""
    return ["sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(n_layers)]


def _yarn(args: GptOssArgs) -> dict[str, Any] | None:
    if args.rope_factor <= 1.0:
        return None
    return {
        "rope_type": "yarn",
        "factor": float(args.rope_factor),
        "beta_fast": float(args.ntk_beta),
        "beta_slow": float(args.ntk_alpha),
        "original_max_position_embeddings": args.original_seq_len,
        "truncate": False,
    }


def to_hf_config(
    args: GptOssArgs, *, bos_id: int | None = None, eos_id: int | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The `config.json` of the equivalent Hugging Face model, with the published keys (`rope_scaling`)."""
    moe = args.moe_args
    config = shared.decoder_hf_config(args, architecture="GptOssForCausalLM", model_type="gpt_oss")
    config |= {
        "attention_bias": True,
        "intermediate_size": args.moe_inter_dim,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "sliding_window": args.sliding_window_size,
        "layer_types": layer_types(args.n_layers),
        "swiglu_limit": float(args.swiglu_limit),
        "swiglu_alpha": float(args.swiglu_alpha),
        "rope_scaling": _yarn(args),
    }
    return shared.add_token_ids(config, args, bos_id, eos_id, dtype)


def _get(config: dict[str, Any], key: str) -> Any:
    value = config.get(key)
    if value is None and key == "rope_theta":
        value = (config.get("rope_parameters") or {}).get("rope_theta")
    return _HF_DEFAULTS.get(key) if value is None else value


def _unsupported(config: dict[str, Any]) -> list[str]:
    problems = []
    if _get(config, "model_type") not in _MODEL_TYPES:
        problems.append(f"model_type '{_get(config, 'model_type')}' (expected 'gpt_oss')")
    if not _get(config, "attention_bias"):
        problems.append("attention_bias false (Titan's gpt-oss has biases on q, k, v and o)")
    n_layers = config.get("num_hidden_layers", 0)
    types = config.get("layer_types")
    if types is not None and list(types) != layer_types(n_layers):
        problems.append(
            f"layer_types {types} (Titan's gpt-oss slides on even layers and attends fully on odd ones, as published)"
        )
    _, scaling = shared.rope_from_config(config)
    if scaling is not None:
        if scaling["rope_type"] != "yarn":
            problems.append(
                f"rope_scaling.rope_type '{scaling['rope_type']}' (Titan's gpt-oss implements 'yarn')"
            )
        elif scaling.get("truncate", True) is not False:
            problems.append("rope_scaling.truncate true (Titan's YaRN ramp keeps its band edges unrounded)")
        factor = float(scaling.get("factor", 1.0))
        published = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        theirs = scaling.get("attention_factor")
        if theirs is not None and not math.isclose(float(theirs), published, rel_tol=1e-9):
            problems.append(
                f"rope_scaling.attention_factor {theirs} (Titan's is 0.1 ln(factor) + 1 = {published:.6g})"
            )
    return problems + shared.missing_keys(config)


def args_from_hf_config(config: dict[str, Any], **overrides: Any) -> GptOssArgs:
    """The GptOssArgs of the model a Hugging Face `config.json` describes (refusing what Titan cannot compute)."""
    shared.refuse_unsupported(_unsupported(config))
    args = shared.decoder_args_from_config(config, lambda key: _get(config, key), max_seq_len_cap=4096)
    args["rope_theta"] = float(_get(config, "rope_theta"))
    _, scaling = shared.rope_from_config(config)
    experts = config.get("num_local_experts", config.get("num_experts"))
    moe = replace(gpt_oss_moe_args(experts), top_k=int(_get(config, "num_experts_per_tok")))
    args |= dict(
        head_dim=int(_get(config, "head_dim")),
        moe_inter_dim=config["intermediate_size"],
        moe_args=moe,
        sliding_window_size=int(_get(config, "sliding_window")),
        swiglu_limit=float(_get(config, "swiglu_limit")),
        swiglu_alpha=float(_get(config, "swiglu_alpha")),
    )
    if scaling is None:
        args |= dict(rope_factor=1.0)
    else:
        args |= dict(
            rope_factor=float(scaling["factor"]),
            ntk_beta=float(scaling.get("beta_fast", 32.0)),
            ntk_alpha=float(scaling.get("beta_slow", 1.0)),
            original_seq_len=int(scaling.get("original_max_position_embeddings", 4096)),
        )
    return GptOssArgs(**{**args, **overrides})


def _computed_fields(args: GptOssArgs) -> dict[str, Any]:
    """The config fields that change the function a model computes, named as config.json names them."""
    fields = {
        k: v
        for k, v in to_hf_config(args).items()
        if k
        not in ("architectures", "max_position_embeddings", "rope_scaling", "hidden_act", "attention_bias")
        and k not in ("bos_token_id", "eos_token_id", "torch_dtype")
    }
    for key, value in (_yarn(args) or {"rope_type": "default"}).items():
        fields[f"rope_scaling.{key}"] = value
    fields["rope_scaling"] = (_yarn(args) or {}).get("rope_type", "default")
    return fields


hf_config_differences = shared.differences_checker(
    unsupported=_unsupported, args_from_config=args_from_hf_config, computed_fields=_computed_fields
)
