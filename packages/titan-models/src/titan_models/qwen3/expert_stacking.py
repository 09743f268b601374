"""Stacked expert weights (E, ...) as one entry per expert, and back, for Hugging Face's per-expert files.

Unstacking names expert e of `layers.3.moe.experts.w1` as `layers.3.moe.experts.w1.{e}`, so an
adapter maps those names one to one. The load-balancing state is training state with no Hugging Face
counterpart (`titan_models.moe.hf_state`): unstacking drops it.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from titan_models.moe.hf_state import TRAINING_STATE

_STACKED = re.compile(r"^(.*\bmoe\.experts\.(w1|w2|w3))$")
_UNSTACKED = re.compile(r"^(.*\bmoe\.experts\.(?:w1|w2|w3))\.(\d+)$")


class ExpertStacking:
    """Splits and joins the stacked experts of `n_layers` MoE blocks of `num_experts` experts each."""

    def __init__(self, n_layers: int, num_experts: int):
        self.n_layers, self.num_experts = n_layers, num_experts

    def unstack(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Each stacked expert weight as `num_experts` entries; the expert bias left out."""
        out: dict[str, Tensor] = {}
        for name, tensor in state_dict.items():
            if name.endswith(TRAINING_STATE):
                continue
            if _STACKED.match(name):
                out |= {f"{name}.{e}": tensor[e] for e in range(tensor.shape[0])}
            else:
                out[name] = tensor
        return out

    def stack(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per-expert entries (as `unstack` names them) joined along a new first dimension, by expert."""
        out: dict[str, Tensor] = {}
        groups: dict[str, dict[int, Tensor]] = {}
        for name, tensor in state_dict.items():
            m = _UNSTACKED.match(name)
            if m:
                groups.setdefault(m.group(1), {})[int(m.group(2))] = tensor
            else:
                out[name] = tensor
        for name, experts in groups.items():
            out[name] = torch.stack([experts[e] for e in range(len(experts))])
        return out

    def blocks(self) -> list[str]:
        """The prefix of every MoE block (`"layers.3."`)."""
        return [f"layers.{layer}." for layer in range(self.n_layers)]
