"""What every family's Hugging Face `config.json` handling shares: reading rope settings, refusing what
Titan cannot compute, stamping token ids, and diffing two configs field by field.

Loading weights checks shapes only, so a checkpoint whose rope theta, norm epsilon, routing or tied
embeddings differ from the model it is loaded into would load and train a different function without
a word. Each family says which fields change its function (`computed_fields`); the comparison, the
error wording and the rope parsing are the same for all, so they live here once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from titan_models.errors import ModelConfigError

# The keys without which no family's config describes a model.
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
DEFAULT_ROPE_THETA = 10000.0
# What every family's transformers config class assumes for these keys when config.json leaves them out.
DECODER_HF_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
}
_DTYPE_NAMES = {"float32", "bfloat16", "float16"}


def decoder_hf_config(args: Any, *, architecture: str, model_type: str) -> dict[str, Any]:
    """The `config.json` fields a grouped-query-attention family (Llama, Qwen3, Llama 4) writes alike.

    `max_position_embeddings` is the flavor's context (`context_len`), not the length a run trained at.
    """
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.context_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": args.tie_word_embeddings,
    }


def decoder_args_from_config(
    config: dict[str, Any], get: Callable[[str], Any], *, max_seq_len_cap: int
) -> dict[str, Any]:
    """The args fields every grouped-query-attention family reads alike from a config, `get(key)` reading
    it with the family's defaults. A run's `max_seq_len` starts at the context, at most `max_seq_len_cap`."""
    context = int(get("max_position_embeddings"))
    return dict(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads"),
        vocab_size=config["vocab_size"],
        norm_eps=float(get("rms_norm_eps")),
        rope_theta=rope_from_config(config)[0],
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        max_seq_len=min(context, max_seq_len_cap),
        context_len=context,
    )


def basic_problems(get: Callable[[str], Any], model_types: tuple[str, ...], family: str) -> list[str]:
    """The refusals every family shares: another model type, an activation other than SiLU, attention
    biases. `get(key)` reads the config with the family's defaults."""
    problems = []
    if get("model_type") not in model_types:
        problems.append(f"model_type '{get('model_type')}' (expected {' or '.join(map(repr, model_types))})")
    if get("hidden_act") != "silu":
        problems.append(f"hidden_act '{get('hidden_act')}' (only 'silu')")
    if get("attention_bias"):
        problems.append(f"attention_bias true (Titan's {family} has no biases)")
    return problems


def rope_from_config(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, rope scaling with its `rope_type`, or None when plain), from transformers 4's
    `rope_theta`/`rope_scaling` or 5's `rope_parameters`."""
    params = config.get("rope_parameters") or {}
    theta = float(config.get("rope_theta", params.get("rope_theta", DEFAULT_ROPE_THETA)))
    scaling = config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return theta, (None if kind == "default" else {**scaling, "rope_type": kind})


def missing_keys(config: dict[str, Any], keys: tuple[str, ...] = REQUIRED_KEYS) -> list[str]:
    """A problem line naming the required keys `config` lacks; empty when it has them all."""
    missing = [k for k in keys if k not in config]
    return [f"no {', '.join(missing)}"] if missing else []


def refuse_unsupported(problems: list[str]) -> None:
    """Raise one `ModelConfigError` listing every problem, when there is any."""
    if problems:
        raise ModelConfigError(
            f"model: the Hugging Face config cannot be trained by Titan: {'; '.join(problems)}"
        )


def add_token_ids(
    config: dict[str, Any], args: Any, bos_id: int | None, eos_id: int | None, dtype: str | None
) -> dict[str, Any]:
    """`config` with `bos_token_id`, `eos_token_id` (default: the args' `eos_id`) and `torch_dtype` set."""
    eos_id = args.eos_id if eos_id is None else eos_id
    if dtype is not None and dtype not in _DTYPE_NAMES:
        raise ModelConfigError(f"model: dtype '{dtype}' is not one of {sorted(_DTYPE_NAMES)}")
    for key, value in (("bos_token_id", bos_id), ("eos_token_id", eos_id), ("torch_dtype", dtype)):
        if value is not None:
            config[key] = value
    return config


def same_value(a: Any, b: Any) -> bool:
    """Equal, floats within a relative 1e-9 (a value read back from JSON may differ in the last bit)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def hf_config_differences(
    args: Any,
    config: dict[str, Any],
    *,
    unsupported: Callable[[dict[str, Any]], list[str]],
    args_from_config: Callable[[dict[str, Any]], Any],
    computed_fields: Callable[[Any], dict[str, Any]],
) -> list[str]:
    """Every field in which `config` (a Hugging Face `config.json`) describes another function than
    `args`, as 'field: checkpoint X, flavor Y'; unsupported settings are listed instead when there
    are any. Empty when they agree.

    A `rope_scaling.*` parameter is not compared once `rope_scaling` itself differs.
    """
    differences = unsupported(config)
    if differences:
        return differences
    theirs, ours = computed_fields(args_from_config(config)), computed_fields(args)
    scaling_differs = theirs.get("rope_scaling") != ours.get("rope_scaling")
    for key in dict.fromkeys([*ours, *theirs]):
        if key.startswith("rope_scaling.") and scaling_differs:
            continue
        if not same_value(theirs.get(key), ours.get(key)):
            differences.append(f"{key}: checkpoint {theirs.get(key)}, flavor {ours.get(key)}")
    return differences


def differences_checker(
    *,
    unsupported: Callable[[dict[str, Any]], list[str]],
    args_from_config: Callable[[dict[str, Any]], Any],
    computed_fields: Callable[[Any], dict[str, Any]],
) -> Callable[[Any, dict[str, Any]], list[str]]:
    """A family's `hf_config_differences(args, config)`, from how it reads a config and which of its
    fields change the computed function. A partial of module-level functions, not a closure, so that a
    run plan holding it pickles (the dry run traces pipeline ranks in child processes)."""
    return functools.partial(
        hf_config_differences,
        unsupported=unsupported,
        args_from_config=args_from_config,
        computed_fields=computed_fields,
    )
