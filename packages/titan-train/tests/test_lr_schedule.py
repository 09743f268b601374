"""The lr schedule is torchtitan 0.2.2's: values worked out by hand from its published formula, every
combination of its knobs through the builder the trainer uses, and the lr a real run logs each step."""

import itertools
import json
import logging
import math
from dataclasses import replace

import pytest
import torch

from titan_train.config import load_job_config
from titan_train.config.schema import LRScheduler
from titan_train.plan import resolve
from titan_train.trainer import Trainer
from titan_train.wiring.lr_schedule import lr_factor
from titan_train.wiring.optimizers import build_lr_schedule, build_optimizer


def _f(step, **kw):
    args = dict(total_steps=10, warmup_steps=2, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)
    return lr_factor(step, **{**args, **kw})


def _curve(total_steps, **kw):
    return [_f(s, total_steps=total_steps, **kw) for s in range(1, total_steps + 1)]


# Worked by hand. T = 10, W = 2, no decay_ratio: D = T - W = 8 decay steps and one stable (virtual)
# step, so the peak holds through step T + 1 - D = 3, and step s decays by (s - 3) / 8.
def test_warmup_reaches_the_peak_at_its_last_step_and_the_last_step_is_above_the_floor():
    assert _curve(10) == pytest.approx([0.5, 1, 1, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125])
    # min_lr_factor 0.2 scales the decay into [0.2, 1]: step 10 is 0.2 + 0.8 * 0.125.
    assert _f(10, min_lr_factor=0.2) == pytest.approx(0.3)
    assert _f(2, min_lr_factor=0.2) == 1.0  # warmup is not scaled


def test_no_warmup_starts_at_the_peak():
    # W = 0, T = 4: D = 4, the peak holds through step 1, then (s - 1) / 4 of the decay.
    assert _curve(4, warmup_steps=0) == pytest.approx([1, 0.75, 0.5, 0.25])


def test_warmup_longer_than_the_schedule_is_cut_to_it():
    assert _curve(4, warmup_steps=6) == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_warmup_stable_decay():
    # decay_ratio 0.4 of T = 10: D = 4, stable 10 + 1 - 2 - 4 = 5 steps: the peak through step 7.
    assert _curve(10, decay_ratio=0.4) == pytest.approx([0.5, 1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25])
    assert _f(10, decay_ratio=0.4, min_lr_factor=0.2) == pytest.approx(0.2 + 0.8 * 0.25)
    # decay_ratio 0: no decay at all.
    assert _curve(10, decay_ratio=0.0) == [0.5] + [1.0] * 9


def test_decay_steps_round_half_to_even_as_python_does():
    # 0.25 * 10 = 2.5 rounds to 2 (not 3): the peak through step 9, then step 10 halfway down.
    assert _curve(10, decay_ratio=0.25)[-3:] == pytest.approx([1, 1, 0.5])


def test_decay_overlapping_warmup_is_cut_to_the_steps_warmup_leaves():
    # T = 8, W = 4, decay_ratio 0.75 asks 6 decay steps; 4 remain: the peak through step 5.
    assert _curve(8, warmup_steps=4, decay_ratio=0.75) == pytest.approx(
        [0.25, 0.5, 0.75, 1, 1, 0.75, 0.5, 0.25]
    )


@pytest.mark.parametrize(
    ("kind", "at_quarter", "at_half"),
    [("linear", 0.75, 0.5), ("sqrt", 0.5, 1 - math.sqrt(0.5)), ("cosine", 0.5 + math.sqrt(2) / 4, 0.5)],
)
def test_decay_shapes(kind, at_quarter, at_half):
    # T = 10, decay_ratio 0.4: steps 8 and 9 are 1/4 and 1/2 of the way through the decay.
    assert _f(8, decay_ratio=0.4, decay_type=kind) == pytest.approx(at_quarter)
    assert _f(9, decay_ratio=0.4, decay_type=kind) == pytest.approx(at_half)


