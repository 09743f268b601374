"""A resumable batch loader over a packed or memory-mapped dataset."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_data.datasets.windows import WindowDataset


class _Batches(IterableDataset):
    """A dataset's windows already batched: one stack per batch instead of a collate per window."""

    def __init__(self, dataset: WindowDataset, batch_size: int):
        self.dataset, self.batch_size = dataset, batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.dataset.batches(self.batch_size)


class TokenLoader(StatefulDataLoader):
    """Batches of (input, label) from a packed or memory-mapped dataset, resumable at any batch boundary.

    `state_dict()` is the dataset's per-stream state: its keys are unique across ranks, so a
    checkpointer can save every rank's entries side by side and deal them out again on load.
    """

    def __init__(self, dataset: WindowDataset, batch_size: int):
        # Workers would tokenise ahead of the saved position; the state is exact only in-process.
        super().__init__(_Batches(dataset, batch_size), batch_size=None, num_workers=0)
        self.packed = dataset

    def state_dict(self) -> dict[str, Any]:
        return self.packed.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.packed.load_state_dict(state)
