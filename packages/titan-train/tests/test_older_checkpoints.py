"""A checkpoint Titan wrote before train_state took torchtitan's names (`tokens_seen`, now `ntokens_seen`)
resumes, and `titan-train generate`'s loader names the checkpoint folder it reads."""

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_train.commands.checkpoint_model import load_checkpoint_model
from titan_train.plan import resolve
from titan_train.train_state import TrainState
from titan_train.trainer import Trainer

pytestmark = pytest.mark.slow

FLAGS = ("--checkpoint.enable", "--checkpoint.interval", "1", "--training.local_batch_size", "1")


@pytest.fixture(scope="module")
def old_layout(tmp_path_factory, small_config, one_rank):
    """A 2-step run's checkpoints, its train_state saved as Titan saved it before the rename."""
    dump = tmp_path_factory.mktemp("old_layout")
    patch = pytest.MonkeyPatch()
    patch.setattr(TrainState, "state_dict", lambda self: {"step": self.step, "tokens_seen": self.tokens_seen})
    patch.setattr(TrainState, "optional_keys", ())  # the old layout had no training_steps either
    try:
        first = Trainer(resolve(small_config(dump, *FLAGS, "--training.steps", "2"), 1, "cpu"), one_rank)
        first.train()
    finally:
        patch.undo()
    keys = set(dcp.FileSystemReader(str(dump / "checkpoint" / "step-2")).read_metadata().state_dict_metadata)
    assert {"train_state.step", "train_state.tokens_seen"} <= keys and "train_state.ntokens_seen" not in keys
    return dump, first.state.tokens_seen


def test_a_checkpoint_with_the_old_train_state_key_resumes_and_says_so(
    old_layout, small_config, one_rank, caplog
):
    dump, tokens_seen = old_layout
    resumed = Trainer(resolve(small_config(dump, *FLAGS, "--training.steps", "3"), 1, "cpu"), one_rank)
    with caplog.at_level(logging.INFO):
        losses = resumed.train()
    assert "resuming from step-2" in caplog.text
    assert "holds train_state.tokens_seen, the older name of train_state.ntokens_seen" in caplog.text
    assert tokens_seen == 64 and len(losses) == 1 and resumed.state.step == 3
    assert resumed.state.tokens_seen == tokens_seen + 32  # counted on from the saved count, not from 0


def test_the_checkpoint_loader_names_the_folder_it_loads(old_layout, small_config, caplog):
    dump, _ = old_layout
    step = dump / "checkpoint" / "step-1"
    with caplog.at_level(logging.INFO):
        loaded = load_checkpoint_model(small_config(dump), step, device=torch.device("cpu"))
    assert f"checkpoint: loading the model weights of {step} (DCP checkpoint)" in caplog.text
    assert "no checkpoint in" not in caplog.text and loaded.step == 1
