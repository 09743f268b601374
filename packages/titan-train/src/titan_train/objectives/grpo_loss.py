"""Group-relative policy optimisation's arithmetic, as TRL 1.16's `GRPOTrainer` defines it: rewards to
advantages per group of completions, and the policy loss of each loss type. Pure functions on tensors, so
the RL objective and its tests share them (issue 59).

Advantages. A prompt's `num_generations` completions form a group. Each reward function gives a value per
completion (None: not applicable, kept as NaN); their weighted sum (NaNs skipped) is the completion's
reward, NaN when every function abstained. With `scale = "group"` the advantage is
(r - mean of its group) / (std of its group + 1e-4), "batch" divides by the std of the whole batch, "none"
does not divide; means and stds skip NaNs (the std with Bessel's correction), and an unscorable completion
gets advantage 0.

Loss. Per completion token t: the ratio rho_t = exp(logp_t - old_logp_t) (`importance_sampling = "sequence"`
(GSPO): the exponent is the completion's mean log-ratio, one per completion). With advantage A:
- grpo, bnpo, dr_grpo, dapo: -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) (rho capped at `delta`
  first where set: two-sided clipping);
- cispo: -min(rho, eps_high).detach() * A * logp_t;
- sapo: -sigmoid(tau (rho - 1)) * 4 / tau * A, tau the positive or negative temperature by A's sign.
With beta > 0, beta * (exp(ref - logp) - (ref - logp) - 1) is added per token (the k3 estimate of the KL to
the reference), times rho where `kl_importance_correction` (TRL's `use_bias_correction_kl`, on by default). Aggregated over the completion tokens (mask):
- grpo, sapo: each completion's mean, then the mean over completions;
- bnpo: the sum over the batch's tokens / their count;
- dr_grpo: the sum / (completions x max_completion_length);
- dapo, cispo: the sum / `tokens_in_batch`, the completion tokens of the whole generation batch (every rank
  and accumulation step), so micro-batches and ranks add up to one normalised loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
SCALES = ("group", "batch", "none")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation with Bessel's correction over the non-NaN values (NaN with fewer than two)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    variance = torch.where(count > 1, variance, torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze(dim) if dim is not None else std.reshape(())


def group_advantages(
    rewards_per_function: torch.Tensor, weights: torch.Tensor, num_generations: int, scale: str = "group"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, rewards) of B completions, B a multiple of `num_generations` (groups consecutive), from
    `rewards_per_function` (B, F) with NaN where a function abstained and `weights` (F,)."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    unscorable = torch.isnan(rewards_per_function).all(dim=1)
    rewards = (rewards_per_function * weights.unsqueeze(0)).nansum(dim=1)
    rewards = torch.where(unscorable, torch.full_like(rewards, float("nan")), rewards)
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale == "group":
        std = nanstd(groups, dim=1).repeat_interleave(num_generations) if num_generations > 1 else None
        advantages = advantages / (std + 1e-4) if std is not None else advantages / 1e-4
    elif scale == "batch":
        advantages = advantages / (nanstd(rewards) + 1e-4)
    return torch.where(unscorable, torch.zeros_like(advantages), advantages), rewards


@dataclass(frozen=True)
class GRPOLoss:
    """The loss settings, TRL's `GRPOConfig` names and defaults."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    delta: float | None = None
    importance_sampling: str = "token"  # or "sequence" (GSPO)
    kl_importance_correction: bool = True  # TRL's use_bias_correction_kl: the KL term weighted by rho
    max_completion_length: int = 256
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling not in ("token", "sequence"):
            raise ValueError(
                f"importance_sampling must be token or sequence, got {self.importance_sampling!r}"
            )

    @property
    def needs_reference(self) -> bool:
        return self.beta != 0.0

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def log_ratio(self, logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """log rho: (B, T) per token, or (B, 1) per sequence (GSPO)."""
        log_ratio = logps - old_logps
        if self.importance_sampling == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        return log_ratio

    def kl(self, logps: torch.Tensor, ref_logps: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
        """The (B, T) k3 estimate of the KL to the reference, weighted by rho where corrected."""
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        return kl * torch.exp(log_ratio) if self.kl_importance_correction else kl

    def per_token(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logps: torch.Tensor | None = None,
        sampling_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The (B, T) loss of every completion token (before the mask), `advantages` (B,); the policy term
        times `sampling_weights` where given (vllm's importance-sampling correction, before the KL, as TRL)."""
        a = advantages.unsqueeze(1)
        log_ratio = self.log_ratio(logps, old_logps, mask)
        rho = torch.exp(log_ratio)
        if self.loss_type == "cispo":
            loss = -torch.clamp(rho, max=self.high).detach() * a * logps
        elif self.loss_type == "sapo":
            tau = torch.where(a > 0, self.sapo_temperature_pos, self.sapo_temperature_neg)
            loss = -torch.sigmoid(tau * (rho - 1)) * 4 / tau * a
        else:
            clipped = torch.clamp(rho, 1 - self.epsilon, 1 + self.high)
            if self.delta is not None:
                rho = torch.clamp(rho, max=self.delta)
            loss = -torch.min(rho * a, clipped * a)
        if sampling_weights is not None:
            loss = loss * sampling_weights
        if self.needs_reference:
            if ref_logps is None:
                raise ValueError("beta > 0 needs the reference's per-token log-probs")
            loss = loss + self.beta * self.kl(logps, ref_logps, log_ratio)
        return loss.expand_as(logps)

    def reduce(
        self, per_token: torch.Tensor, mask: torch.Tensor, tokens_in_batch: float | None = None
    ) -> torch.Tensor:
        """The batch's loss from its per-token losses (see the module docstring for each type)."""
        masked = per_token * mask
        if self.loss_type in ("grpo", "sapo"):
            return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        if self.loss_type == "bnpo":
            return masked.sum() / mask.sum().clamp(min=1.0)
        if self.loss_type == "dr_grpo":
            return masked.sum() / (per_token.shape[0] * self.max_completion_length)
        if tokens_in_batch is None:
            raise ValueError(f"loss_type {self.loss_type!r} divides by the generation batch's token count")
        return masked.sum() / max(tokens_in_batch, 1.0)
