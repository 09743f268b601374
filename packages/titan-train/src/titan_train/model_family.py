"""What a model family is: its flavors, builder, loss, FLOPs and Hugging Face mapping (`ModelFamily`).

The types alone, so that a module describing families (`titan_train.model_families`) and the registry
that holds them (`titan_train.registry`) both import them without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import titan_models
from titan_train.errors import ConfigError
from titan_train.vllm_serving import no_gap

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# The flavor that takes a family's shape from a Hugging Face config.json (through the family's `hf`).
FROM_HF = "from_hf"


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


@dataclass(frozen=True)
class HFMapping:
    """How a family's checkpoints map to and from Hugging Face's.

    `adapter(args, bos_id=..., eos_id=...)` returns the object titan-ckpt converts weights with
    (`to_hf`, `from_hf`, `hf_config`); `args_from_config(config_json, **overrides)` reads the args a
    `config.json` describes; `config_differences(args, config_json)` names every field in which a
    `config.json` describes another function than `args` (empty when they agree)."""

    adapter: Callable[..., Any]
    args_from_config: Callable[..., Any]
    config_differences: Callable[[Any, dict], list[str]]


def _count_embedded(model: nn.Module) -> tuple[int, int]:
    total = titan_models.count_parameters(model)
    return total, total - titan_models.count_parameters(model, exclude_embedding=True)


@dataclass(frozen=True)
class ModelFamily:
    """A model family: its flavors, how to build it, its loss, its FLOPs and its Hugging Face mapping
    (the module docstring lists what titan-train reads of a flavor's args)."""

    name: str
    flavors: Mapping[str, Any]
    build: Callable[[Any], nn.Module]
    flops_per_token: Callable[[Any, int, int, int], float]
    count_parameters: Callable[[nn.Module], tuple[int, int]] = _count_embedded
    loss_fn: LossFn = cross_entropy_loss
    hf: HFMapping | None = None
    # (args, device_type, export dtype) -> what vLLM lacks to serve the export, or None (titan_train.vllm_serving)
    vllm_gap: Callable[[Any, str, str], str | None] = no_gap

    def __post_init__(self) -> None:
        # A copy: the family's flavors change only through `register_flavor`, never through the dict
        # it was given (a test or benchmark assigning into a titan_models flavor dict changes nothing).
        object.__setattr__(self, "flavors", dict(self.flavors))

    def args_for(self, flavor: str, **overrides) -> Any:
        """The args of `flavor`, with `overrides` (fields of the common surface)."""
        if flavor not in self.flavors:
            raise ConfigError(
                f"config: model.flavor '{flavor}' is not a {self.name} flavor; choose one of {', '.join(self.flavors)}"
            )
        return replace(self.flavors[flavor], **overrides)
