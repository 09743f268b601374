"""A new training objective is one module: this file defines one, registers it once, and trains it through
`titan-train` without an edit to any other file (issue 58).

The objective, `unpaired_kto`, is a reference-free, KTO-style loss on unpaired rows labelled desirable or
undesirable. Its rows come from preference pairs split in two, as the KTO paper trains on paired data: each
chosen completion is a desirable row, each rejected one an undesirable row. For a row with completion tokens
y_1..y_n after its prompt x, its reward is r = beta * (1/n) * sum_t log p(y_t | x, y_<t) (length-normalised,
no reference model), and its loss, against the reference point z,

    desirable:    1 - sigmoid(r - z)
    undesirable:  1 - sigmoid(z - r)

averaged over every row of the step (all micro-batches and data-parallel ranks). z is KTO's reference point,
here a running mean of the rewards: after each step z <- 0.9 z + 0.1 * (the step's mean reward). z is the
objective's own state: it is saved with the checkpoint, so a resumed run continues with the z it left off at.

`test_a_registered_objective_trains_and_resumes_bit_for_bit`: killed after step 3 (a fault drill) and resumed
from its step-2 checkpoint, its logged steps and its weights at step 4 equal an uninterrupted run's, bit for bit.
Planted once (2026-12-02): `states()` returning {} (z left out of the checkpoint) fails it: the resumed step 3
trains against z = 0 (loss 0.4880, z -0.995) instead of the saved z (loss 0.3403, z -3.646).
`test_the_loss_is_the_formula_above` checks the objective's vectorised loss against a loop over rows that
computes the formula from log-softmax.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titan_train.objectives.forward import model_forward, whole_sequence_context
from titan_train.objectives.preference_loss import sequence_logps
from titan_train.objectives.preference_step import global_sequences
from titan_train.objectives.protocol import ObjectiveContext
from titan_train.objectives.registry import register_objective

BETA, MOMENTUM = 2.0, 0.9


def row_losses(logits, labels, sequence, rows: int, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (numbered across the batch in `sequence`: even desirable, odd undesirable): loss and reward."""
    logps = sequence_logps(logits, labels, sequence, rows)
    rewards = BETA * logps.sums / logps.counts.clamp_min(1)
    desirable = torch.arange(rows, device=rewards.device) % 2 == 0
    losses = torch.where(desirable, 1 - torch.sigmoid(rewards - z), 1 - torch.sigmoid(z - rewards))
    return losses, rewards.detach()


class ReferencePoint:
    """KTO's z as a Stateful the checkpoint keeps."""

    def __init__(self):
        self.z = torch.zeros((), dtype=torch.float64)

    def state_dict(self) -> dict:
        return {"z": self.z}

    def load_state_dict(self, state: dict) -> None:
        self.z = state["z"].clone()


class UnpairedKTO:
    """The objective (see the module docstring); every method is one the trainer calls."""

    def __init__(self, ctx: ObjectiveContext):
        self.ctx, self.point = ctx, ReferencePoint()
        dp = ctx.plan.dims.submesh("dp")
        self.group, self.dp_degree = (dp.get_group() if dp else None), ctx.plan.dims.dp_degree

    def states(self) -> dict:
        return {"kto_reference_point": self.point}

    def start(self, step: int, loader) -> None:
        pass

    def begin_step(self, step_batches) -> None:
        rows = sum(2 * global_sequences(seq)[1] for _, _, _, seq, *_ in step_batches)
        count = torch.tensor([float(rows)], dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(count, group=self.group)
        self.rows = float(count.clamp_min(1))
        self.reward_sum = torch.zeros((), dtype=torch.float64)

    def forward_backward(self, batch) -> torch.Tensor:
        inputs, labels, positions, sequence, *_ = batch
        sequence, pairs = global_sequences(sequence)
        with whole_sequence_context(self.ctx.plan, self.ctx.forward_context):
            logits = model_forward(self.ctx.parts, inputs, positions)
            losses, rewards = row_losses(logits, labels, sequence, 2 * pairs, self.point.z.float())
            loss = losses.sum() * (self.dp_degree / self.rows)
        loss.backward()
        self.reward_sum += rewards.double().sum()
        return loss.detach()

    def end_step(self) -> dict[str, float]:
        if self.group is not None:
            dist.all_reduce(self.reward_sum, group=self.group)
        mean = self.reward_sum / self.rows
        self.point.z = MOMENTUM * self.point.z + (1 - MOMENTUM) * mean
        return {"kto/reward": float(mean), "kto/z": float(self.point.z)}

    def log_metrics(self) -> dict[str, float]:
        return {}

    def validator(self, batches):
        return None


register_objective("unpaired_kto", UnpairedKTO)

HERE = Path(__file__).resolve().parent


def _pairs(path: Path) -> None:
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
            "chosen": [{"role": "assistant", "content": f"It is {a + b}."}],
            "rejected": [{"role": "assistant", "content": f"Maybe {a * b + 1}, or not at all."}],
        }
        for a, b in ((1, 2), (2, 2), (3, 4), (5, 1), (6, 2), (7, 3), (2, 9), (4, 4))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _train(tmp: Path, dump: str, *extra: str) -> subprocess.CompletedProcess:
    flags = [
        *("--job.dump_folder", str(tmp / dump), "--training.objective", "unpaired_kto"),
        *("--experimental.custom_import", "test_new_objective", "--training.dataset", "preference"),
        *("--training.dataset_path", str(tmp / "pairs.jsonl"), "--training.seq_len", "128"),
        *("--training.local_batch_size", "2", "--training.steps", "4", "--activation_checkpoint.mode", "none"),
        *("--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--metrics.disable_color_printing"),
        *("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"),
        *("--metrics.enable_tensorboard", "false", "--optimizer.lr", "1e-2"),
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "titan_train.cli", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _model(folder: Path) -> dict[str, torch.Tensor]:
    out = folder.parent / f"{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(out))
    state = torch.load(out, weights_only=False)
    model = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}  # the model's entries are flat
    assert len(model) > 10
    return model


