"""Model families Titan can train: the only place that ties a model name to its parts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from titan_models import LLAMA2_FLAVORS, LLAMA3_FLAVORS, ModelArgs, Transformer
from titan_train.errors import ConfigError


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict[str, ModelArgs]
    build: Callable[[ModelArgs], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def args_for(self, flavor: str, **overrides) -> ModelArgs:
        if flavor not in self.flavors:
            raise ConfigError(
                f"config: model.flavor '{flavor}' is not a {self.name} flavor; choose one of {', '.join(self.flavors)}"
            )
        return replace(self.flavors[flavor], **overrides)


MODELS: dict[str, ModelSpec] = {
    "llama3": ModelSpec("llama3", LLAMA3_FLAVORS, Transformer, cross_entropy_loss),
    "llama2": ModelSpec("llama2", LLAMA2_FLAVORS, Transformer, cross_entropy_loss),
}


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ConfigError(f"config: model.name '{name}' is unknown; registered: {', '.join(MODELS)}")
    return MODELS[name]
