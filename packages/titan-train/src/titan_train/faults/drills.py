"""Fault drills: make one rank fail on purpose at a chosen step, to rehearse (and test) recovery.

`[health] drill = kill` SIGKILLs the rank after the step (as an out-of-memory kill or a lost node would),
`nan` turns its loss into NaN at the step, `hang` makes it stop responding before the step's
collectives, `stall` holds it before the step until a preemption signal arrives (a run waiting for its
time limit, without spending the steps: the signal then stops every rank after that step, with a
checkpoint). Under torchrun, kill, hang and stall fire only on the first attempt
(TORCHELASTIC_RESTART_COUNT 0), so the restarted group can show that it recovers.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from titan_train.config.health_section import Health

logger = logging.getLogger(__name__)


class FaultDrills:
    """The drill configured in `[health]`, armed on the rank it targets."""

    def __init__(self, health: Health, *, rank: int, world_size: int):
        self.kind, self.step = health.drill, health.drill_step
        if self.kind == "none":
            self.armed = False
            return
        # drill_step >= 1 (config/health_section.py) and drill_rank < world_size (config/run_checks.py)
        # were checked at start.
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.armed = rank == health.drill_rank and (first_attempt or self.kind == "nan")
        self.current_step = 0
        if self.armed:
            logger.warning("fault drill armed: %s on rank %d at step %d", self.kind, rank, self.step)

    @property
    def poisons_loss(self) -> bool:
        """Whether a nan drill is armed on this rank."""
        return self.armed and self.kind == "nan"

    def poison_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss, or NaN in its place at the nan drill's step (gradients then turn NaN too)."""
        if self.armed and self.kind == "nan" and step == self.step:
            logger.warning("fault drill: loss of step %d set to NaN", step)
            return loss * float("nan")
        return loss

    def loss_with_drill(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`loss_fn`, or where a nan drill is armed on this rank, `loss_fn` whose loss is NaN at the drill's
        step (the step `before_step` last began)."""
        if not self.poisons_loss:
            return loss_fn

        def poisoned(*args: Any) -> torch.Tensor:
            return self.poison_loss(self.current_step, loss_fn(*args))

        return poisoned

    def before_step(self, step: int, signalled: Callable[[], bool] = lambda: False) -> None:
        """Begin `step`: run a hang or stall drill; `signalled()` tells whether a preemption signal has come."""
        self.current_step = step
        if self.armed and self.kind == "hang" and step == self.step:
            logger.warning("fault drill: stopping to respond before step %d", step)
            while True:  # as a rank stuck in a driver call would; only a signal or a kill ends it
                time.sleep(60)
        if self.armed and self.kind == "stall" and step == self.step:
            logger.warning("fault drill: waiting before step %d until a preemption signal arrives", step)
            while not signalled():  # the other ranks wait in the step's first collective meanwhile
                time.sleep(0.1)

    def after_step(self, step: int) -> None:
        if self.armed and self.kind == "kill" and step == self.step:
            logger.warning("fault drill: SIGKILL after step %d", step)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)
