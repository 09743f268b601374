"""Preemption: SIGTERM / SIGUSR1 make every rank finish the current step, save a checkpoint and exit.

A signal handler may run between any two bytecodes, so it only records which signal came; the
training loop acts on it at a step boundary, once all ranks have agreed (`StepGuard` carries the
signal through its per-step all-reduce, so a signal that reached one rank stops them all at the same
step). SLURM sends SIGTERM on preemption and, with `sbatch --signal=USR1@SECONDS`, SIGUSR1 before the
time limit; torchrun forwards SIGTERM to its workers (and SIGUSR1 with `--signals-to-handle`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from titan_train.faults.exit_status import Preempted

logger = logging.getLogger(__name__)


class PreemptionSignals:
    """Records the first preemption signal while active (`with signals: ...`); restores the old handlers after."""

    def __init__(self, signals: list[signal.Signals]):
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> PreemptionSignals:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("preemption signals are not handled: training runs outside the main thread")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)


def save_and_stop(step: int, signum: int, checkpointer: Any | None) -> Preempted:
    """Save step `step` (unless it is saved already) and return the Preempted stop to raise.

    Every rank calls this at the same step, so the collective save lines up. `checkpointer` is the
    run's titan-ckpt Checkpointer, or None when checkpointing is off.
    """
    name = signal.Signals(signum).name
    if checkpointer is None or checkpointer.saving.load_only:
        why = "checkpoint.enable is false" if checkpointer is None else "checkpoint.load_only is true"
        return Preempted(
            f"preempted: {name} received; stopped after step {step} without saving ({why}), so a rerun starts "
            "from the last checkpoint there is; enable checkpointing to resume where preemption stops a run"
        )
    start = time.perf_counter()
    checkpointer.close()  # publishes a background save still in flight, maybe of this very step
    if not any(timing.step == step for timing in checkpointer.timings):
        checkpointer.save(step, wait=True)
    return Preempted(
        f"preempted: {name} received; finished step {step} and saved {checkpointer.step_folder(step)} in "
        f"{time.perf_counter() - start:.1f} s; run the same command again to resume from it"
    )
