"""The loss of masked data (chat rows): the mean over every trained token of the step, whatever the layout.

Each micro-batch's loss is its own mean over the labels it trains on, and the layouts then average
micro-batches (gradient accumulation, pipeline microbatches) and data-parallel ranks with equal
weights. That is the step's mean only when every micro-batch trains on as many tokens, which holds
for pretraining and not for chat rows, where each row masks a different share. So before a step the
trained labels of all its micro-batches are counted over the data-parallel ranks, and each
micro-batch's mean is weighted by its count over the average count: the equal-weight averages then
give the mean over the step's trained tokens, as one process computes it on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from titan_data import IGNORE_INDEX
from titan_train.registry import LossFn


def _as(ref: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` in the form `ref` has: a replicated DTensor under loss parallelism."""
    if isinstance(ref, DTensor):
        return DTensor.from_local(value, ref.device_mesh, [Replicate()] * ref.device_mesh.ndim)
    return value


class ValidTokenWeights:
    """Weights each micro-batch's mean loss by its share of the step's trained tokens (see the module)."""

    def __init__(self) -> None:
        self.average_count: torch.Tensor | None = None

    def begin_step(
        self, labels: list[torch.Tensor], shares: int, group: dist.ProcessGroup | None = None
    ) -> None:
        """Count the trained labels of a step's micro-batches over the ranks of `group` (data
        parallelism), to be split into `shares` equally weighted losses (ranks x micro-batches x
        pipeline microbatches). Every rank of `group` calls it together."""
        count = torch.stack([(x != IGNORE_INDEX).sum() for x in labels]).sum().float()
        if group is not None:
            dist.all_reduce(count, group=group)
        self.average_count = count.clamp_min(1.0) / shares  # a step with none: every weight 0

    def wrap(self, loss_fn: LossFn) -> LossFn:
        """`loss_fn` (a mean over trained labels) weighted by the micro-batch's count over the average."""

        def weighted(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            if self.average_count is None:
                raise RuntimeError("ValidTokenWeights.begin_step was not called before the step's loss")
            count = (labels != IGNORE_INDEX).sum()
            # A micro-batch with nothing to train on has a 0/0 mean; it weighs nothing either way.
            mean = torch.nan_to_num(loss_fn(logits, labels), nan=0.0)
            weight = (count / self.average_count).to(mean.dtype)
            return mean * _as(mean, weight)

        return weighted
