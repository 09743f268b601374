"""Every field of JobConfig is range-checked at start: bad values, generated from the schema itself, stop
the run before any work with one line naming `section.field`.

The bulk calls `validate_config` directly (no training, no process per value); a few real `titan-train`
runs check what a user sees: exit status 2, one error line, no traceback, the checkpoint untouched.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import typing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from titan_ckpt import Checkpointer, ModelState
from titan_train.config import JobConfig, build_parser
from titan_train.config.fields import BOUNDS, get_value, iter_fields, unwrap_optional
from titan_train.config.validate import validate_config
from titan_train.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
DEBUG_CONFIG = REPO / "apps" / "configs" / "debug_model.toml"
MISSING = "/nonexistent/titan-field-check"
CHAT_ROWS = (
    REPO / "packages" / "titan-data" / "src" / "titan_data" / "assets" / "chat_test" / "chat_test.jsonl"
)
CHAT = {"training.dataset": "chat", "training.dataset_path": str(CHAT_ROWS)}
PREFERENCE = {"training.dataset": "preference", "training.dataset_path": str(CHAT_ROWS)}  # any existing file

# The only fields that accept any value of their type, each with the reason. A new field must declare
# what it accepts (`opt(..., minimum=..., choices=..., path=...)`) or be listed here.
UNCONSTRAINED = {
    "job.description": "free text, only shown to people",
    "comm.save_traces_file_prefix": "any file-name prefix, the empty one included",
    "grpo.system_prompt": "free text the policy is shown, the empty one (none) included",
}

# Values only a lookup elsewhere refuses (registries, importable modules, signal names): (value, other
# settings the case needs).
LOOKED_UP = {
    "model.name": [("llama9", {})],
    "model.flavor": [("9B", {})],
    "training.dataset": [("c5", {})],
    "validation.dataset": [("c5", {"validation.enable": True})],
    "experimental.custom_import": [("no_such_titan_module", {})],
    "health.preemption_signals": [(["SIGKILL"], {}), (["SIGNOPE"], {})],
}


def _set(config: Any, dotted: str, value: Any) -> None:
    *path, leaf = dotted.split(".")
    setattr(get_value(config, ".".join(path)) if path else config, leaf, value)


def _numbers_of(tp: Any) -> Any:
    """A list of numbers is checked item by item: the item type, else the type itself."""
    inner, _ = unwrap_optional(tp)
    if typing.get_origin(inner) is list and typing.get_args(inner)[0] in (int, float):
        return typing.get_args(inner)[0]
    return inner


def _declares_what_it_accepts(tp: Any, rule: Any) -> bool:
    inner = _numbers_of(tp)
    if inner is bool:
        return True  # true or false, nothing else
    if inner in (int, float):
        has = {key for key, _, _ in BOUNDS if rule.get(key) is not None}
        return bool(has & {"minimum", "above"}) and bool(has & {"maximum", "below"})
    return any(rule.get(key) for key in ("choices", "nonempty", "pattern", "path", "check"))


def _inside(value: Any, rule: Any) -> bool:
    """Whether a number is one the field's declaration accepts."""
    if value in rule["sentinels"]:
        return True
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return not any(rule.get(key) is not None and outside(value, rule[key]) for key, _, outside in BOUNDS)


def _wrong_types(tp: Any) -> list[Any]:
    inner, optional = unwrap_optional(tp)
    values: list[Any] = [] if optional else [None]
    if typing.get_origin(inner) is list:
        nested = typing.get_origin(typing.get_args(inner)[0]) is list
        return values + (["a,b", ["a"], [[5]]] if nested else ["a,b", [5]])
    return (
        values
        + {
            int: ["ten", 2.5, True],
            float: ["ten", True],
            bool: ["yes", 1],
            str: [5, ["a"]],
        }[inner]
    )


