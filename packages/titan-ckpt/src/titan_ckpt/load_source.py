"""What a run loads at start, decided once and said out loud.

Precedence: a checkpoint in the run's own folder (the newest complete one, or `load_step`), then
`initial_load_path`, then nothing. An `initial_load_path` that loses to an existing checkpoint is
named in a warning: a run that silently ignores the weights a user pointed it at is how week-long
jobs train from scratch by accident.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from titan_ckpt.errors import CheckpointError
from titan_ckpt.step_folders import DCP_METADATA, complete_steps, is_hf_folder, step_folder

logger = logging.getLogger(__name__)

MODEL = "model"


@dataclass(frozen=True)
class LoadResult:
    """Where the run's state came from: kind is "resumed", "model_only", "initial" or "fresh"."""

    kind: str
    message: str
    step: int | None = None
    path: Path | None = None
    states: tuple[str, ...] = ()
    hf: bool = False

    def with_note(self, note: str) -> LoadResult:
        """The same decision, its message extended by `note` (what the caller adapted to it)."""
        return replace(self, message=f"{self.message}; {note}")


@dataclass(frozen=True)
class InitialLoad:
    """Weights to start from when the run's folder holds no checkpoint."""

    path: str | None = None
    model_only: bool = True
    in_hf: bool = False


def choose_source(
    folder: Path,
    wanted: Sequence[str],
    present_states: Callable[[Path], set[str]],
    *,
    load_step: int = -1,
    initial: InitialLoad = InitialLoad(),
) -> LoadResult:
    """Decide what to load. `wanted` are the state names to restore; `present_states(path)` lists
    the non-model states a checkpoint folder holds."""
    steps = complete_steps(folder)
    if load_step >= 0:
        if load_step not in steps:
            raise CheckpointError(
                f"checkpoint: load_step = {load_step}, but {folder} has no complete step-{load_step} "
                f"(complete: {', '.join(f'step-{s}' for s in steps) or 'none'}); pick one of those or set -1"
            )
        return _from_step(folder, load_step, wanted, present_states, explicit=True)
    if steps:
        if initial.path:
            logger.warning(
                "checkpoint: initial_load_path %s is NOT loaded: %s already holds step-%d, which takes "
                "precedence (use another checkpoint folder to start from %s)",
                initial.path,
                folder,
                steps[-1],
                initial.path,
            )
        newest = _from_step(folder, steps[-1], wanted, present_states, explicit=False)
        if newest.kind != "model_only":
            return newest
        for step in reversed(steps[:-1]):
            older = _from_step(folder, step, wanted, present_states, explicit=False)
            if older.kind == "resumed":
                logger.warning(
                    "checkpoint: step-%d holds only model weights (a seed or last_save_model_only checkpoint) "
                    "and cannot resume training; using step-%d, the newest full checkpoint",
                    steps[-1],
                    step,
                )
                return older
        return newest
    if initial.path:
        return _from_initial_path(folder, wanted, initial)
    return LoadResult("fresh", f"no checkpoint in {folder}; fresh start")


def _from_step(
    folder: Path,
    step: int,
    wanted: Sequence[str],
    present_states: Callable[[Path], set[str]],
    *,
    explicit: bool,
) -> LoadResult:
    path = step_folder(folder, step)
    hf = is_hf_folder(path) and not (path / DCP_METADATA).is_file()
    present = set() if hf else present_states(path)
    others = [name for name in wanted if name != MODEL]
    if MODEL in wanted and others and not present & set(others):
        return LoadResult(
            "model_only",
            f"loading model weights only from step-{step} in {folder} (it holds no optimizer or training "
            "state); training starts at step 0 from these weights",
            step,
            path,
            (MODEL,),
            hf,
        )
    how = " (checkpoint.load_step)" if explicit else ""
    return LoadResult("resumed", f"resuming from step-{step}{how} in {folder}", step, path, tuple(wanted), hf)


def _from_initial_path(folder: Path, wanted: Sequence[str], initial: InitialLoad) -> LoadResult:
    path = Path(initial.path)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint: initial_load_path {path} does not exist; fix the path, or unset it to start fresh"
        )
    if initial.in_hf:
        if not initial.model_only:
            raise CheckpointError(
                "checkpoint: initial_load_in_hf loads model weights only; set initial_load_model_only = true"
            )
        states: tuple[str, ...] = (MODEL,)
        kind = "Hugging Face model weights"
    else:
        if not (path / DCP_METADATA).is_file():
            raise CheckpointError(
                f"checkpoint: initial_load_path {path} is not a DCP checkpoint (no {DCP_METADATA}); for "
                "Hugging Face safetensors set initial_load_in_hf = true"
            )
        states = (MODEL,) if initial.model_only else tuple(wanted)
        kind = "model weights" if initial.model_only else "full training state"
    return LoadResult(
        "initial",
        f"no checkpoint in {folder}; loading initial weights from {path} ({kind})",
        None,
        path,
        states,
        initial.in_hf,
    )
