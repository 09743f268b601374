"""Preference pairs held out for validation: every `validation.freq` steps, the pair loss and TRL's
reward metrics over a fresh pass of the validation file (docs/preference.md), with the training
step's loss and reference (a frozen copy, or the base with adapters off)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from titan_train.errors import ConfigError
from titan_train.objectives.preference_step import PreferenceStep
from titan_train.objectives.validation import agreed_batches


class PreferenceValidator:
    """`validate` returns the held-out pairs' `loss` and metrics under TRL's names, means over all its
    pairs and data-parallel ranks; `steps` batches (-1: until some rank's data ends)."""

    def __init__(
        self,
        make_batches: Callable[[], Iterable[tuple[torch.Tensor, ...]]],
        step: PreferenceStep,
        context: Callable,
        *,
        seq_len: int,
        device: torch.device,
        freq: int,
        steps: int,
    ):
        self.make_batches, self.step, self.context, self.seq_len = make_batches, step, context, seq_len
        self.device, self.freq, self.steps = device, freq, steps

    def should_validate(self, step: int) -> bool:
        return step % self.freq == 0

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module]) -> dict[str, float]:
        for part in model_parts:
            part.eval()
        sums = None
        try:
            for batch in agreed_batches(iter(self.make_batches()), self.steps, self.device):
                inputs, labels, positions, sequence = (t.to(self.device) for t in batch[:4])
                got = self.step.evaluate(
                    inputs, labels, positions, sequence, seq_len=self.seq_len, context=self.context
                )
                sums = got if sums is None else sums + got
        finally:
            for part in model_parts:
                part.train()
        if sums is None:
            raise ConfigError(
                "validation: the preference validation file yields no batch; give more pairs or a smaller "
                "validation.local_batch_size"
            )
        return self.step.validation_metrics(sums)
