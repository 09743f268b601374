"""Preference pairs as training windows, packed or padded, a pair never split between windows.

A window holds (inputs, labels, positions, sequence) rows. `sequence` numbers the window's sequences
2k (the chosen of its k-th pair) and 2k + 1 (its rejected), -1 on padding, so the trainer can sum each
sequence's log-probabilities and match each chosen with its rejected. With `pair_index`, a fifth row
holds each position's pair's index in `pairs` (-1 on padding), the key of log-probs computed once
before training (`preference.reference = "precompute"`). Packed, a window is one row of
`seq_len` holding whole pairs in order while they fit, positions restarting at each sequence (the
document masks chat packing uses). Padded, a window is one pair's two rows side by side (width
2 x seq_len), which the trainer reads as two rows. Since every window holds whole pairs, a batch
(micro-batch, rank) never splits one. Streams, their state and re-dealing are the chat dataset's.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np
import torch

from titan_data.chat.dataset import IGNORE
from titan_data.datasets.windows import ONE_RANK, StreamLayout, WindowDataset
from titan_data.errors import DataError
from titan_data.preference.pairs import Pair

NO_SEQUENCE = -1


class PreferenceDataset(WindowDataset):
    """(inputs, labels, positions, sequence) windows of preference pairs; pair i goes to stream i % num_streams."""

    def __init__(
        self,
        pairs: list[Pair],
        seq_len: int,
        *,
        packing: bool = True,
        pad_id: int = 0,
        streams: StreamLayout = ONE_RANK,
        infinite: bool = True,
        name: str = "preference",
        pair_index: bool = False,
    ):
        super().__init__(seq_len, streams, {"kind": "preference", "source": name, "packing": packing})
        if len(pairs) < self.num_streams:
            raise DataError(
                f"dataset: {name} has {len(pairs)} pairs, fewer than its {self.num_streams} streams"
            )
        self.packing, self.pad_id, self.infinite = packing, pad_id, infinite
        self.pairs, self.rows = pairs, 5 if pair_index else 4
        self.by_stream = {j: pairs[j :: self.num_streams] for j in self.owned}

    @property
    def width(self) -> int:
        """Positions per window: one row packed, two rows (a pair) padded."""
        return self.seq_len if self.packing else 2 * self.seq_len

    def _start(self) -> None:
        pass

    def _take(self, stream: int, window_empty: bool) -> Pair | None:
        state, pairs = self.streams[stream], self.by_stream[stream]
        if state.next_doc >= len(pairs):
            if not (self.infinite and window_empty):
                return None
            state.epoch, state.next_doc = state.epoch + 1, 0
        return pairs[state.next_doc]

    def _place(self, window: np.ndarray, start: int, example, sequence: int, index: int) -> int:
        n = len(example.inputs)
        window[0, start : start + n] = example.inputs
        window[1, start : start + n] = example.labels
        window[2, start : start + n] = np.arange(n)
        window[3, start : start + n] = sequence
        window[4:, start : start + n] = index
        return start + n

    def _next_window(self, stream: int) -> np.ndarray | None:
        window = np.empty((self.rows, self.width), dtype=np.int64)
        window[0], window[1], window[3:] = self.pad_id, IGNORE, NO_SEQUENCE
        window[2] = np.arange(self.width) % self.seq_len
        rows, placed, filled = (self.width // self.seq_len), 0, 0
        while (pair := self._take(stream, placed == 0)) is not None:
            if placed and (not self.packing or filled + pair.length > self.seq_len):
                break
            index = stream + self.streams[stream].next_doc * self.num_streams  # by_stream's slicing
            if self.packing:
                filled = self._place(window, filled, pair.chosen, 2 * placed, index)
                filled = self._place(window, filled, pair.rejected, 2 * placed + 1, index)
            else:
                self._place(window, 0, pair.chosen, 0, index)
                self._place(window, self.seq_len, pair.rejected, 1, index)
            placed += 1
            self.streams[stream].next_doc += 1
        if not placed:
            return None
        for r in range(rows):  # padding continues the positions of the row's last sequence
            row = window[2, r * self.seq_len : (r + 1) * self.seq_len]
            used = np.flatnonzero(window[3, r * self.seq_len : (r + 1) * self.seq_len] != NO_SEQUENCE)
            end = used[-1] + 1
            row[end:] = np.arange(row[end - 1] + 1, row[end - 1] + 1 + self.seq_len - end)
        return window

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for window in self.windows():
            yield tuple(torch.from_numpy(window))

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """(inputs, labels, positions, sequence[, pair]) batches of `batch_size` windows (the last may be
        short when finite); each tensor is [windows, width]."""
        windows = self.windows()
        while rows := list(islice(windows, batch_size)):
            stacked = torch.from_numpy(np.stack(rows))
            yield tuple(stacked[:, i] for i in range(self.rows))
