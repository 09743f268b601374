"""A Llama 4 text shape as Hugging Face's `config.json` states it (`Llama4ForCausalLM`, model type
`llama4_text`, config class `Llama4TextConfig`): written, read, and compared field by field.

Meta's published Llama 4 checkpoints (Scout, Maverick) are multimodal (`llama4`,
`Llama4ForConditionalGeneration`): their text model's config is `text_config`, which is read instead.
"""

from __future__ import annotations

from typing import Any

from titan_models import hf_config_fields as shared
from titan_models.hf_config import llama3_scaling_from_hf, llama3_scaling_to_hf
from titan_models.llama4.args import Llama4Args, llama4_moe_args

# What Llama4TextConfig assumes for a key its config.json leaves out.
_HF_DEFAULTS: dict[str, Any] = shared.DECODER_HF_DEFAULTS | {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
}


def _get(config: dict[str, Any], key: str) -> Any:
    value = config.get(key)
    return _HF_DEFAULTS.get(key) if value is None and key != "attention_chunk_size" else value


def to_hf_config(
    args: Llama4Args, *, bos_id: int | None = None, eos_id: int | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The `config.json` of the equivalent `Llama4ForCausalLM` (text only)."""
    n = args.n_layers
    chunked = [args.attn_chunk_size is not None and args.uses_rope(i) for i in range(n)]
    config = shared.decoder_hf_config(args, architecture="Llama4ForCausalLM", model_type="llama4_text")
    config |= {
        "intermediate_size": args.moe_hidden_dim,
        "intermediate_size_mlp": args.ffn_hidden_dim,
        "rope_scaling": llama3_scaling_to_hf(args.rope_scaling),
        "num_local_experts": args.moe_args.num_experts,
        "num_experts_per_tok": args.moe_args.top_k,
        "interleave_moe_layer_step": args.interleave_moe_layer_step,
        "moe_layers": [i for i in range(n) if args.is_moe_layer(i)],
        "no_rope_layers": [int(args.uses_rope(i)) for i in range(n)],
        "layer_types": ["chunked_attention" if c else "full_attention" for c in chunked],
        # transformers builds the chunked mask even when no layer uses it, so a size is always written.
        "attention_chunk_size": args.attn_chunk_size or args.context_len,
        "use_qk_norm": args.use_qk_norm,
        "attn_temperature_tuning": args.attn_temperature_tuning,
        "floor_scale": args.floor_scale,
        "attn_scale": args.attn_scale,
    }
    return shared.add_token_ids(config, args, bos_id, eos_id, dtype)


def _layer_pattern(values: list[int], n_layers: int) -> int | None:
    """The n of "every n-th layer" (layers n-1, 2n-1, ...) that `values` marks, None if none; else -1."""
    marked = [i for i, v in enumerate(values) if v]
    if not marked:
        return None
    step = marked[0] + 1
    return step if marked == list(range(step - 1, n_layers, step)) else -1


def _layout(config: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """(problems, iRoPE and MoE fields) read from the per-layer lists of a config."""
    n = config.get("num_hidden_layers", 0)
    problems: list[str] = []
    interval = _get(config, "no_rope_layer_interval")
    rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    every_nope = _layer_pattern([1 - r for r in rope], n)
    if every_nope == -1 or len(rope) != n:
        problems.append(f"no_rope_layers {rope} (Titan skips rope on every n-th layer, n-1, 2n-1, ...)")
    types = config.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in rope]
    chunked = [t == "chunked_attention" for t in types]
    chunk = _get(config, "attention_chunk_size")
    if any(chunked) and chunked != [bool(r) for r in rope]:
        problems.append(f"layer_types {types} (Titan chunks exactly the rope layers, or none)")
    step = _get(config, "interleave_moe_layer_step")
    moe_layers = config.get("moe_layers")
    if moe_layers is not None and moe_layers != list(range(step - 1, n, step)):
        problems.append(
            f"moe_layers {moe_layers} (Titan puts MoE on every interleave_moe_layer_step-th layer)"
        )
    if any(chunked) and chunk is None:
        problems.append("layer_types has chunked_attention but attention_chunk_size is not set")
    max_pos = _get(config, "max_position_embeddings")
    fields = dict(
        every_n_layers_nope=every_nope if every_nope != -1 else None,
        attn_chunk_size=chunk if any(chunked) and chunk is not None and chunk < max_pos else None,
        interleave_moe_layer_step=step,
    )
    return problems, fields


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal `llama4` config.json (`text_config`, with the top level's
    `tie_word_embeddings` where it leaves that out); a `llama4_text` config as it is."""
    inner = config.get("text_config")
    if config.get("model_type") != "llama4" or not isinstance(inner, dict):
        return config
    outer = {k: config[k] for k in ("tie_word_embeddings",) if k in config}
    return {"model_type": "llama4_text", **outer, **inner}


def _unsupported(config: dict[str, Any]) -> list[str]:
    config = text_config(config)
    problems = shared.basic_problems(lambda key: _get(config, key), ("llama4_text",), "Llama 4")
    _, scaling = shared.rope_from_config(config)
    if scaling is not None and scaling["rope_type"] != "llama3":
        problems.append(f"rope_scaling.rope_type '{scaling['rope_type']}' (Titan implements 'llama3' only)")
    missing = shared.missing_keys(config)
    problems += missing
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if heads and hidden and config.get("head_dim") not in (None, hidden // heads):
        problems.append(f"head_dim {config['head_dim']} (Titan's is hidden_size / num_attention_heads)")
    return problems + (_layout(config)[0] if not missing else [])


def args_from_hf_config(config: dict[str, Any], **overrides: Any) -> Llama4Args:
    """The Llama4Args of the model a `llama4_text` `config.json` describes (refusing what Titan cannot compute).

    A multimodal `llama4` config is read through its `text_config`.
    """
    shared.refuse_unsupported(_unsupported(config))
    config = text_config(config)
    _, scaling = shared.rope_from_config(config)
    args = shared.decoder_args_from_config(config, lambda key: _get(config, key), max_seq_len_cap=8192)
    args |= dict(
        rope_scaling=llama3_scaling_from_hf(scaling),
        use_qk_norm=bool(_get(config, "use_qk_norm")),
        attn_temperature_tuning=bool(_get(config, "attn_temperature_tuning")),
        floor_scale=int(_get(config, "floor_scale")),
        attn_scale=float(_get(config, "attn_scale")),
        moe_args=llama4_moe_args(_get(config, "num_local_experts"), _get(config, "num_experts_per_tok")),
        dense_hidden_dim_override=_get(config, "intermediate_size_mlp"),
        moe_hidden_dim_override=_get(config, "intermediate_size"),
        **_layout(config)[1],
    )
    return Llama4Args(**{**args, **overrides})


def _computed_fields(args: Llama4Args) -> dict[str, Any]:
    """The config fields that change the function a model computes, named as config.json names them."""
    skip = {
        "architectures",
        "max_position_embeddings",
        "hidden_act",
        "attention_bias",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",
        "attention_chunk_size",
    }
    fields = {k: v for k, v in to_hf_config(args).items() if k not in skip}
    fields["attention_chunk_size"] = args.attn_chunk_size
    if not args.attn_temperature_tuning or args.every_n_layers_nope is None:
        for key in ("attn_temperature_tuning", "floor_scale", "attn_scale"):
            fields.pop(key)
    return fields


hf_config_differences = shared.differences_checker(
    unsupported=_unsupported, args_from_config=args_from_hf_config, computed_fields=_computed_fields
)