def _out_of_range(tp: Any, rule: Any) -> list[Any]:
    inner = _numbers_of(tp)
    if inner not in (int, float):
        return []
    if inner is not unwrap_optional(tp)[0]:  # a list of numbers: each bad number as an item
        return [[1, value] for value in _out_of_range(inner, rule)]
    candidates: list[Any] = [-1, 0, -(10**30)] if inner is int else [-1.0, 0.0, -1e300, math.nan, -math.inf]
    candidates += [10**30] if inner is int else [1e300, math.inf]
    for key, _, _ in BOUNDS:
        bound = rule.get(key)
        if bound is not None:
            candidates += [bound - 1, bound, bound + 1]
    return [value for value in dict.fromkeys(candidates) if not _inside(value, rule)]


def _bad_strings(tp: Any, rule: Any) -> list[tuple[Any, dict[str, Any]]]:
    inner, _ = unwrap_optional(tp)
    is_list = typing.get_origin(inner) is list
    nested = is_list and typing.get_origin(typing.get_args(inner)[0]) is list
    if not (inner is str or is_list):
        return []

    def shaped(text: str) -> Any:
        return [[text]] if nested else [text] if is_list else text

    cases = []
    if rule["choices"]:
        cases.append((shaped("no-such-choice"), {}))
    if rule["nonempty"] or (rule["pattern"] and "" not in rule["sentinels"]):
        cases.append((shaped(""), {}))
    if rule["pattern"]:
        cases.append((shaped("not a name!"), {}))
    if rule["path"]:
        cases.append((MISSING, {rule["needed_if"]: True} if rule["needed_if"] else {}))
    return cases


def bad_values() -> list[tuple[str, Any, dict[str, Any]]]:
    """(field, bad value, other settings) for every field of JobConfig, from its declaration."""
    cases = []
    for dotted, tp, f in iter_fields(JobConfig):
        values = [(v, {}) for v in _wrong_types(tp) + _out_of_range(tp, f.metadata)]
        values += _bad_strings(tp, f.metadata) + LOOKED_UP.get(dotted, [])
        cases += [(dotted, value, settings) for value, settings in values]
    return cases


def test_every_field_declares_what_it_accepts_or_says_why_not():
    undeclared = {
        dotted for dotted, tp, f in iter_fields(JobConfig) if not _declares_what_it_accepts(tp, f.metadata)
    }
    assert undeclared == set(UNCONSTRAINED), (
        f"fields that accept anything without a reason in UNCONSTRAINED: {sorted(undeclared - set(UNCONSTRAINED))}; "
        f"listed but constrained: {sorted(set(UNCONSTRAINED) - undeclared)}"
    )
    names = {dotted for dotted, _, _ in iter_fields(JobConfig)}
    assert set(LOOKED_UP) <= names


def test_the_defaults_pass():
    validate_config(JobConfig())


