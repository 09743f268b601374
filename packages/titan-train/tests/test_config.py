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
