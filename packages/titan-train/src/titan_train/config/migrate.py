"""Carry configs written for older torchtitan schemas (0.0.x, 0.1.x) over to the current one.

Each old key is rewritten to its current name (inverting booleans whose meaning flipped) with one
warning per key, so a user's existing TOML keeps working and they learn the new spelling. Keys with
no current equivalent are dropped with a warning that says what replaced them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from titan_train.config.converters import FLOAT8, MX, OLD_NAMES

logger = logging.getLogger("titan_train.config")


@dataclass(frozen=True)
class _Rename:
    new: str
    convert: Callable[[Any], Any] | None = None
    note: str = ""


@dataclass(frozen=True)
class _Removed:
    hint: str


@dataclass(frozen=True)
class _Converter:
    """An old on/off switch that is now an entry of `model.converters`."""

    name: str


def _invert(value: Any) -> Any:
    return not value if isinstance(value, bool) else value


def _implementation(fused: Any) -> str:
    return "fused" if fused else "foreach"


_FLOAT8, _MX = FLOAT8, MX

MIGRATIONS: dict[str, _Rename | _Removed | _Converter] = {
    # [job]
    "job.print_args": _Rename("job.print_config"),
    "job.use_for_integration_test": _Removed("it only tagged torchtitan's own CI configs"),
    # [metrics]
    "metrics.enable_color_printing": _Rename("metrics.disable_color_printing", _invert, "inverted"),
    "metrics.rank_0_only": _Rename("metrics.save_for_all_ranks", _invert, "inverted"),
    # [model]
    "model.tokenizer_path": _Rename("model.hf_assets_path"),
    "model.norm_type": _Removed("every shipped family uses RMSNorm"),
    # [optimizer]
    "optimizer.fused": _Rename("optimizer.implementation", _implementation, "true: fused, false: foreach"),
    # [lr_scheduler]
    "lr_scheduler.lr_min": _Rename("lr_scheduler.min_lr_factor"),
    # [training]: batch size, schedule and parallel degrees lived here in 0.0.x
    "training.batch_size": _Rename("training.local_batch_size"),
    "training.warmup_steps": _Rename("lr_scheduler.warmup_steps"),
    "training.data_parallel_degree": _Rename("parallelism.data_parallel_shard_degree"),
    "training.data_parallel_replicate_degree": _Rename("parallelism.data_parallel_replicate_degree"),
    "training.data_parallel_shard_degree": _Rename("parallelism.data_parallel_shard_degree"),
    "training.tensor_parallel_degree": _Rename("parallelism.tensor_parallel_degree"),
    "training.pipeline_parallel_degree": _Rename("parallelism.pipeline_parallel_degree"),
    "training.context_parallel_degree": _Rename("parallelism.context_parallel_degree"),
    "training.enable_loss_parallel": _Rename("parallelism.disable_loss_parallel", _invert, "inverted"),
    "training.disable_loss_parallel": _Rename("parallelism.disable_loss_parallel"),
    "training.fsdp_reshard_after_forward": _Rename("parallelism.fsdp_reshard_after_forward"),
    "training.compile": _Rename("compile.enable"),
    "training.seed": _Rename("debug.seed"),
    "training.deterministic": _Rename("debug.deterministic"),
    "training.enable_fp8_linear": _Converter(_FLOAT8),
    "training.enable_float8_linear": _Converter(_FLOAT8),
    # [experimental]: pipeline and context parallelism started here
    "experimental.pipeline_parallel_degree": _Rename("parallelism.pipeline_parallel_degree"),
    "experimental.pipeline_parallel_schedule": _Rename("parallelism.pipeline_parallel_schedule"),
    "experimental.pipeline_parallel_schedule_csv": _Rename("parallelism.pipeline_parallel_schedule_csv"),
    "experimental.pipeline_parallel_split_points": _Removed("use parallelism.module_fqns_per_model_part"),
    "experimental.pipeline_parallel_microbatches": _Removed(
        "use parallelism.pipeline_parallel_microbatch_size = local_batch_size / micro-batches"
    ),
    "experimental.context_parallel_degree": _Rename("parallelism.context_parallel_degree"),
    "experimental.context_parallel_rotate_method": _Rename("parallelism.context_parallel_rotate_method"),
    "experimental.enable_async_tensor_parallel": _Rename("parallelism.enable_async_tensor_parallel"),
    "experimental.enable_compiled_autograd": _Removed("compiled autograd is no longer a config option"),
    "experimental.custom_model_path": _Rename("experimental.custom_import"),
    "experimental.custom_args_module": _Rename("job.custom_config_module"),
    # [parallelism] keys of 0.1.x that 0.2.x replaced
    "parallelism.pipeline_parallel_split_points": _Removed("use parallelism.module_fqns_per_model_part"),
    "parallelism.pipeline_parallel_microbatches": _Removed(
        "use parallelism.pipeline_parallel_microbatch_size = local_batch_size / micro-batches"
    ),
    "parallelism.enable_compiled_autograd": _Removed("compiled autograd is no longer a config option"),
    # [checkpoint]
    "checkpoint.enable_checkpoint": _Rename("checkpoint.enable"),
    "checkpoint.model_weights_only": _Rename("checkpoint.last_save_model_only"),
    "checkpoint.last_save_model_weights_only": _Rename("checkpoint.last_save_model_only"),
    "checkpoint.initial_load_model_weights_only": _Rename("checkpoint.initial_load_model_only"),
    "checkpoint.interval_type": _Removed("checkpoint.interval counts steps"),
    # [float8] and [mx] became [quantize.linear.*], switched on through model.converters
    "float8.enable_float8_linear": _Converter(_FLOAT8),
    "float8.enable_fsdp_float8_all_gather": _Rename(f"{_FLOAT8}.enable_fsdp_float8_all_gather"),
    "float8.precompute_float8_dynamic_scale_for_fsdp": _Rename(
        f"{_FLOAT8}.precompute_float8_dynamic_scale_for_fsdp"
    ),
    "float8.recipe_name": _Rename(f"{_FLOAT8}.recipe_name"),
    "float8.filter_fqns": _Rename(f"{_FLOAT8}.filter_fqns"),
    "float8.emulate": _Rename(f"{_FLOAT8}.emulate"),
    "float8.moe_fqns_prototype": _Rename("quantize.grouped_mm.float8.fqns"),
    "float8.force_recompute_fp8_weight_in_bwd": _Removed("torchao decides weight recomputation itself"),
    "float8.scaling_type_input": _Removed("delayed scaling is gone; use quantize.linear.float8.recipe_name"),
    "float8.scaling_type_weight": _Removed("delayed scaling is gone; use quantize.linear.float8.recipe_name"),
    "float8.scaling_type_grad_output": _Removed(
        "delayed scaling is gone; use quantize.linear.float8.recipe_name"
    ),
    "mx.enable_mxfp8": _Converter(_MX),
    "mx.mxfp8_dim1_cast_kernel_choice": _Rename(f"{_MX}.mxfp8_dim1_cast_kernel_choice"),
    "mx.recipe_name": _Rename(f"{_MX}.recipe_name"),
    "mx.filter_fqns": _Rename(f"{_MX}.filter_fqns"),
    "mx.moe_fqns_prototype": _Rename("quantize.grouped_mm.mx.fqns"),
    "mx.use_fp8_dim1_cast_triton_kernel": _Removed("use quantize.linear.mx.mxfp8_dim1_cast_kernel_choice"),
    # on/off switches renamed to `enable`
    "memory_estimation.enabled": _Rename("memory_estimation.enable"),
    "validation.enabled": _Rename("validation.enable"),
}

# Old short names of model converters.
CONVERTER_NAMES = OLD_NAMES


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists and scalars are leaves."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for dotted, value in flat.items():
        *path, leaf = dotted.split(".")
        target = table
        for part in path:
            target = target.setdefault(part, {})
        target[leaf] = value
    return table


def migrate_flat(flat: dict[str, Any], source: str) -> dict[str, Any]:
    """Rewrite old dotted keys of `flat` to current ones; one warning per rewritten or dropped key."""
    out = {k: v for k, v in flat.items() if k not in MIGRATIONS}
    for old, value in flat.items():
        rule = MIGRATIONS.get(old)
        if rule is None:
            continue
        if isinstance(rule, _Removed):
            logger.warning("config (%s): %s was removed and is ignored; %s", source, old, rule.hint)
            continue
        if isinstance(rule, _Converter):
            converters = list(out.get("model.converters", []))
            if value and rule.name not in converters:
                converters.append(rule.name)
            out["model.converters"] = converters
            logger.warning(
                "config (%s): %s is now an entry of model.converters; using model.converters = %s",
                source,
                old,
                converters,
            )
            continue
        new_value = rule.convert(value) if rule.convert else value
        if rule.new in flat:
            logger.warning(
                "config (%s): %s is renamed %s, which is also set; the old key is ignored",
                source,
                old,
                rule.new,
            )
            continue
        out[rule.new] = new_value
        note = f" ({rule.note})" if rule.note else ""
        logger.warning(
            "config (%s): %s is renamed %s%s; read as %s = %r",
            source,
            old,
            rule.new,
            note,
            rule.new,
            new_value,
        )
    return out


def migrate_toml(table: dict[str, Any], source: str) -> dict[str, Any]:
    """A parsed TOML table with old keys moved to their current places."""
    flat = flatten(table)
    if not any(key in MIGRATIONS for key in flat):
        return table
    return unflatten(migrate_flat(flat, source))


def migrate_argv(argv: list[str], is_flag: Callable[[str], bool]) -> list[str]:
    """CLI arguments with old `--section.key [value]` flags rewritten to current ones.

    `is_flag(token)` tells whether a token starts a new option, so a bare old boolean flag
    (`--training.compile`) reads as true.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if name not in MIGRATIONS:
            out.append(token)
            i += 1
            continue
        if eq:
            value: Any = inline
        elif i + 1 < len(argv) and not is_flag(argv[i + 1]):
            value = argv[i + 1]
            i += 1
        else:
            value = True
        i += 1
        rule = MIGRATIONS[name]
        if isinstance(rule, _Converter) or (isinstance(rule, _Rename) and rule.convert is not None):
            value = _parse_bool(value)
        for new, new_value in migrate_flat({name: value}, "command line").items():
            out += [f"--{new}", _to_cli(new_value)]
    return out


def migrate_converter_names(converters: list[str]) -> list[str]:
    """`model.converters` with old short names (`float8`, `mx`) replaced by current ones."""
    renamed = []
    for name in converters:
        if name in CONVERTER_NAMES:
            logger.warning("config: model.converters entry '%s' is renamed '%s'", name, CONVERTER_NAMES[name])
        renamed.append(CONVERTER_NAMES.get(name, name))
    return renamed


def _parse_bool(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        return value.lower() in ("true", "1", "yes", "on")
    return value


def _to_cli(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)
