"""The on-disk layout: `step-N` folders, their in-progress `.partial` twins, and which ones are complete.

A checkpoint is written under `step-N.partial` and renamed to `step-N` once every rank has finished,
so a folder named `step-N` is always whole. Anything ending in `.partial` is debris from a crash (or
an old checkpoint being deleted) and is removed at the next start. Renaming a directory is atomic on
POSIX file systems, which is what makes a kill at any moment safe.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
PARTIAL_SUFFIX = ".partial"
DCP_METADATA = ".metadata"
HF_INDEX = "model.safetensors.index.json"
# A last save's model-only export in export_dtype, inside its step folder, beside the full state.
MODEL_ONLY_DIR = "model_only"


def step_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def partial_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step}{PARTIAL_SUFFIX}"


def is_hf_folder(path: Path) -> bool:
    return (path / HF_INDEX).is_file()


def is_complete(path: Path) -> bool:
    """A published step folder: DCP's `.metadata` (written last by DCP) or a Hugging Face index."""
    return (path / DCP_METADATA).is_file() or is_hf_folder(path)


def complete_steps(folder: str | Path) -> list[int]:
    """Steps with a finished checkpoint in `folder`, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and is_complete(entry):
            steps.append(int(match.group(1)))
    return sorted(steps)


def remove_partial_folders(folder: Path) -> list[Path]:
    """Delete the `.partial` folders an interrupted save left behind, warning about each one."""
    removed = []
    if not folder.is_dir():
        return removed
    for entry in sorted(folder.iterdir()):
        if entry.name.endswith(PARTIAL_SUFFIX):
            logger.warning("skipping and removing incomplete checkpoint %s (a save was interrupted)", entry)
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        elif STEP_DIR.match(entry.name) and not is_complete(entry):
            # Not written by us (we publish only whole folders): skip it but leave the user's files alone.
            logger.warning(
                "skipping %s: it has no %s, so it is not a complete checkpoint", entry, DCP_METADATA
            )
    return removed


def publish(partial: Path, final: Path) -> None:
    """Make a finished `.partial` folder visible as `final`, replacing an older folder of that name."""
    if final.exists():
        # Move the old one aside under a `.partial` name first: a kill between the two renames
        # leaves only debris that the next start removes, never a half-deleted `step-N`.
        doomed = final.with_name(final.name + ".replaced" + PARTIAL_SUFFIX)
        shutil.rmtree(doomed, ignore_errors=True)
        final.rename(doomed)
        partial.rename(final)
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        partial.rename(final)


def remove_step(folder: Path, step: int) -> None:
    """Delete `step-N` without ever leaving a half-deleted folder under its published name."""
    path = step_folder(folder, step)
    doomed = path.with_name(path.name + ".deleting" + PARTIAL_SUFFIX)
    path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def purge_old(folder: Path, keep_latest_k: int) -> list[int]:
    """Delete all but the newest `keep_latest_k` complete checkpoints (0 keeps all); return the steps removed."""
    if keep_latest_k == 0:
        return []
    doomed = complete_steps(folder)[:-keep_latest_k]
    for step in doomed:
        remove_step(folder, step)
        logger.info("removed old checkpoint step-%d (keep_latest_k=%d)", step, keep_latest_k)
    return doomed


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
