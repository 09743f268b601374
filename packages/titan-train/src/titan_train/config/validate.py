"""The start-up check of a whole JobConfig: every field's accepted values, then the rules across fields.

Each field declares what it accepts next to its default (`opt` in `fields.py`): choices, a range with
its documented sentinels, a pattern, a path that must exist. `validate_config` enforces all of them,
then the rules that tie fields together, before any work: a bad value stops the run with one line
naming `section.field` (exit status 2, see `titan_train.cli`). Checks that need the world size or the
built model (degrees against WORLD_SIZE, heads against tp, checkpoints in the folder) run where those
are known, still before the first step.
"""

from __future__ import annotations

import logging
import math
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titan_data import DATASETS
from titan_train.config.data_rules import data_choices_fit
from titan_train.config.fault_tolerance_section import check_fault_tolerance
from titan_train.config.fields import BOUNDS, get_value, iter_fields, number, unwrap_optional
from titan_train.config.grpo_section import check_grpo, is_prompts
from titan_train.config.health_section import check_health
from titan_train.config.model_rules import MODEL_RULES
from titan_train.config.muon_section import check_muon
from titan_train.config.preference_section import check_preference
from titan_train.config.sft_section import renders_chat_template
from titan_train.errors import ConfigError
from titan_train.registry import FROM_HF, get_model_family, model_family_names

logger = logging.getLogger(__name__)


def validate_config(config: Any, cls: type | None = None, *, check_paths: bool = True) -> None:
    """Raise ConfigError for the first field, then the first combination of fields, that a run cannot use.

    With `check_paths`, the files and folders the run reads must exist; never in a dry run
    (`comm.mode = fake_backend`), which checks a layout for another machine.
    """
    check_paths = check_paths and config.comm.mode != "fake_backend"
    for dotted, tp, f in iter_fields(cls or type(config)):
        _check_field(config, dotted, tp, f.metadata, check_paths)
    for rule in COMBINATIONS:
        rule(config)


def _check_field(config: Any, dotted: str, tp: Any, rule: Any, check_paths: bool) -> None:
    value = get_value(config, dotted)
    inner, optional = unwrap_optional(tp)
    if value is None:
        if not optional:
            raise ConfigError(f"config: {dotted} expects {_type_name(inner)}, got None")
        return
    _check_type(dotted, value, inner)
    for item in _leaves(value):
        _check_value(dotted, item, rule, in_list=isinstance(value, list))
    if rule.get("check"):
        rule["check"](value)
    needed = rule.get("needed_if") is None or get_value(config, rule["needed_if"])
    local = not _names_a_hub_dataset(config, dotted, value)
    if rule.get("path") and value != "" and check_paths and needed and local and not Path(value).exists():
        raise ConfigError(f"config: {dotted} = {value} does not exist; point the config at {rule['path']}")


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
CHAT_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def _names_a_hub_dataset(config: Any, dotted: str, value: Any) -> bool:
    """Whether a chat, preference or prompts section's dataset_path is a Hugging Face dataset id (`owner/name`,
    fetched by the datasets library at start) rather than a local path, which must exist."""
    section, _, name = dotted.partition(".")
    rows = getattr(config, section) if name == "dataset_path" else None
    if rows is None or not (renders_chat_template(rows) or is_prompts(rows)):
        return False
    text = str(value)
    return bool(HUB_ID.fullmatch(text)) and not text.endswith(CHAT_FILE_SUFFIXES) and not Path(text).exists()


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def _check_type(dotted: str, value: Any, tp: Any) -> None:
    if typing.get_origin(tp) is list:
        (item_type,) = typing.get_args(tp) or (str,)
        if not isinstance(value, list):
            raise ConfigError(f"config: {dotted} expects a list, got {value!r}")
        for item in value:
            _check_type(dotted, item, item_type)
        return
    expected = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}.get(tp)
    if expected is None:
        return  # a custom section's own type: its module checks it
    if not isinstance(value, expected) or (tp is not bool and isinstance(value, bool)):
        raise ConfigError(f"config: {dotted} expects {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _check_value(dotted: str, value: Any, rule: Any, *, in_list: bool) -> None:
    if value in rule.get("sentinels", ()) and not isinstance(value, bool):
        return
    shown = f"{dotted} has {value!r}, which" if in_list else f"{dotted} = {value!r}"
    choices = rule.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"config: {shown} is not one of {', '.join(map(repr, choices))}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config: {dotted} must be a finite number, got {value}")
    for key, words, outside in BOUNDS:
        bound = rule.get(key)
        if isinstance(value, (int, float)) and bound is not None and outside(value, bound):
            sentinels = rule.get("sentinels")
            special = f" (or {' or '.join(map(repr, sentinels))})" if sentinels else ""
            raise ConfigError(f"config: {dotted} must be {words} {number(bound)}{special}, got {value!r}")
    if isinstance(value, str):
        if rule.get("nonempty") and not value:
            raise ConfigError(f"config: {dotted} cannot be empty")
        if rule.get("pattern") and not re.fullmatch(rule["pattern"][0], value):
            raise ConfigError(f"config: {shown} is not {rule['pattern'][1]}")


# Rules across fields. Each takes the config and raises ConfigError naming the fields and the fix.


def _profiler_window_fits(config: Any) -> None:
    p = config.profiling
    if p.profiler_warmup + p.profiler_active > p.profile_freq:
        raise ConfigError(
            f"config: profiling.profiler_warmup ({p.profiler_warmup}) + profiler_active ({p.profiler_active}) "
            f"must fit in profile_freq ({p.profile_freq}); raise profile_freq or shorten the window"
        )


