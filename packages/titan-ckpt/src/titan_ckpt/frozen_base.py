"""Checkpoints without a frozen base: a run that trains a few weights (LoRA adapters) over many frozen ones.

Saving the frozen weights every interval costs disk and time for nothing: they never change. A periodic
save then holds the trained weights, the optimizer and the run's other states, and a small record,
`frozen_base.json`, naming where the frozen weights came from: the run's `initial_load_path` (Hugging
Face or DCP), or, with none, the run's own initialisation (`origin`, e.g. the model and its seed). A
resume reads the base from that source again, then the step folder over it; a source that is gone, or
an initialisation that differs, is refused before anything is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from titan_ckpt.errors import CheckpointError
from titan_ckpt.load_source import InitialLoad

FROZEN_BASE_FILE = "frozen_base.json"


@dataclass(frozen=True)
class FrozenBase:
    """The model state-dict `keys` that never train, and `origin`: what builds them when the run has no
    `initial_load_path` (a resume checks it is the same). With `trainable_only_saves`, periodic saves
    leave those keys out; the last save and model-only saves always hold the whole model."""

    keys: frozenset[str]
    origin: str
    trainable_only_saves: bool = True


@dataclass(frozen=True)
class BaseSource:
    """Where a trainable-only checkpoint's frozen base is read from: `initial` (None: the run's own
    initialisation, already in the model) and whether those are block-quantised Hugging Face files."""

    initial: InitialLoad | None
    quantized: bool = False


def write_record(folder: Path, frozen: FrozenBase, initial: InitialLoad, quantized: bool) -> None:
    """`frozen_base.json` in `folder` (a step folder being written): the base's source."""
    record = {
        "initial_load_path": str(Path(initial.path).resolve()) if initial.path else None,
        "initial_load_in_hf": initial.in_hf,
        "initial_load_in_hf_quantized": quantized,
        "origin": frozen.origin,
        "frozen_tensors": len(frozen.keys),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FROZEN_BASE_FILE).write_text(json.dumps(record, indent=2) + "\n")


def holds_frozen_base(step: Path) -> bool:
    """Whether the step folder `step` holds the whole model (no trainable-only record)."""
    return not (step / FROZEN_BASE_FILE).is_file()


def base_source(step: Path, frozen: FrozenBase | None) -> BaseSource | None:
    """Where to read the frozen base of the checkpoint in `step` from (None: the checkpoint holds it).

    Refuses a source that is gone, and a run whose own initialisation differs from the one recorded."""
    path = step / FROZEN_BASE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint: cannot read {path} ({err}); delete {step} to resume from an older one"
        ) from err
    source = record.get("initial_load_path")
    if source:
        if not Path(source).exists():
            raise CheckpointError(
                f"checkpoint: {step} holds the trained weights only; its frozen base comes from {source} "
                "(initial_load_path when it was saved), which does not exist: put it back there, or resume from "
                "a checkpoint that holds the whole model"
            )
        initial = InitialLoad(source, model_only=True, in_hf=bool(record.get("initial_load_in_hf")))
        return BaseSource(initial, bool(record.get("initial_load_in_hf_quantized")))
    mine = frozen.origin if frozen is not None else "no frozen weights"
    if mine != record.get("origin"):
        raise CheckpointError(
            f"checkpoint: {step} holds the trained weights only; its frozen base was {record.get('origin')}, "
            f"but this run's is {mine}: resume with the settings it was saved with"
        )
    return BaseSource(None)
