"""Run `titan-train` in this process and record what it did, for the field-coverage test.

`launch` goes through the command's own entry point (`titan_train.cli.run`), so every setting takes
the path it takes in a real run. One rank runs on a real gloo group; a larger layout runs as rank 0 of
torch's fake process group, which builds the real mesh and answers collectives without peers. Spies
on `Trainer.__init__` and `Trainer.train` record state at those two moments and pass through, and one
on the torch profiler's `step` records what it did in each step. `worker_counts` counts what data
loaders do with worker processes while an observer reads from them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader.stateful_dataloader import _StatefulMultiProcessingDataLoaderIter

from titan_train import cli
from titan_train.trainer import Trainer

FR_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE")


@dataclass
class Seen:
    """What one launch did: exit status, log lines, files, and the trainer at build and train time."""

    root: Path
    status: int = -1
    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    trainer: Trainer | None = None
    at_build: dict[str, Any] = field(default_factory=dict)
    at_train: dict[str, Any] = field(default_factory=dict)
    collections: int = 0  # full garbage collections while it trained
    profiler_steps: list[str] = field(default_factory=list)  # what the torch profiler did in each step

    @property
    def dump(self) -> Path:
        return self.root / "out"

    def log(self, needle: str) -> bool:
        return any(needle in line for line in self.lines)

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    def jsonl(self, name: str, drop: tuple[str, ...] = ()) -> list[dict]:
        path = self.dump / name
        if not path.exists():
            return []
        timing = ("tps", "tflops", "mfu", "data_time_s", "data_time_pct", "step_time_s", "time", "memory")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(timing) and k not in drop} for r in rows]

    @property
    def outcome(self) -> str | None:
        """The one-line error a refused run stopped with (None when it ran)."""
        return self.errors[0] if self.status == 2 and self.errors else None


class _Lines(logging.Handler):
    def __init__(self, seen: Seen):
        super().__init__(logging.INFO)
        self.seen = seen

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.seen.lines.append(message)
        if record.levelno >= logging.ERROR:
            self.seen.errors.append(message)


def group_timeout() -> float:
    """The default group's collective timeout, as its backend holds it."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


def launch(root: Path, argv: list[str], monkeypatch, *, world: int = 1, train: bool = False) -> Seen:
    """`titan-train ARGV` as rank 0 of `world`; without `train`, it stops once the trainer is built."""
    seen = Seen(root)
    root.mkdir(parents=True, exist_ok=True)
    assert not dist.is_initialized(), "a launch needs a process without a process group"
    with monkeypatch.context() as patch:
        for name in FR_VARIABLES:
            patch.delenv(name, raising=False)
        patch.setenv("RANK", "0")
        patch.setenv("LOCAL_RANK", "0")
        patch.setenv("WORLD_SIZE", str(world))
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        # Colours as on a terminal (stdout here is a capture): metrics.disable_color_printing's probe sees them.
        patch.setenv("FORCE_COLOR", "1")
        # No address: one rank forms its group on an in-process store (no port another process could
        # take first), and a fake group of `world` answers for the peers it does not have.
        patch.delenv("MASTER_ADDR", raising=False)
        patch.delenv("MASTER_PORT", raising=False)
        patch.chdir(root)
        patch.syspath_prepend(str(root))  # modules a probe writes there (custom_import)
        if "--fault_tolerance.enable" in argv:  # torchft's lighthouse, which the run asks for its quorums
            from titan_train.fault_tolerance import LIGHTHOUSE_ENV, start_lighthouse

            lighthouse = start_lighthouse(1)
            patch.setenv(LIGHTHOUSE_ENV, lighthouse.address())
            patch.setattr(seen, "lighthouse", lighthouse, raising=False)
        _spy(patch, seen, train)
        if world > 1:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        handler = _Lines(seen)
        root_logger = logging.getLogger()
        level = root_logger.level
        root_logger.addHandler(handler)
        root_logger.setLevel(logging.INFO)
        modules = set(sys.modules)
        try:
            seen.status = cli.run(argv)
        finally:
            if getattr(seen, "lighthouse", None) is not None:
                seen.lighthouse.shutdown()
            root_logger.removeHandler(handler)
            root_logger.setLevel(level)
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.use_deterministic_algorithms(False)
            for name in set(sys.modules) - modules:
                if name.startswith("probe_"):
                    del sys.modules[name]
    return seen


def _count_full_collections(seen: Seen) -> Callable:
    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.collections += 1

    return count


def _spy(patch, seen: Seen, train: bool) -> None:
    build, run = Trainer.__init__, Trainer.train

    def built(self, *args, **kwargs):
        build(self, *args, **kwargs)
        seen.trainer = self
        seen.at_build.update(
            timeout=group_timeout() if dist.get_backend() == "gloo" else None,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            modules=set(sys.modules),
            env={name: os.environ.get(name) for name in FR_VARIABLES},
            # The run's end closes the checkpointer and drops its staging buffers: seen here, as built.
            checkpoint_stager=type(getattr(self.checkpointer, "_stager", None)).__name__,
        )

    def trained(self):
        seen.at_train.update(timeout=group_timeout() if dist.get_backend() == "gloo" else None)
        if not train:
            return []
        counter = _count_full_collections(seen)
        gc.callbacks.append(counter)
        try:
            return run(self)
        finally:
            gc.callbacks.remove(counter)

    patch.setattr(Trainer, "__init__", built)
    patch.setattr(Trainer, "train", trained)
    profiler_step = torch.profiler.profile.step

    def stepped(self):
        seen.profiler_steps.append(self.current_action.name)  # NONE, WARMUP, RECORD, RECORD_AND_SAVE
        profiler_step(self)

    patch.setattr(torch.profiler.profile, "step", stepped)


def worker_counts(seen: Seen, read: Callable[[], Any]) -> dict[str, int]:
    """What loaders did with worker processes while `read()` ran in the launch's folder: the workers
    they started, and the windows they asked workers for (each one loaded ahead of the batch being
    stacked). A loader without workers: both 0."""
    counts = {"workers_started": 0, "windows_requested": 0}
    iterators = []
    workers = _StatefulMultiProcessingDataLoaderIter
    start, put = workers.__init__, workers._try_put_index

    def started(self, *args, **kwargs):
        start(self, *args, **kwargs)
        counts["workers_started"] += len(self._workers)
        iterators.append(self)

    def requested(self):
        sent = self._send_idx
        put(self)
        counts["windows_requested"] += self._send_idx - sent

    with pytest.MonkeyPatch.context() as patch, contextlib.chdir(seen.root):
        patch.setattr(workers, "__init__", started)
        patch.setattr(workers, "_try_put_index", requested)
        try:
            read()
        finally:
            # A loader keeps its last iterator, and the trainer's loader lives until garbage collection, where
            # its workers would miss the shutdown and be waited for 5 s each: end them now.
            for iterator in iterators:
                iterator._shutdown_workers()
    return counts
