"""Adapters that give DCP a Stateful view of models, optimizers and per-rank objects."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer


class ModelState(Stateful):
    """The parameters and buffers of one or more model parts (pipeline stages), by full name.

    Uses DCP's state-dict API so that FSDP/TP shards are saved as DTensors and re-sharded on load.
    """

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class OptimizerState(Stateful):
    """Optimizer states of the model parts, keyed by parameter name (not position) so layouts can change."""

    def __init__(self, model_parts: list[nn.Module], optimizers: list[Optimizer]):
        self.pairs = list(zip(model_parts, optimizers, strict=True))

    @property
    def optimizers(self) -> list[Optimizer]:
        return [optimizer for _, optimizer in self.pairs]

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, optimizer in self.pairs:
            merged.update(
                get_optimizer_state_dict(
                    part, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
                )
            )
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, optimizer in self.pairs:
            set_optimizer_state_dict(
                part,
                optimizer,
                state_dict,
                options=StateDictOptions(flatten_optimizer_state_dict=True, strict=False),
            )
