"""Python garbage collection at fixed steps instead of whenever the allocator counts say so.

An automatic collection can start on any rank at any moment and stall it for tens of milliseconds;
in a synchronous job every other rank then waits. Collecting every `gc_freq` steps on all ranks at
once keeps that cost in one place.

Each scheduled collection is a full one. A young-generation collection promotes what it finds alive
to the oldest generation, which nothing collects while automatic collection is off, so cyclic garbage
that outlived one collection stayed for good: the metadata of every checkpoint saved in the
background, +2.2 MiB per 1,000 steps in `bench/soak.py` (bench/RESULTS.md). Everything built before
training (model, optimizer, libraries) is frozen first, so a full collection walks only the objects
the steps created and costs no more than a young one did.

Before freezing, only the young generations are collected (the build's garbage): a full collection there
walked the whole heap of torch and its libraries on every rank, 0.23 s in a fresh `titan-train` process,
to find 43 unreachable objects (2026-11-29). Older garbage stays frozen until `close()` hands it back.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


class GarbageCollection:
    """Turns automatic collection off and freezes what exists until `close()`; `step(n)` collects when
    the schedule says so."""

    def __init__(self, gc_freq: int, debug: bool = False):
        self.gc_freq, self.debug = gc_freq, debug
        self.was_enabled = gc.isenabled()
        gc.disable()
        gc.collect(1)
        gc.freeze()

    def step(self, step: int) -> None:
        if self.debug or step % self.gc_freq == 0:
            start = time.perf_counter()
            gc.collect()
            logger.debug("garbage collection at step %d took %.3f s", step, time.perf_counter() - start)

    def close(self) -> None:
        gc.unfreeze()
        if self.was_enabled:
            gc.enable()
