"""What the trainer asks of a training objective, and what it hands one.

The trainer holds exactly one objective, which the plan names (`titan_train.objectives.registry`). Per
optimizer step it calls `begin_step` with the step's micro-batches (an objective that weighs a micro-batch
by its share of the step counts them there), `forward_backward` once per micro-batch, then `end_step` after
the gradients are in (its metrics for the step's log line, on every rank), and `log_metrics` on logged steps
(metrics gathered only when a line is written). `states` adds to the checkpoint, `start` runs once the
weights are loaded, `validator` measures held-out data. Gradient clipping, the optimizer, the step guard,
the MoE bias update and checkpoints stay the trainer's: they are the same for every objective.

Config-only refusals of an objective live in `titan_train.config` with the other rules; an objective's
constructor raises only for misuse by code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from titan_train.run_plan import RunPlan

Batch = tuple[torch.Tensor, ...]  # (inputs, labels, *what the data adds: positions, sequence, pair)


@runtime_checkable
class Validates(Protocol):
    """A held-out measurement every `validation.freq` steps (`titan_train.objectives.validation.Validator`)."""

    def should_validate(self, step: int) -> bool: ...

    def validate(self, model_parts: list[nn.Module]) -> Any: ...


@runtime_checkable
class TrainingObjective(Protocol):
    def states(self) -> dict[str, Any]:
        """Stateful entries the checkpoint saves and restores beside the model and optimizer."""
        ...

    def start(self, step: int, loader: Any) -> None:
        """The weights are loaded (step 0: a fresh start; later: a resume) and `loader` is the run's."""
        ...

    def begin_step(self, step_batches: list[Batch]) -> list[Batch] | None:
        """The step's micro-batches, before the first forward. An objective that trains on something the
        data only starts (learning from rewards: completions of the loader's prompts) returns the
        micro-batches to train on instead, (inputs, labels, ...) like the data's; None keeps the data's."""
        ...

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """One micro-batch's share of the step's loss, backpropagated; returned detached (a scalar)."""
        ...

    def end_step(self) -> dict[str, float]:
        """The step's own metrics, after its backward (every rank calls it: collectives are allowed)."""
        ...

    def log_metrics(self) -> dict[str, float]:
        """Metrics gathered only on logged steps (every rank calls it)."""
        ...

    def validator(self, batches: Callable[[], Iterable]) -> Validates | None:
        """The held-out measurement over `batches()` (validation.enable), or None."""
        ...


@runtime_checkable
class TakesBatchesAhead(Protocol):
    """An objective that trains a step on what it made from an earlier step's batches (learning from rewards
    one step off-policy: the next step's rollouts are generated during this one). Before each step the
    trainer asks it how many steps' micro-batches `begin_step` takes: 1 for an objective in step with its
    data, 2 when it must also start the pipeline, 0 when it only trains what it holds (the last step), so
    the data's saved position is always where the objective's saved state continues from."""

    def steps_of_batches(self, step: int) -> int: ...


@dataclass(frozen=True)
class ObjectiveContext:
    """What an objective is built from: the run's plan, this rank's model as built, its loader, and how
    to build another model laid out like it (a frozen reference) or unparallelised on the meta device
    (generation's whole copy, `titan_train.objectives.rollouts.WholeCopy`)."""

    plan: RunPlan
    device: torch.device
    parts: list[nn.Module]
    pipeline: Any  # titan_parallel's Pipeline under pipeline parallelism, else None
    train_loss_fn: Callable
    loss_fn: Callable
    token_weights: Any  # titan_train.wiring.valid_token_loss.ValidTokenWeights for chat rows, else None
    tokenizer: Any  # titan_data's Tokenizer of the run
    loader: Any  # as first built: a resume may deal the data into other streams, and `start` gets the run's
    forward_context: Callable  # autocast and the like around a forward (titan_train.wiring.precision)
    build_copy: Callable[[], Any]  # another BuiltModel of the same plan (parts and pipeline)
    build_whole: Callable[[], nn.Module]  # the model of one_process_plan, on the meta device
