"""Preference tuning (DPO and its family, as TRL defines them) as the run's objective: the pair loss of
`titan_train.objectives.preference_step`, its reference (a frozen copy, the policy with adapters off, a
precomputed table, or none), under a pipeline where there is one, and its held-out validation."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from titan_ckpt import ModelState
from titan_train.config.preference_section import PreferenceLoss
from titan_train.objectives.forward import model_forward, sequence_dealer, whole_sequence_context
from titan_train.objectives.preference_pipeline import PipelinedPreference
from titan_train.objectives.preference_reference import PrecomputedReference, precompute_reference
from titan_train.objectives.preference_step import PreferenceStep, build_reference, copy_starting_weights
from titan_train.objectives.preference_validation import PreferenceValidator
from titan_train.objectives.protocol import Batch, ObjectiveContext
from titan_train.wiring.lora import lora_enabled


class Preference:
    """Pairs in, the mean pair loss over the step out; TRL's rewards/* and logps/* as its metrics."""

    def __init__(self, ctx: ObjectiveContext):
        self.ctx, self.plan = ctx, ctx.plan
        config, dims = ctx.plan.config, ctx.plan.dims
        source = PreferenceLoss.of(config.preference).reference_source(lora_enabled(config))
        self.reference_logps = None
        if source == "precompute":
            self.reference_logps = PrecomputedReference(len(ctx.loader.packed.pairs), ctx.device)
        references = []  # the frozen copy as built: its parts and, under a pipeline, its own schedule

        def build_copy() -> list[torch.nn.Module]:
            references.append(ctx.build_copy())
            return references[-1].parts

        self.reference_parts = build_reference(source, build_copy)
        dp, pp = dims.submesh("dp"), dims.submesh("pp")
        self.dp_group = dp.get_group() if dp is not None else None
        self.dp_rank, self.dp_degree = (dp.get_local_rank(), dp.size()) if dp is not None else (0, 1)
        self.forward = functools.partial(model_forward, ctx.parts)
        self.step = PreferenceStep(
            config,
            ctx.parts,
            self.reference_parts,
            self.forward,
            seq_len=config.training.seq_len,
            dp_degree=dims.dp_degree,
            group=self.dp_group,
            precomputed=self.reference_logps,
            pp_group=pp.get_group() if pp is not None else None,
            deal=sequence_dealer(self.plan, [*ctx.parts, *(self.reference_parts or [])]),
            cp_group=dims.submesh("cp").get_group() if dims.cp > 1 else None,
        )
        self.pipelined = None
        if ctx.pipeline is not None:
            self.pipelined = PipelinedPreference(
                self.step, ctx.pipeline, references[0].pipeline if references else None
            )

    def context(self):
        return whole_sequence_context(self.plan, self.ctx.forward_context)

    def states(self) -> dict:
        return {
            **({"reference": ModelState(self.reference_parts)} if self.reference_parts else {}),
            **({"reference_logps": self.reference_logps} if self.reference_logps else {}),
        }

    def start(self, step: int, loader) -> None:
        """From step 0: the reference takes the starting weights, now loaded (a resumed run loaded the
        reference with the checkpoint), or gives its log-probs of every pair, computed now."""
        if step != 0:
            return
        if self.reference_parts is not None:
            copy_starting_weights(self.reference_parts, self.ctx.parts)
        if self.reference_logps is not None:
            precompute_reference(
                self.reference_logps,
                loader.packed,
                self.ctx.parts,
                self.forward,
                self.context,
                batch_size=self.plan.config.training.local_batch_size,
                dp_rank=self.dp_rank,
                dp_degree=self.dp_degree,
                group=self.dp_group,
                window_sums=self.pipelined.reference_sums if self.pipelined else None,
                pp_group=self.step.pp_group,
            )

    def begin_step(self, step_batches: list[Batch]) -> None:
        self.step.begin_step(step_batches)  # the step's pairs are counted before its first forward

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        pairs = self.pipelined or self.step
        return pairs.forward_backward(*batch, context=self.context)

    def end_step(self) -> dict[str, float]:
        return self.step.end_step()

    def log_metrics(self) -> dict[str, float]:
        return {}

    def validator(self, batches: Callable[[], Iterable]) -> PreferenceValidator:
        v = self.plan.config.validation
        return PreferenceValidator(
            batches,
            self.step,
            self.context,
            seq_len=v.seq_len,
            device=self.ctx.device,
            freq=v.freq,
            steps=v.steps,
        )
