"""Numerical faults: a non-finite loss or gradient norm stops the run or skips the update; loss spikes are reported.

The check runs on every rank with the same global numbers (the loss averaged over ranks, the gradient
norm already reduced over every mesh), so all ranks reach the same verdict without talking. Only when
something is non-finite do the ranks exchange their own numbers, to name the rank it came from.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

from titan_train.faults.exit_status import NonFiniteError

logger = logging.getLogger(__name__)

FIX = (
    "lower optimizer.lr or training.max_norm, look at the data of that step, or set health.on_nonfinite = skip "
    "to skip such updates"
)


@dataclass(frozen=True)
class RankNumbers:
    """One rank's own view of a step: its local loss (None where it computes none) and its first bad gradient."""

    rank: int
    loss: float | None
    bad_gradient: str | None


class NumericsGuard:
    """Judges each step's global loss and gradient norm: finite, spike, skip or stop."""

    def __init__(
        self,
        *,
        on_nonfinite: str,
        max_skipped_steps: int,
        loss_spike_ratio: float,
        loss_spike_window: int,
        report: bool = True,
    ):
        if max_skipped_steps < 0:
            raise ValueError(f"max_skipped_steps must be >= 0, got {max_skipped_steps}")
        if loss_spike_ratio != 0 and loss_spike_ratio <= 1:
            raise ValueError(f"loss_spike_ratio must be above 1 (or 0: off), got {loss_spike_ratio}")
        if loss_spike_window < 1:
            raise ValueError(f"loss_spike_window must be at least 1, got {loss_spike_window}")
        self.on_nonfinite = on_nonfinite
        self.max_skipped_steps = max_skipped_steps
        self.spike_ratio = loss_spike_ratio
        self.recent: deque[float] = deque(maxlen=loss_spike_window)
        self.report = report  # rank 0 logs spikes and skips; every rank raises the same stop
        self.skipped_steps: list[int] = []

    @staticmethod
    def finite(loss: float | None, grad_norm: float) -> bool:
        return math.isfinite(grad_norm) and (loss is None or math.isfinite(loss))

    def observe(self, step: int, loss: float | None) -> None:
        """Report `loss` if it is a spike over the recent mean, then add it to the baseline."""
        if loss is None:
            return
        if self.spike_ratio and len(self.recent) == self.recent.maxlen:
            baseline = sum(self.recent) / len(self.recent)
            if baseline > 0 and loss > self.spike_ratio * baseline and self.report:
                logger.warning(
                    "loss spike at step %d: %.4f is %.1fx the mean %.4f of the previous %d steps "
                    "(health.loss_spike_ratio = %g)",
                    step,
                    loss,
                    loss / baseline,
                    baseline,
                    len(self.recent),
                    self.spike_ratio,
                )
        self.recent.append(loss)

    def nonfinite(self, step: int, loss: float | None, grad_norm: float, ranks: list[RankNumbers]) -> bool:
        """A non-finite step: return True to skip its update, or raise NonFiniteError to stop."""
        what = describe(step, loss, grad_norm, ranks)
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"{what}; stopping (health.on_nonfinite = stop). Fix: {FIX}")
        self.skipped_steps.append(step)
        if len(self.skipped_steps) > self.max_skipped_steps:
            raise NonFiniteError(
                f"{what}; that is {len(self.skipped_steps)} skipped updates (steps "
                f"{', '.join(map(str, self.skipped_steps))}), more than health.max_skipped_steps = "
                f"{self.max_skipped_steps}; stopping. Fix: {FIX.split(', or set')[0]}"
            )
        if self.report:
            logger.warning(
                "%s; skipped this update (%d of at most %d, health.on_nonfinite = skip)",
                what,
                len(self.skipped_steps),
                self.max_skipped_steps,
            )
        return True


def describe(step: int, loss: float | None, grad_norm: float, ranks: list[RankNumbers]) -> str:
    """`non-finite at step 3: loss nan on rank 1 (finite on ranks 0), gradient norm nan, ...` in one line."""
    parts = []
    bad_loss = [r for r in ranks if r.loss is not None and not math.isfinite(r.loss)]
    if bad_loss:
        good = [r.rank for r in ranks if r.loss is not None and math.isfinite(r.loss)]
        where = ", ".join(f"{r.loss} on rank {r.rank}" for r in bad_loss)
        parts.append(f"loss {where}" + (f" (finite on ranks {_ranks(good)})" if good else ""))
    elif loss is not None and not math.isfinite(loss):
        parts.append(f"mean loss {loss}")
    parts.append(f"gradient norm {grad_norm}")
    bad_grads = [r for r in ranks if r.bad_gradient]
    if bad_grads and not bad_loss:
        first = bad_grads[0]
        parts.append(f"first non-finite gradient {first.bad_gradient} on rank {first.rank}")
    return f"non-finite numbers at step {step}: " + ", ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"
