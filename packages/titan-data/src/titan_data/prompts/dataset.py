"""Prompts as fixed-width windows, one prompt each, dealt to streams like chat rows.

A window is three rows of `max_length`: the prompt's ids (padded on the right with `pad_id`), 1 where an
id is the prompt's and 0 on padding, and the prompt's index in the loaded list (every position), which is
how the trainer finds the row's other columns for the reward functions. Prompt i goes to stream
i % num_streams; streams, their saved state and re-dealing are the window datasets'.

With `repeat` > 1 a stream emits each run of `chunk` prompts `repeat` times before the next run (TRL's
`num_iterations`: one generation batch trained on for several optimizer steps, `chunk` being a step's
prompts), so the data's position stays where the steps are, and a resume mid-repetition reads the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np
import torch

from titan_data.datasets.windows import ONE_RANK, StreamLayout, WindowDataset
from titan_data.errors import DataError
from titan_data.prompts.rows import Prompt


class PromptDataset(WindowDataset):
    """(ids, valid, index) windows of one prompt each."""

    def __init__(
        self,
        prompts: list[Prompt],
        max_length: int,
        *,
        pad_id: int = 0,
        streams: StreamLayout = ONE_RANK,
        infinite: bool = True,
        name: str = "prompts",
        repeat: int = 1,
        chunk: int = 1,
    ):
        layout = {
            "kind": "prompts",
            "source": name,
            **({"repeat": repeat, "chunk": chunk} if repeat > 1 else {}),
        }
        super().__init__(max_length, streams, layout)
        if repeat < 1 or chunk < 1:
            raise DataError(f"dataset: repeat and chunk must be at least 1, got {repeat} and {chunk}")
        self.repeat, self.chunk = repeat, chunk
        if len(prompts) < self.num_streams:
            raise DataError(
                f"dataset: {name} has {len(prompts)} prompts, fewer than its {self.num_streams} streams"
            )
        self.prompts, self.pad_id, self.infinite = prompts, pad_id, infinite
        self.by_stream = {j: list(range(j, len(prompts), self.num_streams)) for j in self.owned}

    def _start(self) -> None:
        pass

    def _next_window(self, stream: int) -> np.ndarray | None:
        state, indices = self.streams[stream], self.by_stream[stream]
        if self.repeat > 1:  # next_doc counts windows: each run of `chunk` prompts comes `repeat` times
            cycle = self.chunk * self.repeat
            position = (state.next_doc // cycle) * self.chunk + state.next_doc % self.chunk
            if position >= len(indices) and not self.infinite:
                return None
            state.epoch = position // len(indices)
            index = indices[position % len(indices)]
        else:
            if state.next_doc >= len(indices):
                if not self.infinite:
                    return None
                state.epoch, state.next_doc = state.epoch + 1, 0
            index = indices[state.next_doc]
        state.next_doc += 1
        ids = self.prompts[index].ids
        window = np.zeros((3, self.seq_len), dtype=np.int64)
        window[0] = self.pad_id
        window[0, : len(ids)], window[1, : len(ids)], window[2] = ids, 1, index
        return window

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for window in self.windows():
            yield tuple(torch.from_numpy(window))

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """(ids, valid, index) batches of `batch_size` prompts, each tensor [prompts, max_length]."""
        windows = self.windows()
        while rows := list(islice(windows, batch_size)):
            stacked = torch.from_numpy(np.stack(rows))
            yield tuple(stacked[:, i] for i in range(3))
