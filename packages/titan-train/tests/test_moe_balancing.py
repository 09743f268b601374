"""MoE load balancing counts what training routed and moves when the optimizer does, and the MoE settings
that depend on the layout or the sequence length are training's.

Expert bias: moved once per applied optimizer step (a step the health guard skips moves nothing), from
the tokens of training forwards only (not validation's, not an activation-checkpointing recomputation's,
not the measuring pass of the optimizer stepped in backward). The sequence-wise aux loss weighs the same
under a pipeline schedule (its loss divided by the microbatches) as in one process. DeepSeek's YaRN is
decided by training.seq_len, the Hugging Face config check compares with the run's args, and Llama 4's
temperature tuning is refused under context parallelism.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from workers.moe_balance_flavors import TINY_BALANCE

from titan_models import deepseek_v3
from titan_train.cli import run
from titan_train.config import load_job_config
from titan_train.errors import ConfigError
from titan_train.plan import resolve
from titan_train.registry import register_flavor
from titan_train.torchrun import run_torchrun
from titan_train.trainer import Trainer

WORKER = Path(__file__).parent / "workers" / "moe_aux_loss_pp.py"
MODEL = ("--model.name", "deepseek_v3", "--model.flavor", "tiny_balance")
BATCH = ("--training.local_batch_size", "2")  # with conftest's SMALL (seq 32): 64 tokens per micro-batch
TOKENS = 2 * 32 * TINY_BALANCE.moe_args.top_k  # expert choices in one micro-batch
AUX = ("--model.moe_seq_aux_loss_coeff", "1.0")


def _records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_aux_loss_gradient_under_pipeline_parallelism_equals_one_process(tmp_path):
    """Both stages hold an MoE layer with a shared expert and the aux loss at weight 1; 2 microbatches.
    Weighted twice (the schedule's 1/microbatches not applied to it), step 1's grad_norm was 7e-3 off.
    """
    flags = [
        *MODEL,
        *BATCH,
        *AUX,
        "--training.seq_len",
        "32",
        "--training.steps",
        "2",
        "--metrics.log_freq",
        "1",
    ]
    flags += ["--activation_checkpoint.mode", "none", "--compile.enable", "false"]
    assert run([*flags, "--job.dump_folder", str(tmp_path / "one")]) == 0
    pp = [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
        "--job.dump_folder",
        str(tmp_path / "pp"),
    ]
    result = run_torchrun(str(WORKER), *flags, *pp, nproc=2, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    one, piped = _records(tmp_path / "one"), _records(tmp_path / "pp")
    assert "aux_loss" in one[0]
    for key in ("loss", "grad_norm"):
        for got, want in zip([r[key] for r in piped], [r[key] for r in one], strict=True):
            assert got == pytest.approx(want, rel=1e-5), (key, piped, one)


@pytest.fixture
def build(small_config, one_rank):
    """`build(dump, *flags)`: the tiny DeepSeek model's Trainer on one rank."""

    def make(dump: Path, *flags: str) -> Trainer:
        return Trainer(resolve(small_config(dump, *MODEL, *BATCH, *flags), 1, "cpu"), one_rank)

    return make


def _layers(trainer: Trainer) -> dict:
    return trainer.model_parts[0].moe_layers()


def test_a_step_the_health_guard_skips_leaves_the_expert_bias_alone(tmp_path, build):
    drill = ("--health.drill_step", "1", "--health.drill", "nan", "--health.on_nonfinite", "skip")
    trainer = build(tmp_path, *drill, "--training.steps", "1")
    trainer.train()
    (record,) = _records(tmp_path)
    for name, moe in _layers(trainer).items():
        counts = record["expert_counts"][name]
        assert sum(counts) == TOKENS and max(counts) > min(counts)  # the rule would have moved the bias
        assert not moe.expert_bias.any(), name
        assert not moe.tokens_per_expert.any(), name  # the skipped step's counts do not carry over


def test_validation_tokens_do_not_count_into_the_next_update(tmp_path, build):
    validation = (
        "--validation.enable",
        "--validation.dataset",
        "c4_test",
        "--validation.seq_len",
        "32",
        "--validation.local_batch_size",
        "2",
        "--validation.steps",
        "2",
    )
    trainer = build(tmp_path, *validation)
    batches = trainer._batches()
    trainer.train_step(batches)
    trainer.validator.validate(trainer.model_parts)
    for name, moe in _layers(trainer).items():
        assert not moe.tokens_per_expert.any(), name
    step = trainer.train_step(batches)
    assert all(sum(c) == TOKENS for c in step.moe.counts.values()), step.moe.counts


def test_counts_are_what_training_routed_in_every_activation_checkpointing_mode(tmp_path, build):
    """Full and selective AC recompute each MoE forward in backward; optimizer-in-backward with clipping
    runs a measuring pass first. Each logs the counts of the one forward that trained, equal to no AC's."""
    modes = {
        "none": (),
        "full": ("--activation_checkpoint.mode", "full"),
        "selective_op": (
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ),
        "selective_layer": (
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "1",
        ),
        "step_in_backward": ("--optimizer.early_step_in_backward", "--training.max_norm", "1.0"),
    }
    counts = {}
    for mode, flags in modes.items():
        trainer = build(tmp_path / mode, *flags)
        counts[mode] = trainer.train_step(trainer._batches()).moe.counts
    assert all(sum(c) == TOKENS for c in counts["none"].values())
    assert [mode for mode, got in counts.items() if got != counts["none"]] == []


def test_yarn_is_decided_by_the_training_sequence_length(tmp_path):
    """DeepSeek-V3's published YaRN applies beyond original_seq_len 4096: a validation at 8192 gets a
    longer rotary table, but training at 4096 computes the function of 4096 (no stretch, plain scale)."""
    flags = ["--model.name", "deepseek_v3", "--model.flavor", "16B", "--training.seq_len", "4096"]
    validation = ["--validation.enable", "--validation.seq_len", "8192", "--validation.dataset", "c4_test"]
    plan = resolve(load_job_config([*flags, *validation, "--job.dump_folder", str(tmp_path)]), 1, "cpu")
    alone = resolve(load_job_config([*flags, "--job.dump_folder", str(tmp_path)]), 1, "cpu")
    assert plan.model_args.max_seq_len == 8192 and not plan.model_args.uses_yarn
    assert plan.model_args.softmax_scale == alone.model_args.softmax_scale
    longer = resolve(load_job_config([*flags[:-1], "8192", "--job.dump_folder", str(tmp_path)]), 1, "cpu")
    assert longer.model_args.uses_yarn  # the same flavor trained at 8192 is stretched


def test_hugging_face_config_check_compares_with_the_run_s_args(tmp_path):
    """A flavor built for 16384 positions has YaRN, a run of it at seq 32 does not: the checkpoint the run
    exported (no rope_scaling) is its own, and one with YaRN is not."""
    hf_like = replace(TINY_BALANCE, latent_norm_eps=1e-6)  # DeepseekV3ForCausalLM's fixed epsilon
    register_flavor("deepseek_v3", "tiny_long", replace(hf_like, max_seq_len=16384, context_len=16384))
    run_args = replace(hf_like, max_seq_len=32)
    flags = [
        "--model.name",
        "deepseek_v3",
        "--model.flavor",
        "tiny_long",
        "--training.seq_len",
        "32",
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--job.dump_folder",
        str(tmp_path / "out"),
    ]
    for name, args in (("own", run_args), ("stretched", replace(run_args, max_seq_len=16384))):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(deepseek_v3.to_hf_config(args)))
        config = load_job_config([*flags, "--checkpoint.initial_load_path", str(folder)])
        if name == "own":
            assert not resolve(config, 1, "cpu").model_args.uses_yarn
        else:
            with pytest.raises(ConfigError, match="rope_scaling"):
                resolve(config, 1, "cpu")


