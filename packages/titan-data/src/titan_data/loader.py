"""A resumable batch loader over a packed or memory-mapped dataset."""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from titan_data.datasets.memmap import MemmapTokenDataset
from titan_data.datasets.packed import PackedTokenDataset


class TokenLoader(StatefulDataLoader):
    """Batches of (input, label) from a packed dataset, resumable at any batch boundary.

    `state_dict()` is the dataset's per-stream state: its keys are unique across ranks, so a
    checkpointer can save every rank's entries side by side and deal them out again on load.
    """

    def __init__(self, dataset: PackedTokenDataset | MemmapTokenDataset, batch_size: int):
        # Workers would tokenise ahead of the saved position; the state is exact only in-process.
        super().__init__(dataset, batch_size=batch_size, num_workers=0)
        self.packed = dataset

    def state_dict(self) -> dict[str, Any]:
        return self.packed.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.packed.load_state_dict(state)