def _published(total, warmup, decay_ratio, decay_type, floor):
    """torchtitan 0.2.2's schedule as its docs and config describe it, in its own terms: a factor per
    optimizer steps taken (`done`, 0-based), phases of warmup, stable (one virtual step past the end)
    and decay. Written for this test from the formula, independently of lr_schedule.py."""
    warmup = min(warmup, total)
    decay = total - warmup if decay_ratio is None else min(round(total * decay_ratio), total - warmup)
    stable = total + 1 - warmup - decay

    def factor(done):
        if done < warmup:
            return (done + 1) / warmup
        if done < warmup + stable:
            return 1.0
        p = (done + 1 - warmup - stable) / decay
        shape = {"linear": 1 - p, "sqrt": 1 - math.sqrt(p), "cosine": 0.5 * (1 + math.cos(math.pi * p))}
        return floor + (1 - floor) * shape[decay_type]

    return factor


def _flags(total_steps, warmup, decay_ratio, decay_type, floor, steps):
    flags = [
        "--training.steps",
        str(steps),
        "--lr_scheduler.warmup_steps",
        str(warmup),
        "--lr_scheduler.decay_ratio",
        "none" if decay_ratio is None else str(decay_ratio),
        "--lr_scheduler.decay_type",
        decay_type,
        "--lr_scheduler.min_lr_factor",
        str(floor),
    ]
    if total_steps is not None:
        flags += ["--lr_scheduler.total_steps", str(total_steps)]
    return flags


COMBINATIONS = list(
    itertools.product(
        [None, 13],  # lr_scheduler.total_steps (training.steps 9)
        [0, 1, 3, 9, 20],  # warmup_steps
        [None, 0.0, 0.3, 0.5, 1.0],  # decay_ratio
        ["linear", "sqrt", "cosine"],
        [0.0, 0.1],  # min_lr_factor
    )
)


def test_every_combination_through_the_trainers_builder_follows_the_published_schedule():
    base = load_job_config(["--training.steps", "9"])
    for total_steps, warmup, decay_ratio, decay_type, floor in COMBINATIONS:
        # Set in place (loading a config per combination costs seconds); the schedule reads only these.
        schedule_config = LRScheduler(
            warmup_steps=warmup,
            total_steps=total_steps,
            decay_ratio=decay_ratio,
            decay_type=decay_type,
            min_lr_factor=floor,
        )
        config = replace(base, lr_scheduler=schedule_config)
        optimizer = build_optimizer(config, torch.nn.Linear(2, 2))
        schedule = build_lr_schedule(config, optimizer, config.training.steps)
        expected = _published(total_steps or 9, warmup, decay_ratio, decay_type, floor)
        for done in range(9):
            peak = config.optimizer.lr
            assert optimizer.param_groups[0]["lr"] == pytest.approx(
                peak * expected(done), rel=1e-12, abs=0
            ), (
                total_steps,
                warmup,
                decay_ratio,
                decay_type,
                floor,
                done + 1,
            )
            optimizer.step()
            schedule.step()


def test_decay_cut_short_by_warmup_is_said(caplog):
    with caplog.at_level(logging.WARNING):
        load_job_config(_flags(None, 4, 0.75, "linear", 0.0, steps=8))
    assert "lr_scheduler.decay_ratio (0.75) asks for 6 decay steps, but 4 warmup steps leave 4" in caplog.text
    assert "decay is shortened to 4 steps" in caplog.text


# Through the real trainer: the lr each step logs in metrics.jsonl is the one it trained at. One run
# (seconds on CPU) crosses warmup, the stable phase and a decay with a floor in a schedule longer than it.
@pytest.mark.slow
def test_metrics_jsonl_logs_the_published_lr_at_every_step(tmp_path, small_config, one_rank):
    flags = _flags(total_steps=6, warmup=2, decay_ratio=0.5, decay_type="cosine", floor=0.1, steps=5)
    Trainer(
        resolve(small_config(tmp_path, *flags, "--training.local_batch_size", "1"), 1, "cpu"), one_rank
    ).train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    # T = 6, W = 2, D = 3: the peak through step 4; step 5 is 1/3 into the cosine: 0.1 + 0.9 * 0.75.
    assert [r["lr"] for r in records] == pytest.approx([3e-3 * f for f in (0.5, 1, 1, 1, 0.775)], rel=1e-12)
    published = _published(6, 2, 0.5, "cosine", 0.1)
    assert [r["lr"] for r in records] == [3e-3 * published(done) for done in range(5)]
