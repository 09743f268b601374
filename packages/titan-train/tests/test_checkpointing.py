"""The [checkpoint] section through the real trainer: refusals, seed checkpoints, background saves
(Hugging Face import and export: test_hf_interop.py)."""

import json
import logging
import shutil

import pytest
import torch

from titan_ckpt import LoadPolicy, ModelState, OptimizerState, SavePolicy, complete_steps
from titan_train.config.run_checks import check_checkpoint_config
from titan_train.errors import ConfigError
from titan_train.plan import resolve
from titan_train.trainer import Trainer
from titan_train.wiring.checkpointing import build_checkpointer
from titan_train.wiring.lr_schedule import lr_factor


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--checkpoint.initial_load_path", "/ckpt/step-100"],
            "checkpoint.initial_load_path is set but checkpoint.enable is false",
        ),
        (["--checkpoint.load_step", "5"], "checkpoint.load_step is set but checkpoint.enable is false"),
        (
            ["--checkpoint.last_save_in_hf"],
            "checkpoint.last_save_in_hf is set but checkpoint.enable is false",
        ),
        (
            ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"],
            "WORLD_SIZE is 2; run it with NGPU=1",
        ),
        (
            ["--checkpoint.enable", "--checkpoint.initial_load_in_hf"],
            "initial_load_in_hf needs the Hugging Face folder",
        ),
    ],
)
def test_checkpoint_switches_that_would_be_ignored_are_refused(tmp_path, small_config, flags, message):
    with pytest.raises(ConfigError, match=message):
        check_checkpoint_config(small_config(tmp_path, *flags), world_size=2)


def test_every_checkpoint_field_reaches_the_checkpointer(tmp_path, small_config, one_rank):
    config = small_config(
        tmp_path,
        "--checkpoint.enable",
        "--checkpoint.folder",
        "ck",
        "--checkpoint.interval",
        "7",
        "--checkpoint.keep_latest_k",
        "3",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.load_step",
        "4",
        "--checkpoint.initial_load_path",
        "/w",
        "--checkpoint.initial_load_model_only",
        "false",
        "--checkpoint.last_save_model_only",
        "false",
        "--checkpoint.export_dtype",
        "bfloat16",
        "--checkpoint.exclude_from_loading",
        "dataloader",
        "--checkpoint.enable_first_step_checkpoint",
        "--checkpoint.load_only",
    )
    model = torch.nn.Linear(2, 2)
    states = {
        "model": ModelState([model]),
        "dataloader": OptimizerState([model], [torch.optim.SGD(model.parameters())]),
    }
    ckpt = build_checkpointer(resolve(config, 1, "cpu"), states, model_args=None)
    assert ckpt.folder == tmp_path / "ck"
    assert ckpt.saving == SavePolicy(
        interval=7, keep_latest_k=3, async_mode="async", enable_first_step_checkpoint=True, load_only=True
    )
    assert ckpt.loading == LoadPolicy(
        load_step=4,
        initial_load_path="/w",
        initial_load_model_only=False,
        exclude_from_loading=("dataloader",),
    )
    assert (ckpt.last_save.model_only, ckpt.last_save.dtype) == (False, torch.bfloat16)
    ckpt.close()


def test_seed_checkpoint_is_written_alone_and_a_run_starts_from_its_weights(tmp_path, small_config, one_rank):
    seed_flags = ("--checkpoint.enable", "--debug.seed", "0")
    assert (
        Trainer(
            resolve(
                small_config(tmp_path / "run", *seed_flags, "--checkpoint.create_seed_checkpoint"),
                one_rank.world_size,
                "cpu",
            ),
            one_rank,
        ).train()
        == []
    )
    assert complete_steps(tmp_path / "run" / "checkpoint") == [0]

    # Another init seed, but the seed checkpoint's weights are loaded: the run matches one from seed 0.
    from_seed = Trainer(
        resolve(
            small_config(tmp_path / "run", "--checkpoint.enable", "--debug.seed", "1"),
            one_rank.world_size,
            "cpu",
        ),
        one_rank,
    ).train()
    plain = Trainer(
        resolve(small_config(tmp_path / "plain", "--debug.seed", "0"), one_rank.world_size, "cpu"), one_rank
    ).train()
    assert from_seed == plain


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_resume_from_a_background_save_equals_the_uninterrupted_run(tmp_path, small_config, one_rank, mode):
    flags = (
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.async_mode",
        mode,
        "--checkpoint.keep_latest_k",
        "0",
        "--training.steps",
        "4",
    )
    full = Trainer(
        resolve(small_config(tmp_path / "full", *flags), one_rank.world_size, "cpu"), one_rank
    ).train()
    # A run that stopped after its step-2 save: only that checkpoint is on disk.
    shutil.copytree(
        tmp_path / "full" / "checkpoint" / "step-2", tmp_path / "resumed" / "checkpoint" / "step-2"
    )
    resumed = Trainer(
        resolve(small_config(tmp_path / "resumed", *flags), one_rank.world_size, "cpu"), one_rank
    ).train()
    assert resumed == full[2:]


def test_a_finished_run_started_with_more_steps_continues_from_its_full_last_save(
    tmp_path, small_config, one_rank, caplog
):
    flags = ("--checkpoint.enable", "--checkpoint.interval", "100", "--lr_scheduler.warmup_steps", "2")
    first = Trainer(
        resolve(small_config(tmp_path, *flags, "--training.steps", "6"), one_rank.world_size, "cpu"), one_rank
    )
    first.train()
    # The last save is full (resumable), the model-only export of last_save_model_only beside it.
    assert (tmp_path / "checkpoint" / "step-6" / "model_only" / ".metadata").is_file()
    ended = {p: dict(s) for p, s in first.optimizers.optimizers[0].state.items()}
    data_position = first.loader.state_dict()

    extended = Trainer(
        resolve(small_config(tmp_path, *flags, "--training.steps", "12"), one_rank.world_size, "cpu"),
        one_rank,
    )
    assert not extended.restore()
    assert extended.state.step == 6 and extended.loader.state_dict() == data_position
    optimizer = extended.optimizers.optimizers[0]
    params = {name: p for name, p in extended.model_parts[0].named_parameters()}
    names = {id(p): name for name, p in first.model_parts[0].named_parameters()}
    for param, state in ended.items():
        for kind, value in state.items():
            assert torch.equal(optimizer.state[params[names[id(param)]]][kind], value), (
                names[id(param)],
                kind,
            )
    # The schedule is this run's: step 7 of 12 (2 warmup steps, the peak through step 3, then a linear
    # decay over 10 steps: 4/10 of the way down), not step 7 of 6.
    factor = lr_factor(
        7, total_steps=12, warmup_steps=2, decay_ratio=None, decay_type="linear", min_lr_factor=0.0
    )
    assert factor == pytest.approx(0.6) and extended.optimizers.lr == pytest.approx(3e-3 * factor, rel=1e-12)

    with caplog.at_level(logging.INFO):
        assert len(extended.train()) == 6
    assert extended.state.step == 12
    assert (
        "extending the run: step-6 ended a 6-step run; training continues at step 7 of 12 with its optimizer "
        "and data stream, the learning-rate schedule rebuilt for 12 steps" in caplog.text
    )
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
