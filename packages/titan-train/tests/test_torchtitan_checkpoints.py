"""Checkpoints torchtitan 0.2.2's trainer wrote, loaded and resumed by Titan's trainer.

`tests/fixtures/torchtitan/` (at the repository root) was written by `make_fixture.py` there, which runs
torchtitan's trainer in a separate environment (torchtitan 0.2.2, torch 2.11): checkpoint/step-1 is its
full checkpoint after one step of a tiny llama3, checkpoint/step-2 its model-only last save.
"""

import json
import logging
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titan_ckpt import CheckpointError
from titan_models import llama3_args
from titan_train.config import load_job_config
from titan_train.plan import resolve
from titan_train.registry import register_flavor
from titan_train.trainer import Trainer
from titan_train.wiring.lr_schedule import lr_factor

FIXTURE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "torchtitan"
FACTS = json.loads((FIXTURE / "facts.json").read_text())

# torchtitan's tiny fixture model as a Titan flavor (torchtitan gives every llama3 the 3.1 rotary stretch).
register_flavor("llama3", "torchtitan_tiny", replace(llama3_args("debugmodel"), **FACTS["tiny"]))
RUN = FACTS["run"]


@pytest.fixture(scope="module")
def saved():
    """Every value torchtitan's step-1 and step-2 hold, read with torch's own converter."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for step in (1, 2):
            dcp_to_torch_save(FIXTURE / "checkpoint" / f"step-{step}", f"{tmp}/{step}.pt")
            out[step] = torch.load(f"{tmp}/{step}.pt", weights_only=False)
    return out


def _trainer(dump: Path, one_rank, *flags: str) -> Trainer:
    config = load_job_config(
        [
            "--job.dump_folder",
            str(dump),
            "--model.flavor",
            "torchtitan_tiny",
            "--metrics.log_freq",
            "1",
            "--training.seq_len",
            str(RUN["seq_len"]),
            "--training.local_batch_size",
            str(RUN["local_batch_size"]),
            "--optimizer.lr",
            str(RUN["lr"]),
            "--lr_scheduler.warmup_steps",
            str(RUN["warmup_steps"]),
            "--checkpoint.enable",
            *flags,
        ]
    )
    return Trainer(resolve(config, one_rank.world_size, "cpu"), one_rank)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in trainer.model_parts[0].state_dict().items() if k != "freqs_cis"}


def test_a_torchtitan_model_only_checkpoint_is_an_initial_load_path(tmp_path, one_rank, saved):
    trainer = _trainer(
        tmp_path,
        one_rank,
        "--training.steps",
        "0",
        "--checkpoint.initial_load_path",
        str(FIXTURE / "checkpoint" / "step-2"),
    )
    trainer.train()
    weights = _weights(trainer)
    assert weights.keys() == {k for k in saved[2] if "." in k}
    assert max((weights[k] - saved[2][k]).abs().max().item() for k in weights) == 0.0


def test_a_torchtitan_full_checkpoint_resumes_with_its_optimizer_schedule_and_step(
    tmp_path, one_rank, saved, caplog
):
    shutil.copytree(FIXTURE / "checkpoint" / "step-1", tmp_path / "checkpoint" / "step-1")
    with pytest.raises(CheckpointError) as refused:
        _trainer(tmp_path, one_rank, "--training.steps", "4").train()
    assert str(refused.value).startswith("checkpoint: the 'dataloader' state in")
    assert "saved keys dp_rank_0, world_size; this run reads stream_0)" in str(refused.value)
    assert str(refused.value).endswith(
        "add 'dataloader' to checkpoint.exclude_from_loading to start that state fresh"
    )

    exclude = ("--checkpoint.exclude_from_loading", "dataloader")
    resumed = _trainer(tmp_path, one_rank, "--training.steps", "1", *exclude)
    with caplog.at_level(logging.INFO):
        resumed.train()
    assert "resuming from step-1" in caplog.text and "nothing left to train" in caplog.text
    assert resumed.state.step == 1 and resumed.state.tokens_seen == saved[1]["train_state"]["ntokens_seen"]
    assert max((w - saved[1][k]).abs().max().item() for k, w in _weights(resumed).items()) == 0.0
    model, optimizer = resumed.model_parts[0], resumed.optimizers.optimizers[0]
    theirs = saved[1]["optimizer"]
    differences = [
        (optimizer.state[p][kind] - theirs[f"state.{name}.{kind}"]).abs().max().item()
        for name, p in model.named_parameters()
        for kind in ("step", "exp_avg", "exp_avg_sq")
    ]
    assert len(differences) == 3 * len(list(model.parameters())) and max(differences) == 0.0
    assert resumed.optimizers.schedules[0].last_epoch == saved[1]["lr_scheduler"]["last_epoch"] == 1
    # The lr torchtitan's trainer set for step 2 of its run (2 steps, 1 warmup) is the one Titan's schedule
    # gives for the same settings: the peak (one virtual stable step), not the floor of a 1-step decay.
    factor = lr_factor(
        2,
        total_steps=RUN["steps"],
        warmup_steps=RUN["warmup_steps"],
        decay_ratio=None,
        decay_type="linear",
        min_lr_factor=0.0,
    )
    assert RUN["lr"] * factor == saved[1]["lr_scheduler"]["_last_lr"][0] == RUN["lr"]

    continued = _trainer(tmp_path, one_rank, "--training.steps", "4", *exclude)
    continued.train()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3, 4] and continued.state.step == 4
