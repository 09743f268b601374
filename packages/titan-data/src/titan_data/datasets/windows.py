"""What the packed and the memory-mapped datasets share: streams dealt to ranks, the round robin
over a rank's streams, and turning windows of `seq_len + 1` tokens into (input, label) batches."""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from titan_data.datasets.streams import StreamState, load_streams, save_streams, stream_key
from titan_data.errors import DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamLayout:
    """How a dataset's streams are dealt to data-parallel ranks: rank `rank` of `world_size` reads
    streams rank, rank + world_size, ... of `num_streams` (0, the default: one stream per rank).

    The same number of streams gives the same windows at any number of ranks that divides it, and a
    checkpoint (one entry per stream) resumes at any of them.
    """

    rank: int = 0
    world_size: int = 1
    num_streams: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise DataError(
                f"dataset: rank {self.rank} is not one of the {self.world_size} data-parallel ranks "
                f"(0 to {self.world_size - 1})"
            )
        num_streams = self.num_streams or self.world_size
        if num_streams < self.world_size:
            raise DataError(
                f"dataset: num_streams ({num_streams}) is smaller than the data-parallel degree "
                f"({self.world_size}); every rank needs at least one stream, so raise num_streams"
            )
        if num_streams % self.world_size:
            logger.warning(
                "dataset: num_streams (%d) is not a multiple of the data-parallel degree (%d): ranks read "
                "unequal numbers of streams, so batches differ from those at other world sizes",
                num_streams,
                self.world_size,
            )
        object.__setattr__(self, "num_streams", num_streams)

    @property
    def owned(self) -> list[int]:
        """The streams this rank reads."""
        return list(range(self.rank, self.num_streams, self.world_size))


ONE_RANK = StreamLayout()  # a single process reading one stream: the datasets' default


class WindowDataset(IterableDataset):
    """This rank's streams, emitting windows round robin: the stream that has emitted fewest goes
    next (lowest id on ties), which needs no saved cursor and gives the same global order at any
    number of ranks. Subclasses say how a stream makes its next window."""

    remote = False  # whether windows come from a source read over a network (see TextSource.remote)

    def __init__(self, seq_len: int, streams: StreamLayout, layout: dict[str, Any]):
        if seq_len < 1:
            raise DataError(f"dataset: seq_len must be >= 1, got {seq_len}")
        self.seq_len, self.stream_layout = seq_len, streams
        self.num_streams, self.owned = streams.num_streams, streams.owned
        self.layout = {**layout, "num_streams": self.num_streams}
        self.streams = {j: StreamState() for j in self.owned}

    @abstractmethod
    def _start(self) -> None:
        """Prepare to read from the streams' current state (called at every new iteration)."""

    @abstractmethod
    def _next_window(self, stream: int) -> np.ndarray | None:
        """The stream's next `seq_len + 1` tokens, its state advanced; None when a finite stream ends."""

    def windows(self) -> Iterator[np.ndarray]:
        """Every window of this rank, in round-robin order over its streams."""
        return (window for _, window in self.tagged_windows())

    def tagged_windows(self) -> Iterator[tuple[int, np.ndarray]]:
        """(stream, window) for every window of this rank, in round-robin order over its streams."""
        self._start()
        active = list(self.owned)
        while active:
            j = min(active, key=lambda k: (self.streams[k].windows_emitted, k))
            window = self._next_window(j)
            if window is None:
                active.remove(j)
                continue
            self.streams[j].windows_emitted += 1
            yield j, window

    def stream_entry(self, stream: int) -> bytes:
        """One stream's entry of `state_dict()`, as it stands now."""
        return save_streams({stream: self.streams[stream]}, self.layout)[stream_key(stream)]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for window in self.windows():
            tokens = torch.from_numpy(window.astype(np.int64))
            yield tokens[:-1], tokens[1:]

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input, label) batches of `batch_size` windows (the last may be short when finite), each
        window cast straight into the two int64 tensors, with no stacked intermediate."""
        windows = self.windows()
        while True:
            rows = list(islice(windows, batch_size))
            if not rows:
                return
            inputs = torch.empty(len(rows), self.seq_len, dtype=torch.int64)
            labels = torch.empty(len(rows), self.seq_len, dtype=torch.int64)
            inputs_np, labels_np = inputs.numpy(), labels.numpy()
            for i, window in enumerate(rows):
                inputs_np[i] = window[:-1]
                labels_np[i] = window[1:]
            yield inputs, labels

    def state_dict(self) -> dict[str, Any]:
        """One pickled entry per owned stream, keyed `stream_J` (bytes: checkpoints store it as an
        opaque object); entries from every rank together describe the whole data position."""
        return save_streams(self.streams, self.layout)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streams = load_streams(state, self.owned, self.layout)
