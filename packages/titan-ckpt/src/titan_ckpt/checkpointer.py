"""Periodic, atomic checkpoints of a training run on torch.distributed.checkpoint (DCP)."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from titan_ckpt.errors import CheckpointError

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
PARTIAL_SUFFIX = ".partial"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_steps(folder: Path) -> list[int]:
    """Steps with a finished checkpoint in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and (entry / ".metadata").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


class Checkpointer:
    """Saves `states` every `interval` steps into `folder/step-N` and resumes from the newest one.

    A checkpoint is written under `step-N.partial` and renamed to `step-N` only after every rank
    has finished writing, so a crash mid-save never leaves a folder that looks complete.
    """

    def __init__(
        self, folder: str | Path, states: dict[str, Stateful | Any], *, interval: int, keep_latest_k: int = 0
    ):
        if interval < 1:
            raise CheckpointError(f"checkpoint: interval must be >= 1, got {interval}")
        if keep_latest_k < 0:
            raise CheckpointError(
                f"checkpoint: keep_latest_k must be >= 0 (0 keeps all), got {keep_latest_k}"
            )
        self.folder = Path(folder)
        self.states = states
        self.interval = interval
        self.keep_latest_k = keep_latest_k

    def step_folder(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def load(self) -> int | None:
        """Restore the newest complete checkpoint; return its step, or None for a fresh start."""
        self._remove_partial_folders()
        steps = complete_steps(self.folder)
        if not steps:
            logger.info("no checkpoint in %s; fresh start", self.folder)
            return None
        step = steps[-1]
        path = self.step_folder(step)
        logger.info("resuming from %s", path)
        try:
            dcp.load(self.states, checkpoint_id=str(path))
        except Exception as err:  # DCP wraps per-rank failures; name the folder for the user.
            raise CheckpointError(f"checkpoint: cannot load {path}: {err}") from err
        return step

    def maybe_save(self, step: int, *, force: bool = False) -> bool:
        """Save at every `interval`-th step (or when forced); return whether a checkpoint was written."""
        if not force and step % self.interval:
            return False
        self.save(step)
        return True

    def save(self, step: int) -> None:
        final = self.step_folder(step)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()
        dcp.save(self.states, checkpoint_id=str(partial))
        _barrier()  # every rank has written its shards
        if _rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
            logger.info("saved checkpoint %s", final)
            self._purge_old()
        _barrier()

    def _remove_partial_folders(self) -> None:
        if _rank() == 0 and self.folder.is_dir():
            for entry in sorted(self.folder.iterdir()):
                if entry.name.endswith(PARTIAL_SUFFIX) or (
                    STEP_DIR.match(entry.name) and not (entry / ".metadata").exists()
                ):
                    logger.warning("removing incomplete checkpoint %s (a save was interrupted)", entry)
                    shutil.rmtree(entry, ignore_errors=True)
        _barrier()

    def _purge_old(self) -> None:
        if self.keep_latest_k == 0:
            return
        for step in complete_steps(self.folder)[: -self.keep_latest_k]:
            shutil.rmtree(self.step_folder(step), ignore_errors=True)
