"""Preference tuning under pipeline parallelism: the pair loss on the last stage, per microbatch.

Only the last stage sees logits, and the schedule hands its loss one microbatch's logits and target,
cut from the batch by rows (windows); a pair never crosses windows, so never microbatches. The target is
therefore more than labels: per row, its labels, each position's sequence number in the window, the
reference's sum of the window's j-th sequence at column j, the NLL term's targets and the row's index
in the batch (float64, exact for token ids). The reference sums come from the precomputed table (read
on every rank before the step) or, with a frozen copy, from a forward-only pass of the copy's own
pipeline over the same rows just before the training pass, whose loss records them on the last stage.
Each microbatch's loss is its pairs' share of the step's mean (`PreferenceStep.step_loss`), times the
microbatch count the schedule divides it by; its metrics add up on the last stage and `end_step`
sums them over the pipeline ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from titan_parallel import Pipeline
from titan_train.objectives.preference_loss import sequence_logps
from titan_train.objectives.preference_step import PreferenceStep, global_sequences, window_slots
from titan_train.step.stage_inputs import stage_inputs

LABELS, SEQUENCE, REFERENCE, NLL_TARGETS, ROW = range(5)


class PipelinedPreference:
    """`forward_backward` of a `PreferenceStep` through the policy's pipeline; `reference` is the frozen
    copy's pipeline (None: the table of `step.precomputed`, or a reference-free loss)."""

    def __init__(self, step: PreferenceStep, pipeline: Pipeline, reference: Pipeline | None):
        self.step, self.pipeline, self.reference = step, pipeline, reference
        self.parts: list[nn.Module] = pipeline.model_parts
        self._reference_sums: torch.Tensor | None = None
        self._metric_sums: list[torch.Tensor] = []  # per microbatch of this step, on the last stage

    def _target(self, inputs, labels, sequence, pair=None) -> torch.Tensor:
        """The batch's target planes; the precomputed sums by `pair` where given (zeros otherwise)."""
        step, rows = self.step, torch.arange(labels.shape[0], device=labels.device)
        reference = torch.zeros_like(labels, dtype=torch.float64)
        if pair is not None and step.needs_reference and step.precomputed is not None:
            reference = step.precomputed.window_sums(pair, sequence)
        nll_targets = step.nll_targets(inputs, labels, global_sequences(sequence)[0])
        planes = (labels, sequence, reference, nll_targets, rows[:, None].expand_as(labels))
        return torch.stack([t.to(torch.float64) for t in planes], dim=1)

    def _record_reference(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The frozen copy's loss on the last stage: no loss, its sums per window kept for the target."""
        labels, sequence = target[:, LABELS].long(), target[:, SEQUENCE].long()
        numbered, pairs = global_sequences(sequence)
        sums = sequence_logps(logits, labels, numbered, 2 * pairs).sums
        rows = target[:, ROW, 0].long()
        self._reference_sums[rows] = window_slots(sequence, sums[numbered.clamp_min(0)])
        return logits.new_zeros(())

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        step = self.step
        labels, sequence = target[:, LABELS].long(), target[:, SEQUENCE].long()
        numbered, pairs = global_sequences(sequence)
        reference = None
        if step.needs_reference:
            per_position = target[:, REFERENCE].gather(1, sequence.clamp_min(0))
            reference = torch.zeros(2 * pairs, dtype=torch.float32, device=logits.device)
            placed = numbered >= 0
            reference[numbered[placed]] = per_position[placed].float()
        nll_targets = target[:, NLL_TARGETS].long()
        out, nll, _, metric_sums, _ = step.terms(logits, labels, numbered, pairs, reference, nll_targets)
        if not self.pipeline.inferring_metadata:  # torch's first step runs the loss once on stand-ins
            self._metric_sums.append(metric_sums)
        return step.step_loss(out, nll) * self.pipeline.n_microbatches

    def reference_sums(self, inputs, labels, positions, sequence) -> torch.Tensor:
        """Each window's sums by the policy's pipeline as it stands, forward only, on the last stage (the
        precompute pass; zeros on the other ranks)."""
        target = self._target(inputs, labels, sequence)
        self._reference_sums = torch.zeros_like(labels, dtype=torch.float64)
        kwargs = stage_inputs(self.parts, inputs, positions)
        self.pipeline.evaluate(inputs, target, loss=self._record_reference, **kwargs)
        return self._reference_sums

    def forward_backward(
        self, inputs, labels, positions, sequence, pair=None, *, context: Callable
    ) -> torch.Tensor:
        """This batch's share of the step's loss, backpropagated through the stages; the same on every
        pipeline rank."""
        target = self._target(inputs, labels, sequence, pair)
        kwargs = stage_inputs(self.parts, inputs, positions)
        with context():
            if self.reference is not None:
                self._reference_sums = torch.zeros_like(labels, dtype=torch.float64)
                self.reference.evaluate(inputs, target, loss=self._record_reference, **kwargs)
                for part in self.reference.model_parts:
                    part.eval()  # evaluate leaves its parts in training mode: the copy stays in eval
                target[:, REFERENCE] = self._reference_sums
            self._metric_sums = []
            loss = self.pipeline.step(inputs, target, loss=self._loss, **kwargs).detach()
        for metric_sums in self._metric_sums:
            self.step.sums += metric_sums
        return loss
