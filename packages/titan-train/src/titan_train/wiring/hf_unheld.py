"""The MoE state a Hugging Face format cannot hold (an adapter's `hf_unheld_state`: an MoE router's
expert bias where the family's config has no field for it): how much of the routing it changes, for the export's warning or refusal
(`titan_ckpt.hf_export`). Which state names it is: `titan_ckpt.unheld_state`."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


class BiasEffect:
    """This rank's count, on the last training batch, of the token routings the expert bias changes.

    A forward hook on each MoE layer routes the layer's input again (without gradients), with and
    without the bias, and keeps (tokens whose top-k experts differ, tokens) per layer here, not on the
    layer. Training forwards only: not validation (eval mode), not a forward that activation
    checkpointing recomputes. Called, it gives the sums over the layers, or None before any training
    forward: the callable `titan_ckpt.Checkpointer`'s `hf_unheld_effect` takes.
    """

    def __init__(self, layers: dict[str, nn.Module]):
        self._last: dict[str, tuple[torch.Tensor, int]] = {}
        for fqn, layer in layers.items():
            layer.register_forward_hook(functools.partial(self._count, fqn))

    def _count(self, fqn: str, layer: nn.Module, args: tuple, _out: Any) -> None:
        if not layer.training or torch._C._current_graph_task_id() != -1:
            return
        x = args[0]
        with torch.no_grad():
            _, indices, scores = layer.router(x.reshape(-1, x.shape[-1]), layer.expert_bias)
            self._last[fqn] = (layer.router.changed_by_bias(scores, indices), indices.shape[0])

    def __call__(self) -> tuple[int, int] | None:
        if not self._last:
            return None
        return sum(int(c) for c, _ in self._last.values()), sum(t for _, t in self._last.values())
