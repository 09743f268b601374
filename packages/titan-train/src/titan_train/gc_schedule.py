"""Python garbage collection at fixed steps instead of whenever the allocator counts say so.

An automatic collection can start on any rank at any moment and stall it for tens of milliseconds;
in a synchronous job every other rank then waits. Collecting every `gc_freq` steps on all ranks at
once keeps that cost in one place.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


class GarbageCollection:
    """Turns automatic collection off until `close()`; `step(n)` collects when the schedule says so."""

    def __init__(self, gc_freq: int, debug: bool = False):
        self.gc_freq, self.debug = gc_freq, debug
        self.was_enabled = gc.isenabled()
        gc.disable()
        gc.collect(1)

    def step(self, step: int) -> None:
        if self.debug:
            gc.collect()
        elif step % self.gc_freq == 0:
            start = time.perf_counter()
            gc.collect(1)
            logger.debug("garbage collection at step %d took %.3f s", step, time.perf_counter() - start)

    def close(self) -> None:
        if self.was_enabled:
            gc.enable()
