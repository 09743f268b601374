"""Learning-rate schedule: linear warmup, a stable phase, then decay toward a floor.

The schedule is torchtitan 0.2.2's, step for step, so a run moved from torchtitan trains at the same
learning rates. Over `T` schedule steps (1-based training steps `s`):

- warmup `W = min(warmup_steps, T)` steps at `s / W` (the peak at step `W`; none when `W = 0`);
- decay `D` steps: `T - W`, or `round(decay_ratio * T)` cut to `T - W` when warmup and decay overlap;
- the peak in between, through step `T + 1 - D`: the schedule is laid out over `T + 1` steps, so
  the last step trains `1/D` of the way above the floor instead of at it;
- decay at step `s`: progress `p = (s - (T + 1 - D)) / D`, factor `m + (1 - m) * shape(p)` with
  `m = min_lr_factor` and shape `1 - p` (linear), `1 - sqrt(p)` (sqrt) or `(1 + cos(pi p)) / 2` (cosine).

A LambdaLR's counter is the number of optimizer steps taken, so training step `s` runs at the factor
for `s - 1` steps taken. The arithmetic keeps torchtitan's order of operations: the rates equal its
rates to the bit, not only to rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

DECAY_TYPES = ("linear", "sqrt", "cosine")


@dataclass(frozen=True)
class ScheduleSteps:
    """The lengths of the schedule's phases (steps), after the adjustments torchtitan makes."""

    warmup: int
    stable: int  # counts the one virtual step past the end
    decay: int


def schedule_steps(total_steps: int, warmup_steps: int, decay_ratio: float | None) -> ScheduleSteps:
    """Phase lengths for a `total_steps` schedule: warmup cut to the schedule, decay cut to what remains."""
    warmup = min(warmup_steps, total_steps)
    decay = total_steps - warmup
    if decay_ratio is not None:
        decay = min(round(total_steps * decay_ratio), total_steps - warmup)
    return ScheduleSteps(warmup=warmup, stable=total_steps + 1 - warmup - decay, decay=decay)


def lr_factor(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak lr for training step `step` (1-based: the first step is 1)."""
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"lr_scheduler: unknown decay_type '{decay_type}'; choose from {DECAY_TYPES}")
    phases = schedule_steps(total_steps, warmup_steps, decay_ratio)
    if step <= phases.warmup:
        return float(step / phases.warmup)
    peak_until = phases.warmup + phases.stable  # the last step at the peak
    if step <= peak_until or phases.decay == 0:
        return 1.0
    # Past the schedule's end (never trained: total_steps >= training.steps) the floor holds.
    progress = min(float(step - peak_until) / phases.decay, 1.0)
    if decay_type == "linear":
        remaining = 1 - progress
    elif decay_type == "sqrt":
        remaining = 1 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1 - min_lr_factor) * remaining


def build_lr_scheduler(optimizer: Optimizer, **schedule) -> LambdaLR:
    """A LambdaLR over `optimizer` whose counter is the number of optimizer steps taken.

    A plain function (not a bound method or partial) as the lambda: LambdaLR saves a callable object's
    attributes in its state dict, which would change the checkpoint's keys.
    """
    return LambdaLR(optimizer, lambda done: lr_factor(done + 1, **schedule))
