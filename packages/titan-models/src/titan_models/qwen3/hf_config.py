"""A Qwen3 shape as Hugging Face's `config.json` states it (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`):
written, read, and compared field by field, as `titan_models.hf_config` does for Llama."""

from __future__ import annotations

from typing import Any

from titan_models import hf_config_fields as shared
from titan_models.qwen3.args import Qwen3Args, qwen3_moe_args

# What Qwen3Config / Qwen3MoeConfig assume for a key their config.json leaves out.
_HF_DEFAULTS = shared.DECODER_HF_DEFAULTS | {
    "use_sliding_window": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
_MODEL_TYPES = ("qwen3", "qwen3_moe")


def to_hf_config(
    args: Qwen3Args, *, bos_id: int | None = None, eos_id: int | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The `config.json` of the equivalent Hugging Face model, as the published Qwen3 checkpoints write it."""
    moe = args.moe_args
    config = shared.decoder_hf_config(
        args,
        architecture="Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM",
        model_type="qwen3_moe" if moe else "qwen3",
    )
    config |= {"intermediate_size": args.hidden_dim, "use_sliding_window": False}
    if moe is not None:
        config |= {
            "moe_intermediate_size": args.moe_inter_dim,
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "norm_topk_prob": moe.route_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return shared.add_token_ids(config, args, bos_id, eos_id, dtype)


def _get(config: dict[str, Any], key: str) -> Any:
    return config.get(key, _HF_DEFAULTS.get(key))


def _unsupported(config: dict[str, Any]) -> list[str]:
    problems = shared.basic_problems(lambda key: _get(config, key), _MODEL_TYPES, "Qwen3")
    if _get(config, "use_sliding_window"):
        problems.append("use_sliding_window true (Titan's Qwen3 attends over the whole sequence)")
    _, scaling = shared.rope_from_config(config)
    if scaling is not None:
        problems.append(
            f"rope_scaling.rope_type '{scaling['rope_type']}' (Titan's Qwen3 has no rotary scaling)"
        )
    if config.get("model_type") == "qwen3_moe":
        if _get(config, "decoder_sparse_step") != 1:
            problems.append(
                f"decoder_sparse_step {config['decoder_sparse_step']} (every layer is MoE in Titan)"
            )
        if _get(config, "mlp_only_layers"):
            problems.append(f"mlp_only_layers {config['mlp_only_layers']} (every layer is MoE in Titan)")
    return problems + shared.missing_keys(config)


def args_from_hf_config(config: dict[str, Any], **overrides: Any) -> Qwen3Args:
    """The Qwen3Args of the model a Hugging Face `config.json` describes (refusing what Titan cannot compute)."""
    shared.refuse_unsupported(_unsupported(config))
    args = shared.decoder_args_from_config(config, lambda key: _get(config, key), max_seq_len_cap=4096)
    args |= dict(
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        hidden_dim=config.get("intermediate_size", 0),
    )
    if config["model_type"] == "qwen3_moe":
        experts = config.get("num_experts", config.get("num_local_experts"))
        args |= dict(
            moe_inter_dim=config["moe_intermediate_size"],
            moe_args=qwen3_moe_args(
                num_experts=experts,
                top_k=config["num_experts_per_tok"],
                route_norm=bool(_get(config, "norm_topk_prob")),
            ),
        )
    return Qwen3Args(**{**args, **overrides})


def _computed_fields(args: Qwen3Args) -> dict[str, Any]:
    """The config fields that change the function a model computes, named as config.json names them."""
    fields = {
        k: v
        for k, v in to_hf_config(args).items()
        if k not in ("architectures", "max_position_embeddings", "rope_scaling", "hidden_act")
        and k not in ("attention_bias", "use_sliding_window", "decoder_sparse_step", "mlp_only_layers")
        and k not in ("bos_token_id", "eos_token_id", "torch_dtype")
    }
    fields["qk_norm"] = args.qk_norm
    return fields


hf_config_differences = shared.differences_checker(
    unsupported=_unsupported, args_from_config=args_from_hf_config, computed_fields=_computed_fields
)
