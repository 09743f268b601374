"""Torch profiler traces and CUDA memory snapshots, every `profile_freq` steps, under the dump folder."""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SNAPSHOT_ENTRIES = 100_000


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def maybe_profile(
    *, enabled: bool, folder: Path, freq: int, warmup: int, active: int, rank: int, first_step: int
) -> Iterator[torch.profiler.profile | _NoProfiler]:
    """A profiler whose `step()` the loop calls once per training step; a no-op when not `enabled`.

    Each cycle of `freq` steps waits, warms up for `warmup` steps and records `active` steps, then
    writes `folder/iteration_N/rank{rank}_trace.json` (Chrome trace format) where N is the step the
    window ended on. `first_step` is the step training (re)starts from, so names stay right on resume.
    """
    if not enabled:
        yield _NoProfiler()
        return

    def write_trace(prof: torch.profiler.profile) -> None:
        step = first_step + prof.step_num
        out = folder / f"iteration_{step}"
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"rank{rank}_trace.json"))
        logger.info("profiler trace of step %d written to %s", step, out)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=freq - warmup - active, warmup=warmup, active=active)
    with torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=write_trace, record_shapes=True
    ) as prof:
        yield prof


class MemorySnapshots:
    """Records the CUDA caching allocator's history and dumps it every `freq` steps (CUDA only).

    Open a dump in https://pytorch.org/memory_viz to see every allocation with its stack.
    """

    def __init__(self, *, enabled: bool, folder: Path, freq: int, rank: int):
        self.enabled, self.folder, self.freq, self.rank = enabled, folder, freq, rank
        if enabled:
            torch.cuda.memory._record_memory_history(max_entries=_SNAPSHOT_ENTRIES)

    def step(self, step: int) -> None:
        if self.enabled and step % self.freq == 0:
            self.dump(f"iteration_{step}")

    def dump(self, name: str) -> Path:
        out = self.folder / name
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{self.rank}_memory_snapshot.pickle"
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info("memory snapshot written to %s", path)
        return path

    def close(self) -> None:
        if self.enabled:
            torch.cuda.memory._record_memory_history(enabled=None)
