"""Python garbage collection at fixed steps instead of whenever the allocator counts say so.

An automatic collection can start on any rank at any moment and stall it for tens of milliseconds;
in a synchronous job every other rank then waits. Collecting every `gc_freq` steps on all ranks at
once keeps that cost in one place.

Each scheduled collection is a full one. A young-generation collection promotes what it finds alive
to the oldest generation, which nothing collects while automatic collection is off, so cyclic garbage
that outlived one collection stayed for good: the metadata of every checkpoint saved in the
background, +2.2 MiB per 1,000 steps in `bench/soak.py` (bench/RESULTS.md).

What a full collection costs is what it walks. `titan-train` freezes the process's heap once it has
checked the config (`libraries_frozen`): torch and the libraries, about 350,000 objects, 0.23 s per
full collection on this machine (2026-11-29). The collections of the run, the scheduled ones and the one
that frees the model before the last barrier, then walk only what the run built and what its steps
made: an 8B dense model with AdamW's states is 7,400 objects (1.7 ms); a 405B model added beside them makes
31,000 (10 ms). Garbage that was already old at the freeze stays frozen until the run ends, then goes back
to the collector.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def libraries_frozen() -> Iterator[None]:
    """Keep every object that exists now (after the young generations are collected) out of every
    collection until the block ends. A heap someone froze before (an embedding application) stays frozen:
    Python can only unfreeze everything."""
    frozen_before = gc.get_freeze_count() > 0
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


class GarbageCollection:
    """Turns automatic collection off until `close()`; `step(n)` collects when the schedule says so.
    The start collects the young generations only (the build's garbage): the rest goes at the first
    scheduled collection, and a full one here would walk the whole heap where no one froze it (a
    `Trainer` built in a test)."""

    def __init__(self, gc_freq: int, debug: bool = False):
        self.gc_freq, self.debug = gc_freq, debug
        self.was_enabled = gc.isenabled()
        gc.disable()
        gc.collect(1)

    def step(self, step: int) -> None:
        if self.debug or step % self.gc_freq == 0:
            start = time.perf_counter()
            gc.collect()
            logger.debug("garbage collection at step %d took %.3f s", step, time.perf_counter() - start)

    def close(self) -> None:
        if self.was_enabled:
            gc.enable()
