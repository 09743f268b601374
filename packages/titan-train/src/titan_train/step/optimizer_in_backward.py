"""The optimizer step taken in backward (`optimizer.early_step_in_backward`), one parameter at a time.

Each parameter gets its own optimizer, stepped by a post-accumulate-grad hook as soon as its gradient
is final (under FSDP, after the reduce-scatter), and its gradient is freed at once: a step never holds
every gradient. With `training.max_norm > 0` the clipping factor needs the norm of all gradients
before any parameter moves, so each step runs backward twice: the first pass only measures the norm
(each gradient freed after adding its square), the second clips and steps. The update is then the
one clipped step of one process. What cannot be exact is refused: accumulation over micro-batches,
pipeline schedules, and skipping a non-finite step after parameters have moved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

from titan_train.wiring.optimizers import SchedulesState


def step_in_backward_problems(config: Any, grad_accum_steps: int) -> list[str]:
    """The settings under which stepping in backward would not give the step of one process, for the
    plan's check (the first one, so the line names one fix)."""
    if not config.optimizer.early_step_in_backward:
        return []
    reasons = []
    if grad_accum_steps > 1:
        reasons.append(
            f"gradient accumulation ({grad_accum_steps} micro-batches) needs every micro-batch's gradient "
            "before the step; set training.global_batch_size to local_batch_size * data-parallel degree"
        )
    if config.parallelism.pipeline_parallel_degree > 1:
        reasons.append(
            "a pipeline schedule runs the backward of its stages itself; set pipeline_parallel_degree = 1"
        )
    if config.health.on_nonfinite == "skip":
        reasons.append(
            "a non-finite step cannot be skipped after parameters moved; set health.on_nonfinite = 'stop'"
        )
    return [f"config: optimizer.early_step_in_backward: {reasons[0]}"] if reasons else []


class BackwardStepOptimizers:
    """One optimizer and LR schedule per parameter, stepped from its gradient hook during backward."""

    def __init__(
        self,
        parts: list[nn.Module],
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        make_schedule: Callable[[torch.optim.Optimizer], LRScheduler],
    ):
        self.per_part: list[list[torch.optim.Optimizer]] = []
        self._optimizer_of: dict[nn.Parameter, torch.optim.Optimizer] = {}
        for part in parts:
            mine: list[torch.optim.Optimizer] = []
            for param in part.parameters():
                if param.requires_grad:
                    self._optimizer_of[param] = make_optimizer([param])
                    mine.append(self._optimizer_of[param])
                    param.register_post_accumulate_grad_hook(self._hook)
            self.per_part.append(mine)
        self.schedules = [make_schedule(o) for o in self._optimizer_of.values()]
        self.measuring, self.clip_coef = False, 1.0
        self._squares: list[torch.Tensor] = []

    @property
    def optimizers(self) -> list[list[torch.optim.Optimizer]]:
        """Per model part, its parameters' optimizers (DCP's optimizer state dict takes such a list)."""
        return self.per_part

    @property
    def lr(self) -> float:
        return next(iter(self._optimizer_of.values())).param_groups[0]["lr"]

    @torch.no_grad()
    def _hook(self, param: nn.Parameter) -> None:
        grad = param.grad
        norm = torch.linalg.vector_norm(grad, dtype=torch.float64)  # before clipping, as logged
        self._squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
        if not self.measuring:
            if self.clip_coef != 1.0:
                grad.mul_(self.clip_coef)
            self._optimizer_of[param].step()
        param.grad = None

    def measure(self, backward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run `backward` with the hooks only adding up squared gradient norms; return the total norm."""
        self.measuring = True
        try:
            return self._run(backward)[1]
        finally:
            self.measuring = False

    def step(
        self, backward: Callable[[], torch.Tensor], clip_coef: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `backward` stepping each parameter (gradients scaled by `clip_coef`), then the LR schedules;
        return the loss and the gradient norm before clipping."""
        self.clip_coef = clip_coef
        loss, norm = self._run(backward)
        for schedule in self.schedules:
            schedule.step()
        return loss, norm

    def _run(self, backward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        self._squares = []
        loss = backward()
        return loss, torch.stack(self._squares).sum().sqrt().float()

    def zero_grad(self) -> None:
        for optimizer in self._optimizer_of.values():
            optimizer.zero_grad()

    def schedule_state(self) -> Stateful:
        return SchedulesState(self.schedules)