def test_every_bad_value_of_every_field_is_refused_in_one_line_naming_the_field():
    cases = bad_values()
    fields = {dotted for dotted, _, _ in iter_fields(JobConfig)}
    accepted, misnamed = [], []
    for dotted, value, settings in cases:
        config = JobConfig()
        for name, setting in settings.items():
            _set(config, name, setting)
        _set(config, dotted, value)
        try:
            validate_config(config)
        except ConfigError as err:
            if dotted not in str(err) or "\n" in str(err):
                misnamed.append(f"{dotted} = {value!r}: {err}")
        else:
            accepted.append(f"{dotted} = {value!r}")
    print(f"{len(fields)} fields, {len(cases)} bad values tried")
    assert not accepted, f"accepted: {accepted}"
    assert not misnamed, f"refused without naming the field in one line: {misnamed}"
    assert {dotted for dotted, _, _ in cases} == fields  # every field tried
    assert len(cases) >= 5 * len(fields)


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            {"training.steps": 100, "lr_scheduler.total_steps": 50},
            r"lr_scheduler.total_steps \(50\) is below",
        ),
        (
            {
                "validation.enable": True,
                "training.seq_len": 64,
                "validation.seq_len": 128,
                "parallelism.context_parallel_degree": 2,
            },
            r"validation.seq_len \(128\) is longer than training.seq_len \(64\) under context parallelism",
        ),
        (
            {"validation.enable": True, "validation.seq_len": 100, "parallelism.tensor_parallel_degree": 8},
            r"validation.seq_len \(100\) is not divisible by parallelism.tensor_parallel_degree \(8\)",
        ),
        (
            {
                "parallelism.pipeline_parallel_degree": 2,
                "training.local_batch_size": 8,
                "parallelism.pipeline_parallel_microbatch_size": 3,
            },
            r"training.local_batch_size \(8\) is not a multiple of parallelism.pipeline_parallel_microbatch_size",
        ),
        (
            {"model.name": "gpt_oss", "model.flavor": "debugmodel", **CHAT},
            r"training.dataset = 'chat' with sft.packing = true: model.name 'gpt_oss' builds its own attention",
        ),
        (
            {**PREFERENCE, "parallelism.pipeline_parallel_degree": 2, "model.converters": ["lora"]},
            r"training.dataset = 'preference' with LoRA and parallelism.pipeline_parallel_degree > 1",
        ),
        (
            {
                **PREFERENCE,
                "parallelism.pipeline_parallel_degree": 2,
                "validation.enable": True,
                "validation.dataset": "preference",
                "validation.dataset_path": str(CHAT_ROWS),
            },
            r"validation of preference pairs with parallelism.pipeline_parallel_degree > 1",
        ),
        (
            {
                **PREFERENCE,
                "validation.enable": True,
                "validation.dataset": "preference",
                "validation.dataset_path": str(CHAT_ROWS),
                "preference.reference": "precompute",
            },
            r"validation with preference.reference = 'precompute'",
        ),
        (
            {**PREFERENCE, "preference.reference": "precompute", "parallelism.context_parallel_degree": 2},
            r"preference.reference = 'precompute' with parallelism.context_parallel_degree = 2",
        ),
        (
            {
                **PREFERENCE,
                "validation.enable": True,
                "validation.dataset": "chat",
                "validation.dataset_path": str(CHAT_ROWS),
            },
            r"validation.dataset = 'chat' with training.dataset = 'preference'",
        ),
    ],
)
def test_combinations_of_fields_are_refused_naming_both(settings, message):
    config = JobConfig()
    for name, value in settings.items():
        _set(config, name, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def test_packed_chat_rows_pass_where_the_model_takes_their_positions_or_rows_are_padded():
    """The other side of gpt-oss's packing refusal: unpacked rows for it, packed rows for Llama."""
    for settings in (
        {"model.name": "gpt_oss", "model.flavor": "debugmodel", **CHAT, "sft.packing": False},
        {**CHAT},
    ):
        config = JobConfig()
        for name, value in settings.items():
            _set(config, name, value)
        validate_config(config)


def test_a_warmup_longer_than_the_run_is_shortened_with_a_warning(caplog):
    config = JobConfig()
    _set(config, "training.steps", 10)
    with caplog.at_level(logging.WARNING):
        validate_config(config)
    assert "lr_scheduler.warmup_steps (200) is longer than the 10-step schedule" in caplog.text


def test_a_dry_run_does_not_need_the_paths_of_the_machine_it_plans_for():
    config = JobConfig()
    _set(config, "model.hf_assets_path", MISSING)
    _set(config, "comm.mode", "fake_backend")
    validate_config(config)


def _tree_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _titan_train(dump: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "titan_train.cli", "--job.config_file", str(DEBUG_CONFIG)]
    command += ["--job.dump_folder", str(dump), "--metrics.disable_color_printing", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


# (name, flags, the error line's fragment; None: the run must train to the end)
RUNS = [
    (
        "negative_lr_resuming_from_a_checkpoint",
        ("--optimizer.lr", "-1", "--checkpoint.enable"),
        "config: optimizer.lr must be at least 0, got -1.0",
    ),
    (
        "gpt_oss_on_packed_chat_rows",
        ("--model.name", "gpt_oss", "--model.flavor", "debugmodel", "--training.dataset", "chat")
        + ("--training.dataset_path", str(CHAT_ROWS), "--checkpoint.enable"),
        "config: training.dataset = 'chat' with sft.packing = true: model.name 'gpt_oss'",
    ),
    (
        "validation_longer_than_training",
        (
            "--training.seq_len",
            "64",
            "--validation.enable",
            "--validation.seq_len",
            "128",
            "--training.steps",
            "1",
            "--training.local_batch_size",
            "2",
            "--validation.local_batch_size",
            "2",
            "--validation.steps",
            "1",
            "--validation.freq",
            "1",
            "--lr_scheduler.warmup_steps",
            "1",
            "--metrics.enable_tensorboard",
            "false",
        ),
        None,
    ),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, dict, dict]]:
    """Each run of RUNS in its own dump folder that already holds a checkpoint; hashes before and after."""
    root = tmp_path_factory.mktemp("field_runs")
    saved = root / "checkpoint"
    Checkpointer(saved, {"model": ModelState([torch.nn.Linear(4, 4)])}).save(2, wait=True)

    def run(entry):
        name, flags, says = entry
        dump = root / name
        if says is not None:
            shutil.copytree(saved, dump / "checkpoint")
        before = _tree_hashes(dump) if says is not None else {}
        result = _titan_train(dump, *flags)
        return result, before, _tree_hashes(dump) if says is not None else {}

    with ThreadPoolExecutor(max_workers=len(RUNS)) as pool:
        return {entry[0]: result for entry, result in zip(RUNS, pool.map(run, RUNS), strict=True)}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process save of the fixture
@pytest.mark.parametrize("name,flags,says", RUNS, ids=[r[0] for r in RUNS])
def test_titan_train_refuses_at_start_in_one_line_or_runs(name, flags, says, runs):
    result, before, after = runs[name]
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert "Traceback" not in output, output[-3000:]
    if says is None:
        assert result.returncode == 0, output[-3000:]
        assert not errors and "training done at step 1" in output, output[-3000:]
        assert re.search(r"validation +step: +1 +loss", output), output[-3000:]
        return
    assert result.returncode == 2, output[-3000:]
    assert len(errors) == 1 and says in errors[0], output[-3000:]
    assert "step:" not in output  # stopped before any step
    assert after == before and before  # the checkpoint already there is byte for byte the same


def test_help_shows_what_each_field_accepts(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    text = build_parser().format_help()
    assert "the weights stay as they are) (at least 0 and at most 1) (default: 0.0008)" in text
    assert "(at least 1 and at most 16777216, or -1) (default: -1)" in text  # training.global_batch_size
    assert "(a folder with tokenizer.model or tokenizer.json, which must exist)" in text


PROMPTS = {
    "training.dataset": "prompts",
    "training.dataset_path": str(
        Path(__file__).parents[2] / "titan-data/src/titan_data/assets/prompts_test/prompts_test.jsonl"
    ),
    "training.seq_len": 64,
    "grpo.num_generations": 2,
    "grpo.max_prompt_length": 48,
    "grpo.max_completion_length": 8,
    "grpo.reward_funcs": ["answer_match"],
}


@pytest.mark.parametrize(
    "degrees,refusal",
    [
        ({"parallelism.tensor_parallel_degree": 2}, None),
        ({"model.name": "qwen3", "parallelism.expert_parallel_degree": 2}, None),
        (
            {"parallelism.context_parallel_degree": 2},
            "context_parallel_degree > 1 (generation does not split",
        ),
        ({"parallelism.pipeline_parallel_degree": 2}, "pipeline_parallel_degree > 1 (the GRPO step takes"),
    ],
)
def test_grpo_generates_under_tp_and_ep_and_refuses_pp_and_cp(degrees, refusal):
    """The titan engine generates under TP and EP (tests/test_train_layouts.py's grpo_*_generating rows), not
    under PP or CP: those are refused in one line. With the refusal of TP and EP before issue 59's generation
    under them put back (2026-12-03), the TP and EP cases failed."""
    config = JobConfig()
    for name, value in {**PROMPTS, **degrees}.items():
        _set(config, name, value)
    if refusal is None:
        validate_config(config)
        return
    with pytest.raises(ConfigError, match=re.escape(refusal)) as err:
        validate_config(config)
    assert "\n" not in str(err.value)
