"""Stacked expert weights (E, ...) as one entry per expert, and back, for Hugging Face's per-expert files.

Unstacking names expert e of `layers.3.moe.experts.w1` as `layers.3.moe.experts.w1.{e}`, so an
adapter's name table maps those names one to one (`titan_models.hf_name_table.per_expert`).
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

_STACKED = re.compile(r"^(.*\bmoe\.experts\.(w1|w2|w3))$")
_UNSTACKED = re.compile(r"^(.*\bmoe\.experts\.(?:w1|w2|w3))\.(\d+)$")


def unstack_experts(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each stacked expert weight as one entry per expert, every other tensor as it is."""
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        if _STACKED.match(name):
            out |= {f"{name}.{e}": tensor[e] for e in range(tensor.shape[0])}
        else:
            out[name] = tensor
    return out


def stack_experts(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-expert entries (as `unstack_experts` names them) joined along a new first dimension, by expert."""
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
