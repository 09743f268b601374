import re

import pytest

from titan_train.config import JobConfig, load_job_config
from titan_train.errors import ConfigError


def test_defaults_follow_torchtitan():
    c = load_job_config([])
    assert isinstance(c, JobConfig)
    assert (c.training.local_batch_size, c.training.seq_len, c.parallelism.data_parallel_shard_degree) == (
        8,
        2048,
        -1,
    )


def test_cli_overrides_toml_which_overrides_defaults(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("[training]\nsteps = 7\nseq_len = 128\n[optimizer]\nlr = 0.1\n")
    c = load_job_config(["--job.config_file", str(toml), "--training.steps", "3"])
    assert (c.training.steps, c.training.seq_len, c.optimizer.lr) == (3, 128, 0.1)
    assert c.training.local_batch_size == 8


def test_booleans_are_flags_and_accept_values():
    assert load_job_config(["--checkpoint.enable"]).checkpoint.enable is True
    assert load_job_config(["--checkpoint.enable", "false"]).checkpoint.enable is False


def test_nested_section_and_optional_values():
    c = load_job_config(["--training.dataloader.num_streams", "4", "--lr_scheduler.decay_ratio", "0.2"])
    assert c.training.dataloader.num_streams == 4 and c.lr_scheduler.decay_ratio == 0.2


def test_unknown_toml_key_names_section_and_nearest_name(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("[training]\nstpes = 7\n")
    with pytest.raises(ConfigError, match=r"unknown key 'stpes' in \[training\]; did you mean 'steps'\?"):
        load_job_config(["--job.config_file", str(toml)])


def test_unknown_flag_suggests_the_nearest():
    with pytest.raises(ConfigError, match="did you mean '--training.seq_len'"):
        load_job_config(["--training.seqlen", "5"])


def test_wrong_type_and_bad_choice_are_named():
    with pytest.raises(ConfigError, match="training.steps expects int, got 'ten'"):
        load_job_config(["--training.steps", "ten"])
    with pytest.raises(ConfigError, match="optimizer.name = 'SGD' is not one of"):
        load_job_config(["--optimizer.name", "SGD"])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_job_config(["--job.config_file", str(tmp_path / "nope.toml")])


def test_help_lists_every_field_of_every_torchtitan_section(capsys, monkeypatch):
    from titan_train.cli import run

    monkeypatch.setenv("COLUMNS", "400")  # one line per option, so defaults are not wrapped
    from titan_train.config.parse import iter_fields

    with pytest.raises(SystemExit) as exit_info:
        run(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for dotted, _, _ in iter_fields(JobConfig):
        assert f"--{dotted} " in text
    sections = {line.strip()[1:-2] for line in text.splitlines() if line.startswith("[")}
    issue_sections = (
        "job profiling metrics model optimizer lr_scheduler training training.dataloader parallelism checkpoint "
        "activation_checkpoint compile quantize.linear.float8 quantize.linear.mx comm memory_estimation "
        "validation debug"
    ).split()
    assert set(issue_sections) <= sections
    assert "(default: 'selective')" in text and "(default: 1.0)" in text


def test_lists_are_comma_separated_and_lists_of_lists_use_semicolons():
    c = load_job_config(
        [
            "--quantize.linear.float8.filter_fqns",
            "output,attention.wq",
            "--parallelism.module_fqns_per_model_part",
            "tok_embeddings,layers.0;layers.1,norm,output",
        ]
    )
    assert c.quantize.linear.float8.filter_fqns == ["output", "attention.wq"]
    assert c.parallelism.module_fqns_per_model_part == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "norm", "output"],
    ]


def test_negated_boolean_flag_turns_off_what_the_toml_turned_on(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("[metrics]\nenable_tensorboard = true\n")
    c = load_job_config(["--job.config_file", str(toml), "--metrics.no_enable_tensorboard"])
    assert c.metrics.enable_tensorboard is False


def test_custom_config_module_adds_a_section_and_a_field(tmp_path, monkeypatch):
    (tmp_path / "my_titan_extension.py").write_text(
        "from dataclasses import dataclass, field\n\n"
        "@dataclass\nclass Curriculum:\n    start_seq_len: int = 128\n    ramp_steps: int = 100\n\n"
        "@dataclass\nclass Training:\n    label_smoothing: float = 0.0\n\n"
        "@dataclass\nclass JobConfig:\n"
        "    curriculum: Curriculum = field(default_factory=Curriculum)\n"
        "    training: Training = field(default_factory=Training)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    toml = tmp_path / "job.toml"
    toml.write_text('[job]\ncustom_config_module = "my_titan_extension"\n[curriculum]\nramp_steps = 7\n')
    c = load_job_config(
        ["--job.config_file", str(toml), "--training.label_smoothing", "0.1", "--training.steps", "5"]
    )
    assert isinstance(c, JobConfig)
    assert (c.curriculum.start_seq_len, c.curriculum.ramp_steps) == (128, 7)
    assert (c.training.label_smoothing, c.training.steps, c.training.seq_len) == (0.1, 5, 2048)
    with pytest.raises(ConfigError, match="did you mean '--curriculum.ramp_steps'"):
        load_job_config(["--job.custom_config_module", "my_titan_extension", "--curriculum.ramp_step", "3"])


def test_custom_config_module_that_cannot_be_imported_is_named():
    with pytest.raises(
        ConfigError, match="job.custom_config_module 'no_such_titan_module' cannot be imported"
    ):
        load_job_config(["--job.custom_config_module", "no_such_titan_module"])


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--validation.steps", "0"], r"validation.steps must be at least 1 \(or -1\), got 0"),
        (["--training.global_batch_size", "0"], r"training.global_batch_size must be at least 1 \(or -1\)"),
        (["--training.local_batch_size", "0"], "training.local_batch_size must be at least 1"),
        (["--profiling.profile_freq", "3"], r"profiler_warmup \(3\) \+ profiler_active \(1\) must fit"),
    ],
)
def test_values_out_of_range_are_named(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(flags)


def test_help_describes_titan_and_names_every_subcommand_that_has_its_own_help(capsys, monkeypatch):
    from titan_train.cli import run

    monkeypatch.setenv("COLUMNS", "400")  # no wrapped names

    with pytest.raises(SystemExit):
        run(["--help"])
    text = capsys.readouterr().out
    usage = text.split("\n\n")[0]
    assert "Titan" in text and "Train a Llama model" not in text
    for name in ("report", "dry-run", "check", "generate", "eval"):
        assert re.search(rf"[{{|] {name} |{{{name} ", usage) and f"'{name}'" in text
        with pytest.raises(SystemExit) as exit_info:
            run([name, "--help"])
        assert exit_info.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: titan-train {name}")
