"""The trainer's own progress, saved in every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class TrainState(Stateful):
    """Steps taken and tokens seen, saved under torchtitan's names (`step`, `ntokens_seen`) so either
    program resumes the other's checkpoints, and the run's planned `training_steps`, which says on
    resume whether a finished run is being extended (older checkpoints lack it: `optional_keys`). Titan's
    checkpoints from before the rename hold `tokens_seen`, read as `ntokens_seen` (`older_keys`)."""

    step: int = 0
    tokens_seen: int = 0
    training_steps: int = 0
    saved_training_steps: int | None = None  # what the resumed checkpoint planned; None if unknown

    optional_keys = ("training_steps",)
    # Checkpoints written before the names became torchtitan's keep the count as `tokens_seen`.
    older_keys = {"ntokens_seen": "tokens_seen"}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.tokens_seen, "training_steps": self.training_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["ntokens_seen"])
        saved = state_dict.get("training_steps")
        self.saved_training_steps = None if saved is None else int(saved)
