"""A data source that stays unreachable mid-run: save the last completed step, stop with a retryable status.

titan-data retries dropped connections itself (exactly, see `titan_data.datasets.http_files`); what
reaches here is `SourceUnavailable`, raised once its retries ran out. The run then saves the last step
it completed, with the loader's position as it stood when that step ended (the failed step may have
taken micro-batches already), and stops with the status of a preemption (3): run the same command
again, or let SLURM requeue it (`RequeueExit=3`), and it resumes where it stopped.

With several ranks, one rank's source can fail while the others' answer. Those others would already be
inside the step's collectives when the failing rank wants to save, and the save (itself collective)
would never meet them. So when the source is remote, every rank takes its step's batches before the
step's first collective (`StepBatches.fetch`) and the ranks agree, in one small all-reduce, that every
rank has them (`agree_on_batches`); if one has not, all save the last completed step together and stop.
Validation agrees on each batch the same way.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from titan_data import SourceUnavailable
from titan_train.faults.exit_status import EarlyStop, Preempted

Batch = tuple[torch.Tensor, torch.Tensor]


class DataUnavailable(EarlyStop):
    """The data source stopped answering; the last completed step was saved. Retryable, like a preemption."""

    exit_code = Preempted.exit_code
    log_level = Preempted.log_level


class AgreedOutage(SourceUnavailable):
    """Some rank's source is down and every rank knows it, at the same point: they can save together."""


def agree_on_batches(has_batch: bool, failure: str | None, device: torch.device) -> bool:
    """Whether every rank has a batch (a finite source may run out); every rank must call it together.

    `failure` is this rank's `SourceUnavailable` message if its source went down: then every rank
    raises `AgreedOutage` naming the lowest such rank and its source. One all-reduce of two numbers;
    the messages are gathered only after an outage.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if failure is not None:
            raise AgreedOutage(failure)
        return has_batch
    world = dist.get_world_size()
    flags = torch.tensor([int(has_batch), dist.get_rank() if failure is not None else world], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    first_down = int(flags[1].item())
    if first_down < world:
        messages: list[str | None] = [None] * world
        dist.all_gather_object(messages, failure)
        raise AgreedOutage(f"rank {first_down}'s source: {messages[first_down]}")
    return bool(flags[0].item())


class StepBatches(Iterator[Batch]):
    """A rank's batches, taken a whole step at a time when `agree` (remote data, several ranks).

    `fetch()`, called before a step's first collective, takes the step's `micro_batches` and agrees with
    the other ranks that each has them (see the module); the step then reads them with `next()`.
    Without `agree`, `fetch()` does nothing and `next()` reads the loader as the step goes.
    """

    def __init__(self, batches: Iterator[Batch], micro_batches: int, *, agree: bool, device: torch.device):
        self.batches, self.micro_batches, self.agree, self.device = batches, micro_batches, agree, device
        self.ready: deque[Batch] = deque()

    def fetch(self) -> float:
        """Take the next step's batches and agree that every rank has them; the seconds it took (data
        wait, the slowest rank's included). Raises `AgreedOutage` on every rank if any rank's source
        is down."""
        if not self.agree:
            return 0.0
        start, failure = time.perf_counter(), None
        try:
            while len(self.ready) < self.micro_batches:
                self.ready.append(next(self.batches))
        except StopIteration:
            pass  # a finite loader: the step reads the end itself, as without agreement
        except SourceUnavailable as err:
            failure = str(err)
        agree_on_batches(True, failure, self.device)
        return time.perf_counter() - start

    def __next__(self) -> Batch:
        return self.ready.popleft() if self.ready else next(self.batches)


@contextlib.contextmanager
def stop_on_data_outage(step: int, checkpointer: Any | None, loader: Any | None = None) -> Iterator[None]:
    """Around the work of step `step + 1` (`loader` given: the training step, whose batches it rewinds) or
    after step `step` (validation): on `SourceUnavailable`, save step `step` and raise DataUnavailable.

    The loader's state is copied on entry, a few small pickled entries per step. With several ranks the
    save needs an `AgreedOutage` (every rank stops here together); a rank whose source failed without
    one stops alone, unsaved (see `_save_and_stop`).
    """
    at_start = loader.state_dict() if loader is not None else None
    try:
        yield
    except SourceUnavailable as err:
        if loader is not None:
            loader.load_state_dict(at_start)
        raise _save_and_stop(step, str(err), checkpointer, agreed=isinstance(err, AgreedOutage)) from None


def _save_and_stop(step: int, why: str, checkpointer: Any | None, *, agreed: bool) -> DataUnavailable:
    # The save is collective. Unless the ranks agreed on the outage, the other ranks, whose sources
    # still answer, are inside the next step: a save would wait for them forever. This rank then stops
    # alone; the peer watch stops the others.
    alone = dist.is_initialized() and dist.get_world_size() > 1 and not agreed
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
