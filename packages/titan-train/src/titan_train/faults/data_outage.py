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

The agreement runs over a gloo group of its own, on the host: a rank whose source is down retries for
minutes (`titan_data.RetryPolicy`) before it gives up, longer than training's collective timeout, and
its peers must wait for it in the agreement rather than time out. On a GPU it also keeps the step's
flag off the device, so the host does not wait for the previous step to finish before queueing the next.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from titan_data import RetryPolicy, SourceUnavailable
from titan_train.faults.exit_status import EarlyStop, Preempted

Batch = tuple[torch.Tensor, torch.Tensor]


class DataUnavailable(EarlyStop):
    """The data source stopped answering; the last completed step was saved. Retryable, like a preemption."""

    exit_code = Preempted.exit_code
    log_level = Preempted.log_level


class AgreedOutage(SourceUnavailable):
    """Some rank's source is down and every rank knows it, at the same point: they can save together."""


def agree_on_batches(
    has_batch: bool, failure: str | None, device: torch.device, group: dist.ProcessGroup | None = None
) -> bool:
    """Whether every rank has a batch (a finite source may run out); every rank must call it together.

    `failure` is this rank's `SourceUnavailable` message if its source went down: then every rank
    raises `AgreedOutage` naming the lowest such rank and its source. One all-reduce of two numbers;
    the messages are gathered only after an outage. `group`: the ranks that agree (default: all), each
    named by its rank in the group.
    """
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        if failure is not None:
            raise AgreedOutage(failure)
        return has_batch
    world = dist.get_world_size(group)
    flags = torch.tensor(
        [int(has_batch), dist.get_rank(group) if failure is not None else world], device=device
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    first_down = int(flags[1].item())
    if first_down < world:
        messages: list[str | None] = [None] * world
        dist.all_gather_object(messages, failure, group=group)
        raise AgreedOutage(f"rank {first_down}'s source: {messages[first_down]}")
    return bool(flags[0].item())


class StepBatches(Iterator[Batch]):
    """A rank's batches, taken a whole step at a time when `agree` (remote data, several ranks).

    `fetch()`, called before a step's first collective, takes the step's `micro_batches` and agrees with
    the other ranks that each has them (see the module); the step then reads them with `next()`.
    Without `agree`, `fetch()` does nothing and `next()` reads the loader as the step goes. With it,
    every rank must construct it together (it makes the agreement's group, see the module).
    """

    def __init__(self, batches: Iterator[Batch], micro_batches: int, *, agree: bool):
        self.batches, self.micro_batches, self.agree = batches, micro_batches, agree
        self.ready: deque[Batch] = deque()
        self.group = dist.new_group(backend="gloo", timeout=_outage_timeout()) if agree else None

    def fetch(self, steps: int = 1) -> float:
        """Take the next step's batches (`steps` steps' worth: an objective may take them ahead) and agree
        that every rank has them; the seconds it took (data wait, the slowest rank's included). Raises
        `AgreedOutage` on every rank if any rank's source is down."""
        if not self.agree:
            return 0.0
        start, failure = time.perf_counter(), None
        try:
            while len(self.ready) < self.micro_batches * steps:
                self.ready.append(next(self.batches))
        except StopIteration:
            pass  # a finite loader: the step reads the end itself, as without agreement
        except SourceUnavailable as err:
            failure = str(err)
        agree_on_batches(True, failure, torch.device("cpu"), self.group)
        return time.perf_counter() - start

    def __next__(self) -> Batch:
        return self.ready.popleft() if self.ready else next(self.batches)


def _outage_timeout() -> dt.timedelta:
    """How long a rank may wait for its peers' batches: the longest a source may take before it is called
    unavailable (every try timing out on connect and on read, every backoff), and ten minutes for the
    tokenizing and packing of a step's batches."""
    policy = RetryPolicy.from_env()
    tries = policy.attempts + 1
    waiting = sum(policy.wait(n) for n in range(1, tries))
    return dt.timedelta(seconds=tries * 2 * policy.timeout_s + waiting + 600)


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
            "nothing was trained yet"
            if step == 0
            else "the other ranks are inside the next step; the newest checkpoint is the last interval save"
            if alone
            else "checkpointing is off"
        )
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
