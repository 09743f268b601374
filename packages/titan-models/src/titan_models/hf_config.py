"""A Llama shape as Hugging Face's `config.json` states it: written, read, and compared field by field.

Loading weights checks shapes only, so a checkpoint whose rotary scaling, rope theta, norm epsilon or
tied embeddings differ from the model it is loaded into would load and train a different function
without a word. Comparing every field that changes the computed function catches that before a step
(the comparison itself: `titan_models.hf_config_fields`, shared by every family).
"""

from __future__ import annotations

from typing import Any

from titan_models import hf_config_fields as shared
from titan_models.args import ModelArgs, RopeScaling

# What `LlamaConfig` assumes for a key its config.json leaves out.
_HF_DEFAULTS = shared.DECODER_HF_DEFAULTS | {
    "model_type": "llama",
    "mlp_bias": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}
LLAMA3_SCALING_KEYS = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_seq_len",
}


def llama3_scaling_to_hf(scaling: RopeScaling | None) -> dict[str, Any] | None:
    """The `rope_scaling` entry of a config.json for Llama 3.1's rotary stretch (None: no scaling)."""
    if scaling is None:
        return None
    return {"rope_type": "llama3"} | {
        theirs: getattr(scaling, ours) for theirs, ours in LLAMA3_SCALING_KEYS.items()
    }


def llama3_scaling_from_hf(scaling: dict[str, Any] | None) -> RopeScaling | None:
    """Llama 3.1's rotary stretch from a config's `rope_scaling` (None: no scaling)."""
    if scaling is None:
        return None
    return RopeScaling(**{ours: scaling[theirs] for theirs, ours in LLAMA3_SCALING_KEYS.items()})


def to_hf_config(
    args: ModelArgs, *, bos_id: int | None = None, eos_id: int | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The `config.json` of the equivalent `LlamaForCausalLM`, in the published Llama checkpoints' format.

    `max_position_embeddings` is the flavor's context (`context_len`), not the length a run trained at.
    """
    config = shared.decoder_hf_config(args, architecture="LlamaForCausalLM", model_type="llama")
    config |= {"intermediate_size": args.ffn_hidden_dim, "mlp_bias": False}
    config["rope_scaling"] = llama3_scaling_to_hf(args.rope_scaling)
    return shared.add_token_ids(config, args, bos_id, eos_id, dtype)


def _unsupported(config: dict[str, Any]) -> list[str]:
    get = lambda key: config.get(key, _HF_DEFAULTS.get(key))  # noqa: E731
    problems = shared.basic_problems(get, ("llama",), "Llama")
    if get("mlp_bias"):
        problems.append("mlp_bias true (Titan's Llama has no biases)")
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if heads and hidden and config.get("head_dim") not in (None, hidden // heads):
        problems.append(f"head_dim {config['head_dim']} (Titan's is hidden_size / num_attention_heads)")
    _, scaling = shared.rope_from_config(config)
    if scaling is not None and scaling["rope_type"] != "llama3":
        problems.append(f"rope_scaling.rope_type '{scaling['rope_type']}' (Titan implements 'llama3' only)")
    return problems


def args_from_hf_config(config: dict[str, Any], **overrides: Any) -> ModelArgs:
    """The ModelArgs of the model a Hugging Face `config.json` describes (refusing what Titan cannot compute)."""
    shared.refuse_unsupported(_unsupported(config) + shared.missing_keys(config))
    get = lambda key: config.get(key, _HF_DEFAULTS.get(key))  # noqa: E731
    args = shared.decoder_args_from_config(config, get, max_seq_len_cap=2048)
    args |= dict(
        rope_scaling=llama3_scaling_from_hf(shared.rope_from_config(config)[1]),
        ffn_hidden_dim_override=config.get("intermediate_size"),
    )
    return ModelArgs(**{**args, **overrides})


def _computed_fields(args: ModelArgs) -> dict[str, Any]:
    """The fields of a config that change the function a model computes, named as config.json names them."""
    fields: dict[str, Any] = {
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "tie_word_embeddings": args.tie_word_embeddings,
        "rope_scaling": None if args.rope_scaling is None else "llama3",
    }
    if args.rope_scaling is not None:
        for theirs, ours in LLAMA3_SCALING_KEYS.items():
            fields[f"rope_scaling.{theirs}"] = getattr(args.rope_scaling, ours)
    return fields


hf_config_differences = shared.differences_checker(
    unsupported=_unsupported, args_from_config=args_from_hf_config, computed_fields=_computed_fields
)
