"""One step off-policy for learning from rewards (`grpo.max_staleness = 1`): step t trains on a batch that
the weights before step t - 1 generated, against that generating policy's log-probs.

Per step t, on the weights after t - 1 optimizer steps: the batch it trains is the one held since step
t - 1 (the first step, holding none, generates its own, on-policy); the next step's prompts, which the
trainer hands over a step ahead (`TakesBatchesAhead`), are generated now, on these weights; step t + 1 trains
that batch one optimizer step later. The titan engine generates in the training processes: there nothing
overlaps, the generation runs at the start of the step and the old log-probs come from a forward right
after it, on the same weights. The vllm engine's request runs in a `Background` thread while the step
trains and is joined at its end, before the optimizer step (so a checkpoint after the step holds the
batch); its old log-probs are those vLLM sampled the tokens at.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def steps_of_batches(staleness: int, holds_batch: bool, step: int, last_step: int) -> int:
    """How many steps' prompts step `step` takes: its own unless a batch is held for it, and the next
    step's unless it is the last (a run saved at its last step holds nothing ahead)."""
    if staleness == 0:
        return 1
    return (0 if holds_batch else 1) + (1 if step < last_step else 0)


class Background:
    """`fn()` in a daemon thread, its start and end on the `perf_counter` clock; `result()` joins it and
    raises what it raised."""

    def __init__(self, fn: Callable[[], Any]):
        self.started = self.ended = time.perf_counter()
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        self.started = time.perf_counter()
        try:
            self._value = fn()
        except BaseException as err:  # handed to the joining thread
            self._error = err
        self.ended = time.perf_counter()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
