"""torchtitan users' TOML files: 0.2.x configs load unchanged, older ones migrate with a warning per key."""

import logging
from pathlib import Path

import pytest

from titan_train.config import load_job_config
from titan_train.errors import ConfigError
from titan_train.plan import resolve

FIXTURES = Path(__file__).parent / "fixtures"


def _load(name: str, *flags: str):
    return load_job_config(["--job.config_file", str(FIXTURES / name), *flags])


def _config_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "titan_train.config" and r.levelno == logging.WARNING
    ]


def test_torchtitan_0_2_debug_model_loads_unchanged(caplog):
    c = _load("torchtitan_0.2_debug_model.toml")
    assert _config_warnings(caplog) == []
    assert (c.training.local_batch_size, c.training.seq_len, c.training.steps) == (8, 2048, 10)
    assert (c.lr_scheduler.warmup_steps, c.lr_scheduler.decay_ratio, c.lr_scheduler.min_lr_factor) == (
        2,
        0.8,
        0.0,
    )
    assert c.model.hf_assets_path == "./tests/assets/tokenizer"
    assert c.parallelism.pipeline_parallel_schedule == "Interleaved1F1B"
    assert (c.activation_checkpoint.mode, c.activation_checkpoint.selective_ac_option) == ("selective", "2")
    assert c.compile.components == ["model", "loss"]
    assert c.quantize.linear.float8.filter_fqns == ["output"]
    assert (c.validation.enable, c.validation.dataset, c.validation.freq, c.validation.steps) == (
        False,
        "c4_validation",
        5,
        10,
    )
    assert (c.checkpoint.enable, c.checkpoint.interval, c.checkpoint.last_save_model_only) == (
        False,
        10,
        False,
    )
    assert (c.profiling.save_traces_folder, c.metrics.log_freq) == ("profile_trace", 1)


def test_torchtitan_0_2_llama3_8b_loads_unchanged(caplog):
    c = _load("torchtitan_0.2_llama3_8b.toml")
    assert _config_warnings(caplog) == []
    assert (c.model.flavor, c.training.local_batch_size, c.training.seq_len, c.training.dataset) == (
        "8B",
        1,
        8192,
        "c4",
    )
    assert (c.optimizer.lr, c.lr_scheduler.warmup_steps, c.lr_scheduler.decay_ratio) == (3e-4, 200, None)
    assert (c.profiling.enable_profiling, c.profiling.profile_freq, c.metrics.enable_tensorboard) == (
        True,
        100,
        True,
    )
    assert c.activation_checkpoint.selective_ac_option == "op"
    assert (c.checkpoint.interval, c.checkpoint.last_save_model_only, c.checkpoint.export_dtype) == (
        500,
        True,
        "float32",
    )
    assert (c.validation.freq, c.validation.steps) == (500, 1200)


OLD_KEYS = (
    "job.use_for_integration_test",
    "job.print_args",
    "metrics.enable_color_printing",
    "metrics.rank_0_only",
    "model.norm_type",
    "model.tokenizer_path",
    "optimizer.fused",
    "training.batch_size",
    "training.warmup_steps",
    "training.data_parallel_replicate_degree",
    "training.data_parallel_shard_degree",
    "training.tensor_parallel_degree",
    "training.compile",
    "training.seed",
    "training.deterministic",
    "experimental.context_parallel_degree",
    "experimental.pipeline_parallel_degree",
    "experimental.enable_async_tensor_parallel",
    "checkpoint.enable_checkpoint",
    "checkpoint.interval_type",
    "checkpoint.model_weights_only",
    "float8.enable_float8_linear",
    "float8.enable_fsdp_float8_all_gather",
    "float8.precompute_float8_dynamic_scale_for_fsdp",
)