def test_temperature_tuning_under_context_parallelism_is_refused_in_one_line(tmp_path, caplog):
    flags = ["--model.name", "llama4", "--training.seq_len", "64", "--job.dump_folder", str(tmp_path)]
    cp = ["--parallelism.context_parallel_degree", "2"]
    with pytest.raises(ConfigError) as refused:
        resolve(load_job_config([*flags, "--model.flavor", "tiny_published", *cp]), 2, "cpu")
    message = str(refused.value)
    assert "context_parallel_degree(2)" in message and "tiny_published" in message and "\n" not in message
    # torchtitan's _irope flavor has no temperature tuning: no such refusal.
    try:
        resolve(load_job_config([*flags, "--model.flavor", "debugmodel_irope", *cp]), 2, "cpu")
    except ConfigError as err:
        assert "temperature" not in str(err)


def test_moe_coefficients_switch_balancing_and_refuse_dense_models(tmp_path, caplog):
    def args(*flags):
        return resolve(load_job_config([*flags, "--job.dump_folder", str(tmp_path)]), 1, "cpu").model_args

    qwen3 = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe")
    assert not args(*qwen3).moe_args.update_bias  # torchtitan's Qwen3 trainer never moves it
    on = args(*qwen3, "--model.moe_load_balance_coeff", "0.01").moe_args
    assert on.update_bias and on.load_balance_coeff == 0.01
    off = args(*MODEL, "--model.moe_load_balance_coeff", "0").moe_args
    assert not off.update_bias and off.load_balance_coeff is not None  # the buffer stays for checkpoints
    assert args(*MODEL, *AUX).moe_args.seq_aux_loss_coeff == 1.0
    for flag, value in (("moe_load_balance_coeff", "-1"), ("moe_seq_aux_loss_coeff", "2")):
        with pytest.raises(ConfigError, match=f"model.{flag}"):
            load_job_config([f"--model.{flag}", value])
    with pytest.raises(
        ConfigError, match="model.moe_seq_aux_loss_coeff = 0.1: llama3 debugmodel has no experts"
    ):
        args("--model.moe_seq_aux_loss_coeff", "0.1")


def test_moe_layouts_that_drift_on_an_older_torch_are_refused_naming_its_version(tmp_path, monkeypatch):
    flags = [*MODEL, *BATCH, "--training.seq_len", "32", "--job.dump_folder", str(tmp_path)]
    ep_pp = ["--parallelism.expert_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"]
    cases = (
        (ep_pp, 4, "expert_parallel_degree(2) with pipeline_parallel_degree(2)"),
        (["--compile.enable"], 1, "compile"),
    )
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    for extra, world, field in cases:
        with pytest.raises(ConfigError) as refused:
            resolve(load_job_config([*flags, *extra]), world, "cpu")
        message = str(refused.value)
        assert field in message and "torch 2.11.0" in message and "\n" not in message
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    for extra, world, _ in cases:
        resolve(load_job_config([*flags, *extra]), world, "cpu")
