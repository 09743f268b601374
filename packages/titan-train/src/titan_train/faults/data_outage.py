"""A data source that stays unreachable mid-run: save the last completed step, stop with a retryable status.

titan-data retries dropped connections itself (exactly, see `titan_data.datasets.http_files`); what
reaches here is `SourceUnavailable`, raised once its retries ran out. The run then saves the last step
it completed, with the loader's position as it stood when that step ended (the failed step may have
taken micro-batches already), and stops with the status of a preemption (3): run the same command
again, or let SLURM requeue it (`RequeueExit=3`), and it resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from titan_data import SourceUnavailable
from titan_train.faults.exit_status import EarlyStop, Preempted


class DataUnavailable(EarlyStop):
    """The data source stopped answering; the last completed step was saved. Retryable, like a preemption."""

    exit_code = Preempted.exit_code
    log_level = Preempted.log_level


@contextlib.contextmanager
def stop_on_data_outage(step: int, checkpointer: Any | None, loader: Any | None = None) -> Iterator[None]:
    """Around the work of step `step + 1` (`loader` given: the training step, whose batches it rewinds) or
    after step `step` (validation): on `SourceUnavailable`, save step `step` and raise DataUnavailable.

    The loader's state is copied on entry, a few small pickled entries per step. With several ranks
    nothing is saved (see `_save_and_stop`).
    """
    at_start = loader.state_dict() if loader is not None else None
    try:
        yield
    except SourceUnavailable as err:
        if loader is not None:
            loader.load_state_dict(at_start)
        raise _save_and_stop(step, str(err), checkpointer) from None


def _save_and_stop(step: int, why: str, checkpointer: Any | None) -> DataUnavailable:
    # The save is collective, and the other ranks, whose sources still answer, are inside the next step:
    # a save would wait for them forever. This rank stops alone; the peer watch stops the others.
    alone = dist.is_initialized() and dist.get_world_size() > 1
    if checkpointer is None or checkpointer.saving.load_only or step == 0 or alone:
        reason = (
            "nothing was trained yet" if step == 0
            else "the other ranks are inside the next step; the newest checkpoint is the last interval save"
            if alone else "checkpointing is off"
        )  # fmt: skip
        return DataUnavailable(
            f"data unavailable: {why}; stopped after step {step} without saving ({reason}); run the same "
            "command again once the source answers"
        )
    start = time.perf_counter()
    checkpointer.close()  # publishes a background save still in flight, maybe of this very step
    if not any(timing.step == step for timing in checkpointer.timings):
        checkpointer.save(step, wait=True)
    return DataUnavailable(
        f"data unavailable: {why}; finished step {step} and saved {checkpointer.step_folder(step)} in "
        f"{time.perf_counter() - start:.1f} s; run the same command again to resume from it once the source "
        "answers"
    )
