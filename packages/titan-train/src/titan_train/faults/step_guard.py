"""The trainer's per-step fault checks: numerics, preemption and drills, agreed through one small all-gather.

Between gradient clipping and the optimizer step, every rank shares `[its loss, 1 if it has one, one count
per preemption signal it received]` in one all-gather. From what it gathers every rank reads the same
mean and max loss (the logged loss, the spike report, the non-finite check with the already global
gradient norm) and the same "a signal arrived somewhere", so all ranks skip the same update and stop
after the same step, and the log line needs no collective of its own. On a GPU this costs one tiny
collective per step, and the host's wait for its result overlaps the optimizer step where the
optimizer can skip an update on the device (fused Adam/AdamW: see `PartOptimizers.step_unless`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titan_train.config.health_section import Health, parse_signals
from titan_train.faults.drills import FaultDrills
from titan_train.faults.numerics import NumericsGuard, RankNumbers
from titan_train.faults.preemption import PreemptionSignals, save_and_stop

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgreedNumbers:
    """A step's numbers as every rank reads them: the mean and max loss over the ranks that have one
    (None where none has), the gradient norm, and how many ranks received each preemption signal."""

    loss_mean: float | None
    loss_max: float | None
    grad_norm: float
    signal_counts: list[float]


@dataclass
class StepNumbers:
    """What `StepGuard.agree` queued for one step: `[loss sum, ranks with a loss, signals..., grad norm,
    loss max]` (in host memory once `copied` has fired), the device flag `skip`, and this rank's own loss."""

    values: torch.Tensor
    skip: torch.Tensor
    copied: torch.cuda.Event | None
    own_loss: torch.Tensor | None

    def read(self) -> AgreedNumbers:
        """The numbers on the host (waiting for their copy on CUDA)."""
        if self.copied is not None:
            self.copied.synchronize()
        loss_sum, n_losses, *signal_counts, norm, loss_max = self.values.tolist()
        if not n_losses:
            return AgreedNumbers(None, None, norm, signal_counts)
        return AgreedNumbers(loss_sum / n_losses, loss_max, norm, signal_counts)


