"""Numerical faults in real runs: a NaN injected on one rank is caught at its step, then stops or is skipped.

The ranks are forked titan-train processes forming a gloo group (see fault_runs.run_forked_ranks).
"""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import cli_args, logged_losses, run_forked_ranks  # noqa: E402

NAN_AT_STEP_2 = ("--training.steps", "4", "--health.drill", "nan", "--health.drill_step", "2")


@pytest.mark.slow
def test_nan_loss_on_one_rank_stops_every_rank_at_that_step_naming_rank_and_value(tmp_path):
    argv = cli_args(tmp_path, *NAN_AT_STEP_2, "--health.drill_rank", "1")
    statuses, outputs = run_forked_ranks(argv, 2, tmp_path)
    assert statuses == [4, 4], outputs
    expected = (
        "non-finite numbers at step 2: loss nan on rank 1 (finite on ranks 0), gradient norm nan; stopping"
    )
    for output in outputs:
        errors = [line for line in output.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and expected in errors[0], output[-4000:]
        assert "Fix: lower optimizer.lr or training.max_norm" in errors[0]
    assert sorted(logged_losses(tmp_path)) == [1]  # stopped before step 2 was logged or applied


@pytest.mark.slow
def test_nan_loss_with_on_nonfinite_skip_skips_only_that_update_and_training_goes_on(tmp_path):
    skip = ("--health.on_nonfinite", "skip", "--health.max_skipped_steps", "1")
    statuses, [output] = run_forked_ranks(cli_args(tmp_path, *NAN_AT_STEP_2, *skip), 1, tmp_path)
    assert statuses == [0], output[-4000:]
    assert (
        "non-finite numbers at step 2: loss nan on rank 0, gradient norm nan; skipped this update (1 of at most 1"
        in output
    )
    losses = logged_losses(tmp_path)
    assert math.isnan(losses[2])
    # Had the NaN gradients reached AdamW, every later loss would be NaN too.
    assert all(math.isfinite(losses[step]) for step in (1, 3, 4))
