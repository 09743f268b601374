"""Mixture-of-experts load balancing in the training step, for families whose models have MoE layers.

Once per optimizer step, after the step's last backward and outside autograd, `MoEBalancing.step`
sums each layer's tokens per expert over every data-parallel and context-parallel rank (so the update
is the same for any layout), moves the expert biases (`titan_models.moe.update_expert_bias`) and
returns the step's expert load and auxiliary loss for the metrics line. Under expert parallelism the
group stays dp x cp: each rank counts the tokens it routes, before dispatch, and the ep ranks are among
those (ep borrows dp_shard and cp ranks; the tp ranks it may borrow route the same tokens, so they are
not summed over). The sequence-wise auxiliary
loss is scaled by 1 / gradient-accumulation steps, like the language-model loss it joins.
A model without MoE layers makes every call here a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_models.moe import moe_modules, set_aux_loss_scale, update_expert_bias
from titan_parallel import ParallelDims
from titan_train.config.schema import JobConfig
from titan_train.errors import ConfigError


def has_experts(args: Any) -> bool:
    """Whether a family's args describe MoE layers (the MoE families keep their `MoEArgs` in `moe_args`)."""
    return getattr(args, "moe_args", None) is not None


def moe_run_args(config: JobConfig, args: Any) -> Any:
    """`args` with the run's MoE debug settings: `debug.moe_force_load_balance` routes round-robin.
    Refused, in one line, for a model without experts."""
    if not config.debug.moe_force_load_balance:
        return args
    if not has_experts(args):
        m = config.model
        raise ConfigError(
            f"debug.moe_force_load_balance = true: {m.name} {m.flavor} has no experts to balance; "
            "set it to false or pick a mixture-of-experts flavor"
        )
    return replace(args, moe_args=replace(args.moe_args, debug_force_load_balance=True))


@dataclass(frozen=True)
class MoEStepStats:
    """One optimizer step's routing, summed over the data-parallel and context-parallel ranks.

    `counts`: layer FQN -> tokens per expert (what the bias update used); `aux_loss`: the mean over
    layers of this rank's last sequence-wise auxiliary loss (None when it is off)."""

    counts: dict[str, list[float]]
    aux_loss: float | None

    def load(self) -> dict[str, dict[str, float]]:
        """Per layer: max and mean tokens per expert, and their ratio (1.0: balanced)."""
        out = {}
        for name, count in self.counts.items():
            top, mean = max(count), sum(count) / len(count)
            out[name] = {"max": top, "mean": mean, "max_over_mean": top / mean if mean else float("nan")}
        return out


class MoEBalancing:
    """The trainer's two calls: construct once with the model parts, `step()` once per optimizer step."""

    def __init__(self, model_parts: list[nn.Module], dims: ParallelDims, grad_accum_steps: int):
        self.parts = model_parts
        self.layers = {name: m for part in model_parts for name, m in moe_modules(part).items()}
        mesh = dims.submesh("dp_cp") if self.layers else None
        self.group = mesh.get_group() if mesh is not None else None
        if self.layers:
            set_aux_loss_scale(model_parts, 1.0 / grad_accum_steps)

    @property
    def enabled(self) -> bool:
        return bool(self.layers)

    def _reduce(self, counts: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
        self._counts = counts.clone()
        return counts

    @torch.no_grad()
    def step(self) -> MoEStepStats | None:
        """Update every expert bias from this step's counts (reset after); the step's stats, or None
        for a model without experts. Every rank of the data-parallel x context-parallel group calls it."""
        if not self.layers:
            return None
        aux = [m.last_aux_loss for m in self.layers.values() if m.last_aux_loss is not None]
        self._counts = None
        update_expert_bias(self.parts, reduce=self._reduce)
        counts = dict(zip(self.layers, self._counts.tolist(), strict=True))
        return MoEStepStats(counts, torch.stack(aux).mean().item() if aux else None)
