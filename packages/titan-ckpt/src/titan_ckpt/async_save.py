"""The three save modes and the bookkeeping of a save that is still being written in the background.

- `disabled`: `dcp.save`; training waits until the files are written.
- `async`: the state is copied into host staging buffers (kept and reused from one save to the
  next where torch allows it), then written by a background thread; training waits only for the copy.
- `async_with_pinned_mem`: the copy itself runs in the background too, into pinned memory on CUDA;
  training waits only if it reaches its next optimizer step before the copy is done.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from titan_ckpt.errors import CheckpointError

logger = logging.getLogger(__name__)

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


def check_async_mode(mode: str) -> None:
    if mode not in ASYNC_MODES:
        raise CheckpointError(f"checkpoint: async_mode '{mode}' is not one of {', '.join(ASYNC_MODES)}")


def build_stager(mode: str, *, warn: bool = True) -> DefaultStager | None:
    """The staging buffers for `mode` (None for synchronous saves); `warn` on the logging rank only."""
    check_async_mode(mode)
    if mode == "disabled":
        return None
    if mode == "async":
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
    pinned = torch.cuda.is_available()
    if not pinned and warn:
        logger.warning(
            "checkpoint: async_with_pinned_mem needs CUDA for pinned memory; without it the state is staged "
            "into ordinary memory, still on a background thread, so saves still do not block training"
        )
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=pinned,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=pinned,
        )
    )


def stager_for_next_save(stager: DefaultStager, mode: str) -> DefaultStager:
    """`stager` itself, or a fresh one for `mode` (closing `stager`) where a stager cannot stage twice.

    torch 2.11's `DefaultStager` empties its copier after each stage, so a second save through it
    fails (`KeyError: <class 'type'>`); there every save gets a new stager and no buffers are reused.
    Call it only once the previous save's staging has finished.
    """
    if _stager_stages_twice():
        return stager
    stager.close()
    return build_stager(mode, warn=False)


@functools.cache
def _stager_stages_twice() -> bool:
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"step": torch.zeros(1), "kind": int})
    except KeyError:
        return False
    finally:
        stager.close()
    return True


def snapshot_objects(state: Any) -> Any:
    """A copy of `state`'s containers and non-tensor values, sharing the tensors.

    A background copy reads the state after `save` has returned; by then the data loader or a
    scheduler may have moved on, so their plain values are frozen now. Tensors change only at the
    next optimizer step, which waits for the copy.
    """
    if isinstance(state, torch.Tensor):
        return state
    if isinstance(state, Mapping):
        return {key: snapshot_objects(value) for key, value in state.items()}
    if isinstance(state, list):
        return [snapshot_objects(value) for value in state]
    return copy.deepcopy(state)


@dataclass
class SaveTiming:
    """How long one save held training up, and how long it took to reach disk."""

    step: int
    blocked_s: float
    total_s: float
    bytes_written: int | None = None  # known on the rank that publishes the folder


@dataclass
class PendingSave:
    """A save whose files are still being written by the background thread."""

    step: int
    partial: Path
    final: Path
    upload: Future
    staging: Future | None
    started: float
    blocked_s: float
    waited_for_staging: bool = field(default=False)
    finished: float | None = None

    def mark_finished(self, _: Future) -> None:
        self.finished = time.perf_counter()

    def wait_for_staging(self) -> None:
        if self.staging is None or self.waited_for_staging:
            return
        start = time.perf_counter()
        self.staging.result()
        self.blocked_s += time.perf_counter() - start
        self.waited_for_staging = True
