"""Mixture-of-experts load balancing in the training step, for families whose models have MoE layers.

Once per optimizer step, after the optimizer step and outside autograd, `MoEBalancing.step`
sums each layer's tokens per expert over every data-parallel and context-parallel rank (so the update
is the same for any layout), moves the expert biases (`titan_models.moe.update_expert_bias`) and
returns the step's expert load and auxiliary loss for the metrics line. A step the health guard skips
moves no bias (torchtitan moves it in the optimizer's step pre-hook). Under expert parallelism the
group stays dp x cp: each rank counts the tokens it routes, before dispatch, and the ep ranks are among
those (ep borrows dp_shard and cp ranks; the tp ranks it may borrow route the same tokens, so they are
not summed over). The sequence-wise auxiliary
loss is scaled like the language-model loss it joins: by 1 / the losses one step backpropagates
(gradient-accumulation steps, times a pipeline schedule's microbatches).
Under a pipeline the step's stats gather every stage's layers, so the logging rank reports the whole model.
A model without MoE layers makes every call here a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_models.moe import update_expert_bias
from titan_parallel import ParallelDims, moe_layers_of
from titan_train.config.schema import JobConfig
from titan_train.family_args import moe_args_of


def has_experts(args: Any) -> bool:
    """Whether a family's args describe MoE layers (the MoE families keep their `MoEArgs` in `moe_args`)."""
    return moe_args_of(args) is not None


def _balance_settings(config: JobConfig) -> dict[str, bool]:
    m = config.model
    return {
        "debug.moe_force_load_balance = true": config.debug.moe_force_load_balance,
        f"model.moe_load_balance_coeff = {m.moe_load_balance_coeff}": m.moe_load_balance_coeff is not None,
        f"model.moe_seq_aux_loss_coeff = {m.moe_seq_aux_loss_coeff}": m.moe_seq_aux_loss_coeff is not None,
    }


def balance_problems(config: JobConfig, args: Any) -> list[str]:
    """An MoE balancing setting given for a model without experts, for the plan's check."""
    asked = [name for name, on in _balance_settings(config).items() if on]
    if not asked or has_experts(args):
        return []
    m = config.model
    return [
        f"{asked[0]}: {m.name} {m.flavor} has no experts to balance; unset it or pick a mixture-of-experts flavor"
    ]


def moe_run_args(config: JobConfig, args: Any) -> Any:
    """`args` with the run's MoE settings: `debug.moe_force_load_balance` routes round-robin,
    `model.moe_load_balance_coeff` sets the expert-bias step (0: the bias never moves) and
    `model.moe_seq_aux_loss_coeff` the sequence-wise loss's weight. Any of them set for a model without
    experts is refused in one line (`balance_problems`, which the plan runs)."""
    m = config.model
    if not (any(_balance_settings(config).values()) and has_experts(args)):
        return args
    moe = args.moe_args
    if config.debug.moe_force_load_balance:
        moe = replace(moe, debug_force_load_balance=True)
    if m.moe_load_balance_coeff == 0:
        moe = replace(moe, update_bias=False)
    elif m.moe_load_balance_coeff is not None:
        moe = replace(moe, load_balance_coeff=m.moe_load_balance_coeff, update_bias=True)
    if m.moe_seq_aux_loss_coeff is not None:
        moe = replace(moe, seq_aux_loss_coeff=m.moe_seq_aux_loss_coeff)
    return replace(args, moe_args=moe)


@dataclass(frozen=True)
class MoEStepStats:
    """One optimizer step's routing, summed over the data-parallel and context-parallel ranks.

    `counts`: layer FQN -> tokens per expert (what the bias update used), every pipeline stage's layers;
    `aux_loss`: the mean over those layers of their last sequence-wise auxiliary loss on this data-parallel
    rank (None when it is off)."""

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

    def __init__(self, model_parts: list[nn.Module], dims: ParallelDims, model_has_experts: bool):
        """`model_has_experts`: whether the whole model has MoE layers (a pipeline rank's stages may have none).
        The aux loss's scale was fixed when the layers were built (`RunPlan.losses_per_step`)."""
        self.parts = model_parts
        self.layers = {name: m for part in model_parts for name, m in moe_layers_of(part).items()}
        mesh = dims.submesh("dp_cp") if self.layers else None
        self.group = mesh.get_group() if mesh is not None else None
        # Under a pipeline each rank holds some stages' layers; the stats gather every stage's, so the
        # logging rank reports the whole model. Every pp rank joins, with or without layers of its own.
        pp = dims.submesh("pp") if model_has_experts else None
        self.stage_group = pp.get_group() if pp is not None else None

    def _reduce(self, counts: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
        return counts

    @torch.no_grad()
    def discard_counts(self) -> None:
        """Forget the tokens counted since the last step (a pass that measured, but did not train)."""
        for moe in self.layers.values():
            moe.tokens_per_expert.zero_()

    @torch.no_grad()
    def step(self, applied: bool) -> MoEStepStats | None:
        """After the optimizer step: update every expert bias from this step's counts if the step was
        `applied` (a skipped step moves none), reset the counts; the step's stats, or None for a model
        without experts. Every rank of the data-parallel x context-parallel group calls it."""
        if not self.layers and self.stage_group is None:
            return None
        losses = [m.last_aux_loss for m in self.layers.values() if m.last_aux_loss is not None]
        aux = torch.stack(losses).tolist() if losses else []  # one device sync, not one per layer
        counts = {}
        if self.layers:
            summed = update_expert_bias(self.parts, reduce=self._reduce, step_applied=applied)
            counts = dict(zip(self.layers, summed.tolist(), strict=True))
        if self.stage_group is not None:
            stages: list[Any] = [None] * dist.get_world_size(self.stage_group)
            dist.all_gather_object(stages, (counts, aux), group=self.stage_group)
            counts = {name: c for stage_counts, _ in stages for name, c in stage_counts.items()}
            aux = [a for _, stage_aux in stages for a in stage_aux]
        return MoEStepStats(counts, sum(aux) / len(aux) if aux else None)
