"""The trainer's own progress, saved in every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class TrainState(Stateful):
    """Steps taken and tokens seen, saved under torchtitan's names (`step`, `ntokens_seen`) so either
    program resumes the other's checkpoints, and the run's planned `training_steps`, which says on
    resume whether a finished run is being extended (older checkpoints lack it: `optional_keys`). Titan's
    checkpoints from before the rename hold `tokens_seen`, read as `ntokens_seen` (`older_keys`).

    Each rank also saves its random generators' states under its own keys (`rng_state_rank<r>`, and
    `cuda_rng_state_rank<r>` on a GPU) and sets them again on resume; a checkpoint without them (older, or
    another world size) leaves the generators as seeded. A loaded state is set by `apply_saved_rng`, called
    just before the first step, so that LoRA's dropout masks after a resume are the uninterrupted run's.
    (The data loader draws its workers' base seed from a generator of its own, `titan_data.TokenLoader`.)"""

    step: int = 0
    tokens_seen: int = 0
    training_steps: int = 0
    saved_training_steps: int | None = None  # what the resumed checkpoint planned; None if unknown
    rank: int = 0
    _saved_rng: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def optional_keys(self) -> tuple[str, ...]:
        return ("training_steps", *self._rng_keys())

    def _rng_keys(self) -> tuple[str, ...]:
        cuda = (f"cuda_rng_state_rank{self.rank}",) if torch.cuda.is_initialized() else ()
        return (f"rng_state_rank{self.rank}", *cuda)

    # Checkpoints written before the names became torchtitan's keep the count as `tokens_seen`.
    older_keys = {"ntokens_seen": "tokens_seen"}

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "ntokens_seen": self.tokens_seen, "training_steps": self.training_steps}
        state[f"rng_state_rank{self.rank}"] = torch.get_rng_state()
        if torch.cuda.is_initialized():
            state[f"cuda_rng_state_rank{self.rank}"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["ntokens_seen"])
        saved = state_dict.get("training_steps")
        self.saved_training_steps = None if saved is None else int(saved)
        self._saved_rng = {key: state_dict[key] for key in self._rng_keys() if key in state_dict}

    def apply_saved_rng(self) -> None:
        """Set the random generators to the loaded checkpoint's states (once; nothing without one)."""
        saved, self._saved_rng = self._saved_rng, {}
        if f"rng_state_rank{self.rank}" in saved:
            torch.set_rng_state(saved[f"rng_state_rank{self.rank}"])
        if f"cuda_rng_state_rank{self.rank}" in saved:
            torch.cuda.set_rng_state(saved[f"cuda_rng_state_rank{self.rank}"])
