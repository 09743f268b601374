"""The data fields through `titan-train`: the steps an epoch takes (logged, and set by training.epochs),
a held-out share the validation loader reads and the training loader never does, and the one-line
refusals of combinations that cannot apply.

References: an epoch of chat rows without packing is one row per conversation, so its steps are the
file's conversations over the batch, rounded up, counted here from the file itself.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

import pytest
from field_probes import launch

from titan_train.config import JobConfig
from titan_train.config.fields import get_value
from titan_train.config.validate import validate_config
from titan_train.errors import ConfigError

CHAT_ROWS = (
    Path(__file__).parents[2]
    / "titan-data"
    / "src"
    / "titan_data"
    / "assets"
    / "chat_test"
    / "chat_test.jsonl"
)
BASE = (
    "--job.dump_folder",
    "out",
    "--activation_checkpoint.mode",
    "none",
    "--metrics.disable_color_printing",
)
CHAT = ("--training.dataset", "chat", "--training.dataset_path", str(CHAT_ROWS), "--sft.no_packing")
CHAT += ("--training.seq_len", "256", "--training.local_batch_size", "8", "--training.steps", "10000")


def _conversations() -> int:
    return sum(1 for line in CHAT_ROWS.read_text().splitlines() if line.strip())


def test_an_epoch_s_steps_are_logged_and_epochs_set_the_steps(tmp_path, monkeypatch):
    per_epoch = math.ceil(_conversations() / 8)
    seen = launch(tmp_path / "logged", [*BASE, *CHAT], monkeypatch)
    assert seen.status == 0, seen.errors
    assert seen.log(f"is {_conversations()} sequences, {per_epoch} steps of a global batch of 8")
    assert seen.trainer.plan.steps == 10000  # logged only: training.steps still decides
    flags = [*BASE, *CHAT, "--training.epochs", "3", "--lr_scheduler.warmup_steps", "2"]
    seen = launch(tmp_path / "epochs", flags, monkeypatch)
    assert seen.status == 0, seen.errors
    trainer = seen.trainer
    assert trainer.plan.steps == 3 * per_epoch
    assert trainer.config.training.steps == 10000  # the plan holds the count; the config keeps what was given
    assert seen.log(f"training.epochs 3: {3 * per_epoch} steps")
    # the schedule spans the planned steps: its decay reaches the floor (0) just past step 3 * per_epoch,
    # where a schedule over training.steps (10000) would still be near its peak
    factor = trainer.optimizers.schedules[0].lr_lambdas[0]  # of the number of steps taken
    assert factor(3 * per_epoch) == 0.0 < factor(3 * per_epoch - 1)
    # another training.steps given with epochs is refused, naming both numbers
    seen = launch(
        tmp_path / "both", [*BASE, *CHAT, "--training.epochs", "3", "--training.steps", "7"], monkeypatch
    )
    assert seen.status == 2
    assert seen.outcome == (
        f"config: training.epochs (3) is {3 * per_epoch} steps, and training.steps is 7; remove training.steps "
        f"or set it to {3 * per_epoch}"
    )


def test_validation_reads_the_held_out_rows_and_training_never_does(tmp_path, monkeypatch):
    from titan_data import split_rows
    from titan_train.wiring.data import build_validation_loader

    def conversation(i):
        return [
            {"role": "user", "content": f"What is {i} plus one?"},
            {"role": "assistant", "content": f"{i + 1}."},
        ]

    rows = [{"messages": conversation(i)} for i in range(80)]  # every row different
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = list(split_rows(rows, 0.2, "holdout"))
    flags = [*BASE, *CHAT, "--training.dataset_path", "rows.jsonl", "--validation.enable"]
    flags += ["--validation.holdout_share", "0.2", "--validation.seq_len", "256"]
    seen = launch(tmp_path, flags, monkeypatch)
    assert seen.status == 0, seen.errors
    assert 12 <= len(held) <= 20 and seen.log(f"{len(rows) - len(held)} conversations")
    with contextlib.chdir(tmp_path):  # where the relative dataset_path points
        loader = build_validation_loader(seen.trainer.config, seen.trainer.tokenizer, 0, 1)
    assert sum(len(batch[0]) for batch in loader) == len(held)  # one conversation per row without packing
    training = {tuple(e.inputs.tolist()) for e in seen.trainer.loader.packed.by_stream[0]}
    validation = {tuple(e.inputs.tolist()) for e in loader.packed.by_stream[0]}
    assert len(training) == len(rows) - len(held) and len(validation) == len(held)
    assert not training & validation


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            {"training.dataset_mixture": ["a.jsonl", "b.jsonl"], "training.dataset_path": "a.jsonl"},
            "training.dataset_mixture and training.dataset_path both name the data",
        ),
        ({"training.dataset_mixture": ["a.jsonl"]}, "training.dataset_mixture needs at least two paths"),
        (
            {"training.dataset_mixture": ["a", "b"], "training.dataset": "token_shards"},
            "training.dataset = 'token_shards' holds packed tokens",
        ),
        (
            {"training.dataset_mixture": ["a", "b"], "training.dataset_weights": [1.0]},
            "training.dataset_weights has 1 weights for the 2 paths",
        ),
        ({"training.epochs": 2, "training.dataset": "c4"}, "training.epochs needs a finite local dataset"),
        ({"validation.holdout_share": 0.1}, "validation.holdout_share needs validation.enable"),
        (
            {"validation.enable": True, "validation.holdout_share": 0.1, "validation.dataset_split": "test"},
            "validation.holdout_share validates on held-out training rows",
        ),
        (
            {
                "validation.enable": True,
                "validation.holdout_share": 0.1,
                "training.dataset_mixture": ["a", "b"],
            },
            "does not apply to training.dataset = 'token_shards' or to a training.dataset_mixture",
        ),
        (
            {"training.dataset_config": "main", "training.dataset": "json"},
            "training.dataset_config applies to chat, preference or prompts rows read by hub id",
        ),
        (
            {
                "training.dataset_config": "main",
                "training.dataset": "chat",
                "training.dataset_mixture": ["a", "b"],
            },
            "names a configuration of one hub dataset",
        ),
        (
            {
                "training.dataset_config": "main",
                "training.dataset": "chat",
                "training.dataset_path": str(CHAT_ROWS),
            },
            "is a file, which has no configurations",
        ),
    ],
)
def test_data_combinations_are_refused_in_one_line(settings, message):
    config = JobConfig()
    for name, value in settings.items():
        *path, leaf = name.split(".")
        setattr(get_value(config, ".".join(path)), leaf, value)
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(config, check_paths=False)
    assert "\n" not in str(err.value)


def _mixture_files(root: Path) -> tuple[str, ...]:
    """Two text files and two chat files, each source's rows its own."""
    root.mkdir(parents=True, exist_ok=True)
    words = ["river", "stone", "light", "paper", "garden", "signal", "winter", "orbit"]
    for name, offset in (("a", 0), ("b", 3)):
        texts = [" ".join(words[(i * 7 + k + offset) % 8] for k in range(30 + i % 5)) for i in range(40)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        chats = [
            {
                "messages": [
                    {"role": "user", "content": f"{name}: what is {i} plus {offset}?"},
                    {"role": "assistant", "content": f"{i + offset}."},
                ]
            }
            for i in range(30)
        ]
        (root / f"{name}_chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))


@pytest.mark.parametrize(
    "data",
    [
        ("--training.dataset", "json", "--training.dataset_mixture", "a.jsonl,b.jsonl"),
        ("--training.dataset", "chat", "--training.dataset_mixture", "a_chat.jsonl,b_chat.jsonl"),
    ],
    ids=["text", "chat"],
)
def test_a_mixture_resumed_from_a_checkpoint_trains_as_the_uninterrupted_run(tmp_path, monkeypatch, data):
    flags = [*BASE, *data, "--training.dataset_weights", "0.7,0.3", "--training.seq_len", "64"]
    flags += ["--training.local_batch_size", "2", "--training.steps", "3", "--metrics.log_freq", "1"]
    flags += ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
    flags += ["--training.dataloader.num_streams", "2"]
    _mixture_files(tmp_path / "full")
    full = launch(tmp_path / "full", flags, monkeypatch, train=True)
    assert full.status == 0, full.errors
    _mixture_files(tmp_path / "resumed")
    shutil.copytree(tmp_path / "full/out/checkpoint/step-2", tmp_path / "resumed/out/checkpoint/step-2")
    resumed = launch(tmp_path / "resumed", flags, monkeypatch, train=True)
    assert resumed.status == 0, resumed.errors
    losses = [(r["step"], r["loss"]) for r in full.jsonl("metrics.jsonl")]
    assert len(losses) == 3
    assert [(r["step"], r["loss"]) for r in resumed.jsonl("metrics.jsonl")][-1:] == losses[2:]
