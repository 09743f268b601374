"""Next-token prediction: pretraining on text and chat SFT (labels masked outside the trained turns),
with the MTP depths' loss riding on it where the model has them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from titan_train.objectives.forward import layout_context, model_forward
from titan_train.objectives.protocol import Batch, ObjectiveContext
from titan_train.objectives.validation import Validator
from titan_train.step.stage_inputs import stage_inputs
from titan_train.wiring.mtp import MTPLoss


class NextToken:
    """The token loss over labels != -100, divided by the step's count of them (`token_weights` for chat
    rows, whose masks keep a different share of each row; see valid_token_loss)."""

    def __init__(self, ctx: ObjectiveContext):
        self.ctx, self.plan = ctx, ctx.plan
        self.mtp_loss = ctx.loss_fn if isinstance(ctx.loss_fn, MTPLoss) else None
        if self.mtp_loss is not None and ctx.pipeline is not None:
            pipeline = ctx.pipeline
            self.mtp_loss.ignore_while(lambda: pipeline.inferring_metadata)

    def states(self) -> dict:
        return {}

    def start(self, step: int, loader) -> None:
        pass

    def begin_step(self, step_batches: list[Batch]) -> None:
        """Count the step's trained tokens over the data-parallel ranks, so that each micro-batch's loss
        weighs its share of them."""
        if self.mtp_loss is not None:
            self.mtp_loss.begin_step()
        if self.ctx.token_weights is None:
            return
        dims, pipeline = self.plan.dims, self.ctx.pipeline
        microbatches = pipeline.n_microbatches if pipeline is not None else 1
        dp = dims.submesh("dp")
        self.ctx.token_weights.begin_step(
            [batch[1] for batch in step_batches],
            # Context-parallel ranks each average their part of the rows' labels: as many shares again.
            dims.dp_degree * dims.cp * len(step_batches) * microbatches,
            dp.get_group() if dp is not None else None,
        )

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """Loss of one micro-batch, gradients accumulated, on `train_loss_fn` (the loss scaled for
        gradient accumulation, see `micro_batch_loss`)."""
        inputs, labels, *positions = batch
        position = positions[0] if positions else None
        ctx = self.ctx
        with layout_context(self.plan, ctx.parts, inputs, labels, position):
            if ctx.pipeline is not None:
                return ctx.pipeline.step(inputs, labels, **stage_inputs(ctx.parts, inputs, position)).detach()
            with ctx.forward_context():
                loss = ctx.train_loss_fn(model_forward(ctx.parts, inputs, position), labels)
            loss.backward()
        # Under loss parallelism the loss is a replicated DTensor.
        return loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()

    def end_step(self) -> dict[str, float]:
        return {}

    def log_metrics(self) -> dict[str, float]:
        """The MTP depths' mean loss over the step (a collective over the data-parallel ranks)."""
        if self.mtp_loss is None:
            return {}
        dp, pipe = self.plan.dims.submesh("dp"), self.ctx.pipeline
        last_stage = (pipe.pp_mesh.get_group(), pipe.last_stage_rank) if pipe is not None else None
        value = self.mtp_loss.step_mean(
            dp.get_group() if dp else None, last_stage=last_stage, device=self.ctx.device
        )
        return {} if value is None else {"mtp_loss": value}

    def validation_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean loss of one validation batch, forward only, through the same layout as training."""
        ctx = self.ctx
        with layout_context(self.plan, ctx.parts, inputs, labels, positions):
            if ctx.pipeline is not None:
                return ctx.pipeline.evaluate(inputs, labels, **stage_inputs(ctx.parts, inputs, positions))
            with ctx.forward_context():
                loss = ctx.loss_fn(model_forward(ctx.parts, inputs, positions), labels)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def validator(self, batches: Callable[[], Iterable]) -> Validator:
        v = self.plan.config.validation
        return Validator(batches, self.validation_loss, device=self.ctx.device, freq=v.freq, steps=v.steps)
