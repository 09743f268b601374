"""Preference losses as TRL defines them, on per-sequence log-probabilities (docs/preference.md).

`sequence_logps` sums each sequence's completion log-probabilities out of a micro-batch's logits;
`pair_losses` turns the chosen and rejected sums (and the reference's, for the losses that have one)
into one loss per pair, plus the reward each side gets, which the metrics report under TRL's names.
The step's loss is the mean over its pairs; `PreferenceStep` does that reduction across micro-batches
and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from titan_data import IGNORE_INDEX


@dataclass(frozen=True)
class SequenceLogps:
    """Per sequence of a micro-batch (chosen 2k, rejected 2k + 1): the sum of its completion tokens'
    log-probabilities, and their number."""

    sums: torch.Tensor  # float32 [sequences]
    counts: torch.Tensor  # float32 [sequences]

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen sums, rejected sums, chosen counts, rejected counts)."""
        return self.sums[0::2], self.sums[1::2], self.counts[0::2], self.counts[1::2]


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position in float32 (0 where the label is IGNORE_INDEX). Under TP with loss
    parallelism the logits are sharded over the vocabulary and stay so: each rank's log-softmax and pick
    of the label cover its slice, and the per-token result is combined across the TP ranks."""
    flat, target = logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
    if isinstance(flat, DTensor):  # the labels replicated on the logits' mesh, for forward and backward
        target = DTensor.from_local(target, flat.device_mesh, [Replicate()] * flat.device_mesh.ndim)
    losses = F.cross_entropy(flat, target, ignore_index=IGNORE_INDEX, reduction="none")
    if isinstance(losses, DTensor):  # vocabulary-sharded logits under loss_parallel: replicated per token
        losses = losses.full_tensor()
    return -losses.view(labels.shape)


def sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, sequence: torch.Tensor, n: int
) -> SequenceLogps:
    """Sums of `n` sequences' completion log-probs; `sequence` numbers each position's sequence (-1: none)."""
    per_token = token_logps(logits, labels)
    trained = (labels != IGNORE_INDEX) & (sequence >= 0)
    index = sequence.clamp_min(0).reshape(-1)
    weights = trained.reshape(-1).to(per_token.dtype)
    sums = torch.zeros(n, dtype=per_token.dtype, device=per_token.device)
    sums = sums.index_add(0, index, per_token.reshape(-1) * weights)
    counts = torch.zeros(n, dtype=per_token.dtype, device=per_token.device).index_add(0, index, weights)
    return SequenceLogps(sums, counts)


@dataclass(frozen=True)
class PairLosses:
    """Per pair: the loss, and the reward of the chosen and of the rejected completion (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def _smoothed_sigmoid(z: torch.Tensor, smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(z) * (1 - smoothing) - F.logsigmoid(-z) * smoothing


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends."""
    return torch.where(x > -0.693, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_losses(
    kind: str,
    policy: SequenceLogps,
    reference: SequenceLogps | None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> PairLosses:
    """One loss per pair, as TRL's DPOTrainer (sigmoid, ipo, hinge), CPOTrainer(loss_type="simpo") and
    ORPOTrainer (its odds-ratio term; the chosen NLL is added per token by the caller) compute it."""
    chosen, rejected, n_chosen, n_rejected = policy.pairs()
    if kind in ("simpo", "orpo"):
        chosen_avg, rejected_avg = chosen / n_chosen.clamp_min(1), rejected / n_rejected.clamp_min(1)
        if kind == "simpo":
            z = beta * (chosen_avg - rejected_avg - simpo_gamma / beta)
            losses = _smoothed_sigmoid(z, label_smoothing)
        else:
            log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))
            losses = -beta * F.logsigmoid(log_odds)
        return PairLosses(losses, beta * chosen_avg.detach(), beta * rejected_avg.detach())
    if reference is None:
        raise ValueError(f"preference loss {kind!r} needs reference log-probs")
    ref_chosen, ref_rejected, _, _ = reference.pairs()
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        losses = _smoothed_sigmoid(beta * delta, label_smoothing)
    elif kind == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif kind == "ipo":
        avg_delta = chosen_ratio / n_chosen.clamp_min(1) - rejected_ratio / n_rejected.clamp_min(1)
        losses = (avg_delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}")
    return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