class StepGuard:
    """Hooks the trainer calls around each step; see the module docstring for the agreement they rely on."""

    def __init__(
        self,
        health: Health,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        drills: FaultDrills | None = None,
        watched_parts: Sequence[nn.Module] = (),
    ):
        """`drills`: the run's fault drills (built before the model, whose loss a nan drill wraps);
        `watched_parts`: the model parts whose gradients a non-finite step names."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.numerics = NumericsGuard(
            on_nonfinite=health.on_nonfinite,
            max_skipped_steps=health.max_skipped_steps,
            loss_spike_ratio=health.loss_spike_ratio,
            loss_spike_window=health.loss_spike_window,
            report=rank == 0,
        )
        self.signals = PreemptionSignals(parse_signals(health.preemption_signals))
        self.drills = drills if drills is not None else FaultDrills(health, rank=rank, world_size=world_size)
        self.watched_parts = watched_parts
        self.stop_signal: int | None = None  # agreed by every rank
        self.step = 0  # the step in progress, or the last one finished
        self.phase = "starting"

    def install(self) -> None:
        """Start recording preemption signals (call before training, from the main thread)."""
        self.signals.__enter__()

    def uninstall(self) -> None:
        self.signals.__exit__()

    def __enter__(self) -> StepGuard:
        """`install` for the length of a `with` block."""
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def position(self) -> str:
        """Where training is, for a hang report from another thread."""
        return f"step {self.step} ({self.phase})"

    def begin_step(self, step: int) -> None:
        self.step, self.phase = step, "forward/backward"
        self.drills.before_step(step, signalled=lambda: self.signals.received is not None)

    def update_allowed(
        self, step: int, loss: torch.Tensor | None, grad_norm: torch.Tensor, *, has_loss: bool = True
    ) -> bool:
        """After clipping, before the optimizer step: False to skip this update; raises NonFiniteError to stop.

        `loss` is this rank's loss of the step (None, or `has_loss=False`, on ranks that compute none,
        such as pipeline stages before the last). Waits for the numbers: `agree` then `decide` lets the
        device run the update (skipped on the device where it must be) while the host waits.
        """
        return self.decide(step, self.agree(loss, grad_norm, has_loss=has_loss))

    def agree(
        self, loss: torch.Tensor | None, grad_norm: torch.Tensor, *, has_loss: bool = True
    ) -> StepNumbers:
        """Queue the step's agreement on the device; nothing waits for it.

        Every rank's `[loss, has a loss, signal counts]` is gathered, then summed (and the loss maxed)
        over ranks; `skip` is a device flag, 1 where the global loss or the gradient norm is not finite,
        which fused optimizers take as `found_inf` to skip the update themselves. The numbers are copied
        to host memory behind an event, so reading them (`decide`, `StepNumbers.read`) waits only for
        that copy, not for work queued later.
        """
        self.phase = "agreeing on the step's health"
        has_loss = has_loss and loss is not None
        counts = [float(self.signals.received == sig) for sig in self.signals.signals]
        # From pinned memory without waiting: a copy from pageable memory would make the host wait
        # for the whole backward pass before it could queue the optimizer step.
        values = _to_device(torch.tensor([0.0, float(has_loss), *counts], dtype=torch.float64), self.device)
        if has_loss:
            values[0] = loss.detach().double().reshape(())
        ranks = values.reshape(1, -1)
        if self.world_size > 1 and dist.is_initialized():
            gathered = torch.empty(self.world_size * values.numel(), dtype=values.dtype, device=values.device)
            dist.all_gather_into_tensor(gathered, values)
            ranks = gathered.reshape(self.world_size, -1)
        sums = ranks.sum(0)
        loss_max = torch.where(ranks[:, 1] > 0, ranks[:, 0], -torch.inf).max().reshape(1)
        norm = grad_norm.detach().double().reshape(1).to(self.device)
        skip = (~torch.isfinite(sums[0]) | ~torch.isfinite(norm[0])).float()
        numbers = torch.cat([sums, norm, loss_max])
        if self.device.type != "cuda":
            return StepNumbers(numbers, skip, None, loss if has_loss else None)
        host = torch.empty(numbers.shape, dtype=numbers.dtype, pin_memory=True)
        host.copy_(numbers, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return StepNumbers(host, skip, copied, loss if has_loss else None)

    def decide(self, step: int, numbers: StepNumbers) -> bool:
        """The host's verdict on numbers from `agree`: False to skip this update; raises NonFiniteError
        to stop. Every rank reads the same sums, so every rank reaches the same verdict."""
        agreed = numbers.read()
        mean_loss, signal_counts, norm = agreed.loss_mean, agreed.signal_counts, agreed.grad_norm
        if self.stop_signal is None:
            arrived = [
                sig for sig, count in zip(self.signals.signals, signal_counts, strict=True) if count > 0
            ]
            if arrived:
                self.stop_signal = int(arrived[0])
                if self.rank == 0:
                    logger.warning(
                        "%s received (by %d of %d ranks): every rank stops after step %d and saves a checkpoint",
                        arrived[0].name,
                        int(sum(signal_counts)),
                        self.world_size,
                        step,
                    )
        self.phase = "optimizer step"
        if self.numerics.finite(mean_loss, norm):
            self.numerics.observe(step, mean_loss)
            return True
        ranks = self._gather_rank_numbers(numbers.own_loss)
        return not self.numerics.nonfinite(step, mean_loss, norm, ranks)

    def end_step(self, step: int, *, last_step: bool, checkpointer: Any | None) -> None:
        """After the step and its checkpoint: run a kill drill; on an agreed signal, save and raise Preempted."""
        self.phase = "between steps"
        self.drills.after_step(step)
        if self.stop_signal is not None and not last_step:
            self.phase = "saving the preemption checkpoint"
            raise save_and_stop(step, self.stop_signal, checkpointer)

    def _gather_rank_numbers(self, loss: torch.Tensor | None) -> list[RankNumbers]:
        """Every rank's own loss and first non-finite gradient (only on the rare non-finite step)."""
        mine = RankNumbers(
            self.rank,
            None if loss is None else float(loss.detach().float().item()),
            _first_bad_gradient(named for part in self.watched_parts for named in part.named_parameters()),
        )
        if self.world_size == 1 or not dist.is_initialized():
            return [mine]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        return gathered


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, queued from pinned memory on CUDA so that the host does not wait for it."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _first_bad_gradient(named_parameters: Iterable[tuple[str, nn.Parameter]]) -> str | None:
    for name, param in named_parameters:
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if not bool(torch.isfinite(local).all()):
            return name
    return None