def _schedule_covers_training(config: Any) -> None:
    s, steps = config.lr_scheduler, config.training.steps
    if s.total_steps is not None and s.total_steps < steps:
        raise ConfigError(
            f"config: lr_scheduler.total_steps ({s.total_steps}) is below training.steps ({steps}): past its end "
            "the decay overshoots (a negative or rising lr); set total_steps >= training.steps or leave it unset"
        )
    total = s.total_steps or steps
    if s.warmup_steps > total:
        # torchtitan warns and shortens the warmup too, so its short test runs of long configs still run.
        logger.warning(
            "config: lr_scheduler.warmup_steps (%d) is longer than the %d-step schedule; warmup is shortened "
            "to %d steps and reaches the peak lr at the last one",
            s.warmup_steps,
            total,
            total,
        )
    warmup = min(s.warmup_steps, total)
    if s.decay_ratio is not None and warmup + round(total * s.decay_ratio) > total:
        # torchtitan shortens the decay to the steps warmup leaves, with a warning.
        logger.warning(
            "config: lr_scheduler.decay_ratio (%s) asks for %d decay steps, but %d warmup steps leave %d of the "
            "%d-step schedule; the decay is shortened to %d steps",
            s.decay_ratio,
            round(total * s.decay_ratio),
            warmup,
            total - warmup,
            total,
            total - warmup,
        )


def _validation_fits_the_layout(config: Any) -> None:
    v, p = config.validation, config.parallelism
    if not v.enable:
        return
    if p.context_parallel_degree > 1 and v.seq_len > config.training.seq_len:
        raise ConfigError(
            f"config: validation.seq_len ({v.seq_len}) is longer than training.seq_len ({config.training.seq_len}) "
            "under context parallelism, which splits the rotary table with each training sequence; set "
            "validation.seq_len <= training.seq_len"
        )
    tp = p.tensor_parallel_degree
    if tp > 1 and v.seq_len % tp:
        raise ConfigError(
            f"config: validation.seq_len ({v.seq_len}) is not divisible by parallelism.tensor_parallel_degree "
            f"({tp}); sequence parallelism splits each sequence over the tp ranks, so choose a multiple of {tp}"
        )


def _microbatches_divide_the_batch(config: Any) -> None:
    p, local = config.parallelism, config.training.local_batch_size
    if p.pipeline_parallel_degree > 1 and local % p.pipeline_parallel_microbatch_size:
        raise ConfigError(
            f"config: training.local_batch_size ({local}) is not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size ({p.pipeline_parallel_microbatch_size}); "
            "each pipeline micro-batch takes that many sequences, so change one of them"
        )


def _names_are_registered(config: Any) -> None:
    """model.name, model.flavor and the datasets are registered (experimental.custom_import, checked
    and imported above, may have registered more). The sequence lengths are checked against the
    model's context by the resolve step (`titan_train.plan`), which reads a `from_hf` shape."""
    family = get_model_family(config.model.name)
    if config.model.flavor != FROM_HF:
        family.args_for(config.model.flavor)
    sections = [config.training] + ([config.validation] if config.validation.enable else [])
    for section, name in zip(sections, ("training", "validation"), strict=False):
        if section.dataset not in DATASETS:
            raise ConfigError(
                f"config: {name}.dataset: unknown dataset '{section.dataset}'; registered: {', '.join(DATASETS)} "
                "(register more with titan_data.register_dataset in an experimental.custom_import module)"
            )


def family_takes_positions(family_name: str) -> bool:
    """Whether the family's model takes per-token positions (`Decoder.takes_positions`), so that packed
    conversations stay apart; a model class that does not say takes them."""
    build = get_model_family(family_name).build
    return getattr(build, "takes_positions", lambda: True)()


def _chat_data_fits_the_layout(config: Any) -> None:
    """Chat rows need a path, and a layout that keeps each conversation's tokens together: context
    parallelism splits a row's sequence over ranks and its ring attention is causal only, so a packed
    row's document mask cannot be split with it; it is refused rather than attending across
    conversations (pipeline stages are given the rows' positions, see stage_inputs)."""
    sections = [config.training] + ([config.validation] if config.validation.enable else [])
    chat = [
        name
        for section, name in zip(sections, ("training", "validation"), strict=False)
        if renders_chat_template(section)
    ]
    for section, name in zip(sections, ("training", "validation"), strict=False):
        if renders_chat_template(section) and not (
            section.dataset_path or getattr(section, "dataset_mixture", None)
        ):
            raise ConfigError(
                f"config: {name}.dataset = '{section.dataset}' needs {name}.dataset_path: a .jsonl/.json/.parquet file or "
                f"folder of {section.dataset} rows, or a Hugging Face dataset id"
            )
    # A packed row's conversations are kept apart by positions that restart (`Decoder.takes_positions`).
    if chat and config.sft.packing and not family_takes_positions(config.model.name):
        takers = [name for name in model_family_names() if family_takes_positions(name)]
        raise ConfigError(
            f"config: {chat[0]}.dataset = 'chat' with sft.packing = true: model.name '{config.model.name}' "
            "builds its own attention masks and cannot keep packed conversations apart yet; set "
            f"sft.packing = false (one conversation per row) or fine-tune a {' or '.join(takers)} model"
        )


COMBINATIONS: tuple[Callable[[Any], None], ...] = (
    _chat_data_fits_the_layout,
    data_choices_fit,
    check_preference,
    check_grpo,
    check_fault_tolerance,
    _profiler_window_fits,
    _schedule_covers_training,
    _validation_fits_the_layout,
    _microbatches_divide_the_batch,
    _names_are_registered,
    *MODEL_RULES,
    check_muon,
    check_health,
)
