"""A GRPO step's rewards: the run's reward functions (`grpo.reward_funcs`, `reward_weights`) called on a rank's
completions with TRL's signature, a failing function named with the step and the row (`RewardFailed`), and
TRL's reward and completion-length metrics of the whole step."""

from __future__ import annotations

import math

import torch

from titan_train.objectives.grpo_loss import nanstd
from titan_train.objectives.rewards import BadReward, RewardFailed, load_reward_function, score
from titan_train.objectives.rollouts import Completions


class RewardScorer:
    """The run's reward functions, their names in the metrics and their weights."""

    def __init__(self, settings, tokenizer):
        self.functions = [(spec, load_reward_function(spec)) for spec in settings.reward_funcs]
        self.names = [getattr(fn, "__name__", spec) for spec, fn in self.functions]
        self.weights = torch.tensor(
            settings.reward_weights or [1.0] * len(self.functions), dtype=torch.float64
        )
        self.num_generations, self.scale_rewards = settings.num_generations, settings.scale_rewards
        self.tokenizer = tokenizer

    def score(self, rows: list, completions: Completions, step: int) -> torch.Tensor:
        """(B, F) rewards of this rank's completions; RewardFailed naming the function and row on a failure."""
        n = self.num_generations
        special = self.tokenizer.special_ids
        texts = [self.tokenizer.decode([i for i in ids if i not in special]) for ids in completions.ids]
        per_completion = [row for row in rows for _ in range(n)]
        keys = sorted({k for row in rows for k in row.columns})
        try:
            table = score(
                self.functions,
                prompts=[row.prompt for row in per_completion],
                completions=[
                    [{"role": "assistant", "content": t}] if row.conversational else t
                    for row, t in zip(per_completion, texts, strict=True)
                ],
                completion_ids=completions.ids,
                columns={k: [row.columns.get(k) for row in per_completion] for k in keys},
            )
        except Exception as err:  # a user's function: say which step and rows, then stop
            index = err.index if isinstance(err, BadReward) else None
            where = (
                f"a completion of {per_completion[index].where}"
                if index is not None
                else f"the prompts of {rows[0].where}..{rows[-1].where}"
            )
            raise RewardFailed(
                f"grpo: a reward function failed at step {step} on {where}: {type(err).__name__}: {err}"
            ) from err
        bad = torch.isinf(table).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise RewardFailed(
                f"grpo: a reward function returned an infinite reward at step {step} for a "
                f"completion of {per_completion[bad[0]].where}; return a finite float or None"
            )
        return table

    def metrics(self, table: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
        """TRL's reward and completion-length metrics of the step's (B_all, F) table and (B_all, 2) lengths
        and truncated flags over every data-parallel rank."""
        n = self.num_generations
        rewards = (table * self.weights).nansum(dim=1)
        rewards[torch.isnan(table).all(dim=1)] = math.nan
        if self.scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards)
        else:
            std = nanstd(rewards.view(-1, n), dim=1).repeat_interleave(n)
        metrics = {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item()}
        for j, name in enumerate(self.names):
            metrics[f"rewards/{name}/mean"] = torch.nanmean(table[:, j]).item()
            metrics[f"rewards/{name}/std"] = nanstd(table[:, j]).item()
        metrics["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).double().mean().item()
        lengths, truncated = lengths.unbind(1)
        ended = lengths[truncated == 0]
        metrics.update(
            {
                "completions/mean_length": lengths.mean().item(),
                "completions/min_length": lengths.min().item(),
                "completions/max_length": lengths.max().item(),
                "completions/clipped_ratio": truncated.mean().item(),
                "completions/mean_terminated_length": ended.mean().item() if len(ended) else 0.0,
            }
        )
        return metrics
