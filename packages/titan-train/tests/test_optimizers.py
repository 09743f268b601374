"""PartOptimizers.step_unless: a skipped step leaves no trace, and fused optimizers queue the update before
the host's verdict; a run at lr 0 leaves every weight as it was."""

import json

import pytest
import torch
from torch import nn

from titan_train.plan import resolve
from titan_train.trainer import Trainer
from titan_train.wiring.lr_schedule import build_lr_scheduler
from titan_train.wiring.optimizers import PartOptimizers


def _parts(implementation: str) -> tuple[nn.Module, PartOptimizers]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizers = PartOptimizers(
        [model],
        lambda part: torch.optim.AdamW(
            part.parameters(), lr=0.1, fused=implementation == "fused", foreach=implementation == "foreach"
        ),
        lambda opt: build_lr_scheduler(
            opt, total_steps=10, warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.0
        ),
    )
    model(torch.randn(3, 4)).square().sum().backward()
    return model, optimizers


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_a_skipped_step_changes_no_weight_moment_step_count_or_learning_rate(implementation):
    model, optimizers = _parts(implementation)
    before = [p.detach().clone() for p in model.parameters()]
    lr = optimizers.lr
    assert not optimizers.step_unless(torch.ones(()), lambda: False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizers.lr == lr
    steps = [float(s["step"]) for s in optimizers.optimizers[0].state.values()]
    assert steps in ([], [0.0, 0.0])  # foreach never started; fused started and took the step back
    assert optimizers.step_unless(torch.zeros(()), lambda: True)
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert [float(s["step"]) for s in optimizers.optimizers[0].state.values()] == [1.0, 1.0]
    assert optimizers.lr != lr


@pytest.mark.parametrize(("implementation", "queued_first"), [("fused", True), ("foreach", False)])
def test_fused_update_is_queued_before_the_verdict_and_others_wait_for_it(implementation, queued_first):
    _, optimizers = _parts(implementation)
    seen = []
    optimizers.step_unless(torch.zeros(()), lambda: seen.append(bool(optimizers.optimizers[0].state)) or True)
    assert seen == [queued_first]


def test_fused_step_equals_a_plain_step_when_not_skipped():
    model, optimizers = _parts("fused")
    reference, reference_optimizers = _parts("fused")
    optimizers.step_unless(torch.zeros(()), lambda: True)
    reference_optimizers.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_lr_0_trains_without_moving_a_weight(tmp_path, small_config, one_rank):
    """torch's optimizers and torchtitan accept lr 0 (a run that measures without learning); so does Titan."""
    trainer = Trainer(
        resolve(
            small_config(
                tmp_path, "--optimizer.lr", "0", "--training.steps", "2", "--training.local_batch_size", "1"
            ),
            1,
            "cpu",
        ),
        one_rank,
    )
    before = {k: v.detach().clone() for k, v in trainer.model_parts[0].state_dict().items()}
    trainer.train()
    after = trainer.model_parts[0].state_dict()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records] == [0.0, 0.0] and all(r["grad_norm"] > 0 for r in records)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The steps were taken (AdamW's moments moved): only the size of the update is zero.
    assert all(float(s["step"]) == 2 for s in trainer.optimizers.optimizers[0].state.values())
