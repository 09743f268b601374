"""Learning-rate schedule: linear warmup, an optional stable phase, then decay to a floor."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak lr for optimizer step `step` (1-based: the first step is 1).

    Warmup ramps linearly to 1 over `warmup_steps`; with `decay_ratio` the last
    `decay_ratio * total_steps` steps decay (warmup-stable-decay), else all steps after warmup do.
    """
    warmup_steps = min(warmup_steps, total_steps)
    if step <= warmup_steps:
        return step / (warmup_steps + 1)
    decay_steps = total_steps - warmup_steps if decay_ratio is None else round(total_steps * decay_ratio)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps <= 0:
        return 1.0
    progress = (step - decay_start) / decay_steps
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler: unknown decay_type '{decay_type}'")
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


def build_lr_scheduler(optimizer: Optimizer, **schedule) -> LambdaLR:
    """A LambdaLR whose epoch counter is the number of optimizer steps taken."""
    return LambdaLR(optimizer, lambda done: lr_factor(done + 1, **schedule))
