"""Checkpoints of torchft replica groups laid out as torchtitan 0.2.2 lays them out.

Every group trains the same weights, so one full checkpoint (`checkpoint/step-N`: model, optimizer,
schedule, train state and that group's data position) is written by the group that is rank 0 of the
step's quorum; each group reads different data, so every group writes its own data position beside it
(`checkpoint/ft-replicat-{replica_id}/step-N`, torchtitan's folder name, spelling included). A whole-job
resume loads the full checkpoint in every group (its data position left out: it holds the writing group's
ranks only), then each group's own data position at that step.

The folder is shared by every group's job: a group that restarts must not tidy away the `.partial`
folder of a save another group has in flight (`titan_ckpt.Checkpointer(shared_folder=True)`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titan_ckpt import Checkpointer, LoadResult, complete_steps

logger = logging.getLogger(__name__)

DATALOADER = "dataloader"


def data_position_folder(checkpoint_folder: Path, replica_id: int) -> Path:
    """Where a group's data positions go: torchtitan's `ft-replicat-{id}` inside the checkpoint folder."""
    return checkpoint_folder / f"ft-replicat-{replica_id}"


class GroupCheckpointer:
    """The trainer's checkpointer under torchft: the shared full checkpoint (`full`, saved only while
    `writes()` is true for this group) and this group's data positions (`positions`, saved at the same
    steps by every group). Anything else is the full checkpointer's."""

    def __init__(self, full: Checkpointer, positions: Checkpointer, writes: Callable[[], bool]):
        self.full, self.positions, self._writes = full, positions, writes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.full, name)

    def _sync_loader(self) -> None:  # the trainer may rebuild its loader (adopted stream counts)
        self.positions.states[DATALOADER] = self.full.states[DATALOADER]

    def maybe_save(self, step: int, *, last_step: bool = False) -> bool:
        self._sync_loader()
        saved = self.positions.maybe_save(step, last_step=last_step)
        if self._writes():
            saved = self.full.maybe_save(step, last_step=last_step) or saved
        return saved

    def save(self, step: int, **how: Any) -> None:
        self._sync_loader()
        if not how.get("model_only"):
            self.positions.save(step, wait=how.get("wait", False))
        if self._writes():
            self.full.save(step, **how)

    def wait_for_staging(self) -> None:
        self.positions.wait_for_staging()
        self.full.wait_for_staging()

    def load(self, plan: LoadResult | None = None) -> LoadResult:
        """The full checkpoint, then this group's data position at its step (the newest one before it
        where this group was down when it was saved, said in the log)."""
        result = self.full.load(plan)
        if result.kind != "resumed" or result.step is None:
            return result
        self._sync_loader()
        steps = [s for s in complete_steps(self.positions.folder) if s <= result.step]
        if not steps:
            logger.warning(
                "fault tolerance: %s holds no data position of this replica group at or before step %d; "
                "its data starts from the beginning of its share",
                self.positions.folder,
                result.step,
            )
            return result
        step = steps[-1]
        if step != result.step:
            logger.warning(
                "fault tolerance: this replica group's newest data position at or before step %d is step %d "
                "(it was down when step %d was saved): it goes on from there",
                result.step,
                step,
                result.step,
            )
        folder = self.positions.step_folder(step)
        self.positions.load(
            LoadResult(
                "resumed",
                f"this replica group's data position from {folder}",
                step=step,
                path=folder,
                states=(DATALOADER,),
            )
        )
        return result

    def __enter__(self) -> GroupCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.positions.__exit__(*exc)
        self.full.__exit__(*exc)

    def close(self) -> None:
        self.positions.close()
        self.full.close()
