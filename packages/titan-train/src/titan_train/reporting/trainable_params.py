"""The run's parameters as a fine-tuner reads them at start: how many, and how many train.

Under LoRA (or QLoRA) the base is frozen and only the adapters (and, with `lora.train_embeddings`, the
embeddings) train, so the share that trains is the number that says what the run is. Counted on the
built model parts: a sharded parameter counts its whole tensor (a DTensor's numel is the global one),
and pipeline stages, which hold different layers, add their counts over the pipeline ranks.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)


def count_trainable(
    parts: list[nn.Module], pp_group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> tuple[int, int]:
    """(total, trainable) parameters of the model; every rank of `pp_group` calls it together (the
    counts travel on `device`, the one its backend takes)."""
    total = trainable = 0
    for part in parts:
        for p in part.parameters():
            total += p.numel()
            trainable += p.numel() if p.requires_grad else 0
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        counts = torch.tensor([total, trainable], dtype=torch.int64, device=device)
        dist.all_reduce(counts, group=pp_group)
        total, trainable = (int(x) for x in counts.tolist())
    return total, trainable


def log_trainable(total: int, trainable: int) -> None:
    """One line: `parameters: 364,864 (28,672 trainable, 7.86%)`."""
    share = 100.0 * trainable / total if total else 0.0
    logger.info("parameters: %s (%s trainable, %.2f%%)", f"{total:,}", f"{trainable:,}", share)
