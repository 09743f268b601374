"""Multi-token prediction in a run: the depths the model is built with, the loss that adds
theirs, the layouts it runs under, and the number the log line reports.

`model.num_mtp_layers` D builds the family's MTP depths (a family whose args have `num_mtp_layers`); in training
the model returns the main logits followed by each depth's along the sequence. `MTPLoss` turns them
into the paper's objective, L = L_main + (lambda / D) * sum_k L_k with lambda `model.mtp_loss_weight`,
where L_k is the configured loss (the mean over labels, as the main loss is) of depth k's positions
0..T-k-1 against labels k..T-1 (position i of depth k predicts token i + k + 2). Evaluation sees the
main logits alone, so validation's loss is the main loss. Each micro-batch and data-parallel rank
weighs the same number of MTP targets in pretraining, so the layouts' equal-weight averages give the
mean over the step, as for the main loss; chat rows (a different share of each row masked) are refused.

The log line's `loss` is the objective (what is backpropagated); `mtp_loss` beside it is
(1 / D) * sum_k L_k, averaged over the step's micro-batches and the data-parallel ranks, so the main
loss is loss - mtp_loss_weight * mtp_loss. Under pipeline parallelism the depths sit on the last stage
with the output head and the loss (the model's `pipeline_units`), and the other stages take the
step's `mtp_loss` from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_models.mtp_logits import split_mtp_logits
from titan_parallel import ParallelDims
from titan_train.config.model_rules import takes_mtp
from titan_train.config.schema import JobConfig
from titan_train.config.sft_section import renders_chat_template
from titan_train.registry import LossFn


def mtp_run_args(config: JobConfig, args: Any) -> Any:
    """`args` with `model.num_mtp_layers` depths (a family that takes them, checked at start in
    config/model_rules.py)."""
    m = config.model
    if m.num_mtp_layers == 0:
        return args
    return dataclasses.replace(args, num_mtp_layers=m.num_mtp_layers)


def mtp_problems(config: JobConfig, dims: ParallelDims, args: Any) -> list[str]:
    """The layouts and data multi-token prediction does not run with yet, one line each."""
    if not (takes_mtp(args) and args.num_mtp_layers):
        return []
    unsupported = [
        (
            dims.pp > 1 and dims.tp > 1,
            "pipeline and tensor parallelism together (the embeddings the stages carry to the depths are "
            "split along the sequence)",
        ),
        (
            dims.cp > 1,
            "parallelism.context_parallel_degree > 1 (a depth reads tokens k places ahead, on another rank)",
        ),
        (
            renders_chat_template(config.training),
            "chat or preference rows (their masked labels would weigh the MTP loss unevenly)",
        ),
    ]
    return [
        f"model.num_mtp_layers = {args.num_mtp_layers} with {what}: not supported"
        for on, what in unsupported
        if on
    ]


class MTPLoss:
    """The configured loss plus the MTP depths' (see the module); remembers the step's MTP losses for the
    log line. Logits of the sequence's length alone (evaluation) give the main loss."""

    def __init__(self, loss_fn: LossFn, weight: float):
        self.loss_fn, self.weight = loss_fn, weight
        self._losses: list[torch.Tensor] = []
        self._rehearsing: Callable[[], bool] = lambda: False

    def ignore_while(self, rehearsing: Callable[[], bool]) -> None:
        """Keep no MTP loss while `rehearsing()`: a pipeline's metadata inference runs the loss on
        stand-in tensors in its first step (`Pipeline.inferring_metadata`)."""
        self._rehearsing = rehearsing

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq_len = labels.shape[1]
        main, *depths = split_mtp_logits(logits, seq_len)
        loss = self.loss_fn(main, labels)
        if not depths:
            return loss
        ahead = [self.loss_fn(x[:, : seq_len - k], labels[:, k:]) for k, x in enumerate(depths, start=1)]
        mtp = sum(ahead) / len(ahead)
        if not self._rehearsing():
            value = mtp.detach()
            self._losses.append(value.full_tensor() if isinstance(value, DTensor) else value)
        return loss + self.weight * mtp

    def begin_step(self) -> None:
        """Forget the previous step's MTP losses."""
        self._losses = []

    def step_mean(
        self,
        group: dist.ProcessGroup | None,
        *,
        last_stage: tuple[dist.ProcessGroup, int] | None = None,
        device: torch.device | str = "cpu",
    ) -> float | None:
        """The step's MTP loss: the mean over its micro-batches and the ranks of `group` (data
        parallelism), which all call it together; None before any training forward. Under pipeline
        parallelism only the last stage computes it: `last_stage` (the pipeline group and that stage's
        rank in it) broadcasts its mean to the other stages first."""
        mean = torch.stack(self._losses).float().mean() if self._losses else None
        if last_stage is not None:
            pp_group, src = last_stage
            mean = torch.full((), float("nan"), device=device) if mean is None else mean
            dist.broadcast(mean, group=pp_group, group_src=src)
            mean = None if mean.isnan() else mean
        if mean is None:
            return None
        if group is not None:
            dist.all_reduce(mean, group=group)
            mean = mean / dist.get_world_size(group)
        return float(mean)
