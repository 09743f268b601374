"""Loss and perplexity on a held-out dataset, measured during training every `validation.freq` steps."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from titan_data import SourceUnavailable
from titan_train.errors import ConfigError
from titan_train.faults.data_outage import agree_on_batches

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


def agreed_batches(batches: Iterator, steps: int, device: torch.device) -> Iterator:
    """Up to `steps` of `batches` (-1: all). Sharded models need every rank in each forward: all ranks
    stop together when one rank's data ends, or its source goes down (then all save together, see
    data_outage)."""
    count = 0
    while steps == -1 or count < steps:
        batch, failure = None, None
        try:
            batch = next(batches, None)
        except SourceUnavailable as err:
            failure = str(err)
        if not agree_on_batches(batch is not None, failure, device):
            return
        yield batch
        count += 1


class Validator:
    """Runs `steps` validation batches (-1: until some rank's data ends) from a fresh loader each time.

    `make_batches` builds that loader, so every validation sees the same data and comparisons across
    steps are fair. `batch_loss(inputs, labels)` is the mean loss of one batch as the trainer's layout
    computes it (a pipeline schedule's forward-only path, context parallelism, loss parallelism), the
    same number on every rank of a replica.
    """

    def __init__(
        self,
        make_batches: Callable[[], Batches],
        batch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        device: torch.device,
        freq: int,
        steps: int,
    ):
        self.make_batches, self.batch_loss, self.device = make_batches, batch_loss, device
        self.freq, self.steps = freq, steps

    def should_validate(self, step: int) -> bool:
        return step % self.freq == 0

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module]) -> tuple[float, float]:
        """(mean loss over batches and ranks, its perplexity)."""
        for part in model_parts:
            part.eval()
        total = torch.zeros((), device=self.device)
        count = 0
        try:
            for batch in agreed_batches(iter(self.make_batches()), self.steps, self.device):
                total += self.batch_loss(*(t.to(self.device) for t in batch)).float()
                count += 1
        finally:
            for part in model_parts:
                part.train()
        if count == 0:
            raise ConfigError(
                "validation: the validation dataset yields no full batch; use a larger dataset or a smaller "
                "validation.local_batch_size / validation.seq_len"
            )
        loss = total / count
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        value = loss.item()
        return value, math.exp(value)