def test_torchtitan_0_0_config_migrates_with_one_warning_per_renamed_key(caplog):
    c = _load("torchtitan_0.0_debug_model.toml")
    warnings = _config_warnings(caplog)
    assert len(warnings) == len(OLD_KEYS)
    for key in OLD_KEYS:
        assert sum(f" {key} " in w for w in warnings) == 1, key
    assert (c.training.local_batch_size, c.lr_scheduler.warmup_steps, c.debug.seed) == (8, 2, 42)
    assert (c.parallelism.data_parallel_shard_degree, c.parallelism.pipeline_parallel_degree) == (-1, 1)
    # Booleans whose meaning flipped are inverted, not copied.
    assert (c.metrics.disable_color_printing, c.metrics.save_for_all_ranks) == (False, False)
    assert (c.optimizer.implementation, c.model.hf_assets_path) == (
        "foreach",
        "./test/assets/test_tiktoken.model",
    )
    assert (c.job.print_config, c.compile.enable, c.checkpoint.enable, c.checkpoint.last_save_model_only) == (
        False,
        False,
        False,
        False,
    )
    assert c.model.converters == []


def test_old_keys_on_the_command_line_migrate_too(caplog):
    c = load_job_config(
        [
            "--training.batch_size",
            "4",
            "--metrics.enable_color_printing",
            "false",
            "--training.compile",
            "--float8.enable_float8_linear",
            "--float8.filter_fqns",
            "output,attention.wk",
        ]
    )
    assert c.training.local_batch_size == 4
    assert c.metrics.disable_color_printing is True
    assert c.compile.enable is True
    assert c.model.converters == ["quantize.linear.float8"]
    assert c.quantize.linear.float8.filter_fqns == ["output", "attention.wk"]
    assert len(_config_warnings(caplog)) == 5


def test_old_converter_names_are_renamed(caplog):
    # One at a time: both together are refused (one linear conversion at most).
    assert load_job_config(["--model.converters", "float8"]).model.converters == ["quantize.linear.float8"]
    assert load_job_config(["--model.converters", "mx"]).model.converters == ["quantize.linear.mx"]
    assert len(_config_warnings(caplog)) == 2


@pytest.mark.parametrize(
    "toml,message",
    [
        (
            "[training]\nlocal_bach_size = 4\n",
            r"unknown key 'local_bach_size' in \[training\]; did you mean 'local_batch_size'\?",
        ),
        ("[trainig]\nsteps = 4\n", r"unknown key 'trainig' in the top level; did you mean 'training'\?"),
        (
            "[quantize.linear.float8]\nfilter_fqn = []\n",
            r"in \[quantize.linear.float8\]; did you mean 'filter_fqns'\?",
        ),
    ],
)
def test_a_typo_gets_the_did_you_mean_error(tmp_path, toml, message):
    path = tmp_path / "job.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        load_job_config(["--job.config_file", str(path)])


# Parameters of torchtitan 0.2.2's own models for these flavors (its model classes built on the meta device).
TORCHTITAN_PARAMETERS = {"debugmodel": 33_014_016, "debugmodel_moe": 315_758_848}


@pytest.mark.parametrize(
    "toml,model,flavor",
    [
        ("torchtitan_0.2_deepseek_v3_debug_model.toml", "deepseek_v3", "debugmodel"),
        ("torchtitan_0.2_qwen3_moe_debug.toml", "qwen3", "debugmodel_moe"),
    ],
)
def test_torchtitan_0_2_moe_debug_configs_load_unchanged_and_resolve(toml, model, flavor, caplog):
    c = _load(toml)
    assert _config_warnings(caplog) == []
    assert (c.model.name, c.model.flavor, c.parallelism.expert_parallel_degree) == (model, flavor, 1)
    for world_size in (1, 2):
        plan = resolve(c, world_size, "cpu")
        assert plan.params.total == TORCHTITAN_PARAMETERS[flavor]
        assert plan.model_args.max_seq_len == c.training.seq_len
        assert plan.dims.dp_shard == world_size  # data_parallel_shard_degree = -1 takes every rank