def test_a_registered_objective_trains_and_resumes_bit_for_bit(tmp_path):
    _pairs(tmp_path / "pairs.jsonl")
    whole = _train(tmp_path, "whole")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    killed = _train(tmp_path, "resumed", "--health.drill", "kill", "--health.drill_step", "3")
    assert killed.returncode != 0 and (tmp_path / "resumed" / "checkpoint" / "step-2").is_dir()
    assert not (tmp_path / "resumed" / "checkpoint" / "step-4").exists()
    resumed = _train(tmp_path, "resumed")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]

    def records(dump: str) -> list[dict]:
        return [json.loads(line) for line in (tmp_path / dump / "metrics.jsonl").read_text().splitlines()]

    whole_records, resumed_records = records("whole"), records("resumed")
    assert [r["step"] for r in whole_records] == [r["step"] for r in resumed_records] == [1, 2, 3, 4]
    assert all(
        "kto/z" in r and "kto/reward" in r for r in whole_records
    )  # the objective's metrics are logged
    assert whole_records[0]["loss"] != whole_records[-1]["loss"]  # it trained
    keys = ("loss", "grad_norm", "kto/z", "kto/reward")
    assert [[r[k] for k in keys] for r in resumed_records] == [[r[k] for k in keys] for r in whole_records]

    expected = _model(tmp_path / "whole" / "checkpoint" / "step-4")
    got = _model(tmp_path / "resumed" / "checkpoint" / "step-4")
    assert sorted(got) == sorted(expected)
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert different == [], f"{len(different)} tensors differ after the resume, e.g. {different[:3]}"


def test_the_loss_is_the_formula_above():
    g = torch.Generator().manual_seed(0)
    vocab, seq_len = 11, 12
    logits = torch.randn(2, seq_len, vocab, generator=g)
    labels = torch.randint(0, vocab, (2, seq_len), generator=g)
    labels[:, :3] = -100  # the prompt is not a completion token
    # Row 0 of the batch holds sequences 0 (desirable) and 1 (undesirable); row 1 holds 2 and 3.
    sequence = torch.tensor([[0] * 6 + [1] * 5 + [-1], [2] * 4 + [3] * 8])
    z = torch.tensor(0.3)
    losses, rewards = row_losses(logits, labels, sequence, 4, z)

    logp = F.log_softmax(logits, dim=-1)
    for row in range(4):
        terms = [
            logp[b, t, labels[b, t]]
            for b in range(2)
            for t in range(seq_len)
            if sequence[b, t] == row and labels[b, t] != -100
        ]
        reward = BETA * sum(terms) / len(terms)
        loss = 1 - torch.sigmoid(reward - z) if row % 2 == 0 else 1 - torch.sigmoid(z - reward)
        torch.testing.assert_close(rewards[row], reward)
        torch.testing.assert_close(losses[row], loss)
