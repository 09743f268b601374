"""Keeping experts evenly loaded: the auxiliary-loss-free expert bias and DeepSeek-V3's sequence-wise loss.

Expert bias (https://arxiv.org/abs/2408.15664): each MoE layer counts the tokens routed to each expert
during training forwards (`tokens_per_expert`; not validation's, not a recomputation's); once per
applied optimizer step, outside autograd, `update_expert_bias` raises the routing bias of under-loaded
experts and lowers it for over-loaded ones by `load_balance_coeff` (the sign of mean - count, centred),
then resets the counts. Counting over every
micro-batch of the step and summing over the data-parallel ranks (`reduce`) makes the update the same
for any gradient-accumulation or data-parallel layout.

Sequence-wise loss (DeepSeek-V3, eq. 17-20): per sequence, `sum_i f_i * P_i` with `f_i` the fraction of
the sequence's top-k choices that went to expert i (times E/k) and `P_i` its mean normalised affinity.
Rather than returning a second loss through every pipeline stage, the MoE layer attaches it to its
output with `attach_aux_loss`: the forward value is unchanged and backward adds `coeff * d aux` to the
gradients, exactly as if `coeff * aux` had been added to this forward's loss. A trainer that divides
each micro-batch's loss by the number of micro-batches (and a pipeline schedule each microbatch's by
their number) builds the layers with the same factor (`MoEArgs.aux_loss_scale`); `set_aux_loss_scale`
changes it on a built model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


@torch.no_grad()
def update_expert_bias(
    model: nn.Module | list[nn.Module],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    *,
    step_applied: bool = True,
) -> torch.Tensor:
    """Move each MoE layer's expert bias towards balance from the counts since the last call; reset them;
    return the counts it used, (layers, experts) float, reduced (empty for a model without MoE layers).

    Call once per optimizer step, after it (torchtitan moves the bias in the optimizer's step pre-hook,
    so a step not taken moves nothing): `step_applied=False` for a step the trainer skipped leaves the
    biases as they are and only resets the counts (still reduced, so every rank calls alike). `model`
    (or each of a list of pipeline stages) lists its MoE layers with `moe_layers()`. `reduce` sums a (layers, experts) float tensor over the data-parallel ranks and returns it,
    e.g. `lambda t: (dist.all_reduce(t, group=dp_group), t)[1]`; every rank must call it, and with
    pipelining each stage reduces only its own layers. Layers without an expert bias only reset.
    """
    layers = [
        m for part in (model if isinstance(model, list) else [model]) for m in part.moe_layers().values()
    ]
    if not layers:
        return torch.zeros(0, 0)
    counts = torch.stack([m.tokens_per_expert.float() for m in layers])
    if reduce is not None:
        counts = reduce(counts)
    for moe, count in zip(layers, counts, strict=True):
        if step_applied and moe.expert_bias is not None and moe.args.update_bias:
            delta = moe.load_balance_coeff * torch.sign(count.mean() - count)
            moe.expert_bias.add_(delta - delta.mean())
        moe.tokens_per_expert.zero_()
    return counts


@torch.no_grad()
def expert_load(model: nn.Module | list[nn.Module]) -> dict[str, float]:
    """Per MoE layer, max / mean of the tokens each expert got since the last bias update (1.0: balanced).

    Read it before `update_expert_bias` resets the counts. NaN when the layer saw no token.
    """
    loads = {}
    for part in model if isinstance(model, list) else [model]:
        for name, moe in part.moe_layers().items():
            count = moe.tokens_per_expert.float()
            loads[name] = (count.max() / count.mean()).item() if count.sum() > 0 else float("nan")
    return loads


def sequence_aux_loss(scores: torch.Tensor, indices: torch.Tensor, batch: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (without its coefficient), averaged over sequences.

    `scores` (batch*seq, E) are the router's affinities, `indices` (batch*seq, k) the chosen experts.
    """
    num_experts = scores.shape[-1]
    scores = scores.view(batch, -1, num_experts)
    seq_len = scores.shape[1]
    normalised = scores / scores.sum(dim=-1, keepdim=True)
    chosen = torch.zeros(batch, num_experts, device=scores.device, dtype=scores.dtype)
    chosen.scatter_add_(
        1, indices.view(batch, -1), torch.ones_like(indices.view(batch, -1), dtype=scores.dtype)
    )
    fraction = chosen * num_experts / (top_k * seq_len)
    return (fraction * normalised.mean(dim=1)).sum(dim=-1).mean()


class _AuxLossGradient(torch.autograd.Function):
    """Identity on `out`; in backward, gives `aux` the gradient `scale`, as if `scale * aux` were in the loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """`out`, carrying `scale * aux` into backward (see the module docstring)."""
    return _AuxLossGradient.apply(out, aux, scale)


def set_aux_loss_scale(model: nn.Module | list[nn.Module], scale: float) -> None:
    """Multiply every layer's auxiliary-loss gradient by `scale` (e.g. 1 / gradient-accumulation steps).

    Use the factor the trainer applies to each forward's loss before backward, so the balance loss is
    weighted like the language-model loss it is added to.
    """
    for part in model if isinstance(model, list) else [model]:
        for moe in part.moe_layers().values():
            moe.aux_loss_scale = scale
