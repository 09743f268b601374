"""The whole stack through `titan-train`: the debug model learns, and resumes exactly, on one rank and
from two ranks onto one. (Each layout against one process, by loss, grad_norm and weights:
tests/test_train_layouts.py.)"""

import json
import shutil

import pytest

SMALL = ("--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false")
# The debug model on small batches (4 x 64 tokens, not the config's 8 x 256), for CI's time: its loss still
# falls from about 8.1 to 6.7 in 20 steps.
SHORT = ("--training.local_batch_size", "4", "--training.seq_len", "64")


@pytest.mark.slow
def test_debug_model_loss_falls_and_a_resume_from_step_10_equals_the_uninterrupted_20_step_run(
    tmp_path, train
):
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.keep_latest_k", "0")
    full = train(tmp_path / "full", *SMALL, *SHORT, *ckpt, "--training.steps", "20")
    first, last = full[1], sum(full[s] for s in (18, 19, 20)) / 3
    assert first > 7.5
    assert last < first - 1.0
    # A run that stopped right after saving step 10: only that checkpoint is on disk.
    (tmp_path / "resumed" / "checkpoint").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "full" / "checkpoint" / "step-10", tmp_path / "resumed" / "checkpoint" / "step-10"
    )
    resumed = train(tmp_path / "resumed", *SMALL, *SHORT, *ckpt, "--training.steps", "20")
    assert sorted(resumed) == list(range(11, 21))
    assert [resumed[s] for s in range(11, 21)] == [full[s] for s in range(11, 21)]


def _metrics(dump) -> dict[int, tuple[float, float]]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


@pytest.mark.slow
def test_two_ranks_resumed_on_one_with_default_settings_match_the_uninterrupted_run(tmp_path, launch):
    # The same command at both world sizes: the global batch is fixed (1 rank accumulates 2 micro-batches),
    # training.dataloader.num_streams is left unset.
    same = (
        "--training.steps",
        "6",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "0",
        *SMALL,
    )
    # apps/run_train.sh without its `titan-train check` process (SKIP_CHECK=1), for CI's time: the resume is
    # the claim here; the check under run_train.sh: tests/test_apps.py
    # (test_a_layout_error_under_run_train_sh_is_one_line_and_exit_status_2_before_torchrun).
    two = launch(tmp_path / "two", *same, nproc=2, env={"SKIP_CHECK": "1"})
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    # A 2-rank run that stopped after its step-3 save, started again on one rank.
    (tmp_path / "one" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "two" / "checkpoint" / "step-3", tmp_path / "one" / "checkpoint" / "step-3")
    one = launch(tmp_path / "one", *same)
    assert one.returncode == 0, (one.stdout + one.stderr)[-3000:]
    assert "resuming from step-3 in" in one.stdout
    assert "data: 2 streams, as saved (training.dataloader.num_streams is unset; 1 would be" in one.stdout
    uninterrupted, resumed = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
    assert sorted(resumed) == [4, 5, 6]
    for step in range(4, 7):
        assert resumed[step][0] == pytest.approx(uninterrupted[step][0], rel=1e-4, abs=1e-4)
        assert resumed[step][1] == pytest.approx(uninterrupted[step][1], rel=1e-4, abs=1e-4)
