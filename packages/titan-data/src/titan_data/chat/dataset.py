"""Conversations as training rows: packed whole into `seq_len` rows, or one per row with padding.

Each conversation of n tokens becomes n - 1 (input, label) positions, so no label crosses into the
next conversation; its positions restart at 0, which is also how the model finds where a
conversation starts (document-masked attention). Rows are emitted whole, so a stream's place is
(epoch, next conversation): the pretraining loaders' state and re-dealing apply unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from titan_data.chat.masks import LOSS_ON, tokenize_conversation
from titan_data.chat.rows import RowFields, read_chat_rows
from titan_data.chat.template import ChatTemplate
from titan_data.datasets.windows import ONE_RANK, StreamLayout, WindowDataset
from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # a label no loss trains on: F.cross_entropy's default ignore_index
IGNORE = IGNORE_INDEX
OVERLONG = ("truncate", "drop")
BAD_ROWS = ("stop", "skip")


@dataclass(frozen=True)
class ChatOptions:
    """How rows become training examples (the `[sft]` section, without Titan's config)."""

    fields: RowFields = RowFields()
    loss_on: str = "assistant"
    packing: bool = True
    overlong: str = "truncate"
    bad_rows: str = "stop"

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("loss_on", self.loss_on, LOSS_ON),
            ("overlong", self.overlong, OVERLONG),
            ("bad_rows", self.bad_rows, BAD_ROWS),
        ):
            if value not in allowed:
                raise DataError(f"sft: {name} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(frozen=True)
class Example:
    """One conversation ready to place in a row: inputs and labels (IGNORE where not trained)."""

    inputs: np.ndarray
    labels: np.ndarray


def load_examples(
    path: str | Path,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    seq_len: int,
    options: ChatOptions,
    *,
    split: str = "",
    config: str = "",
    keep_row: Callable[[int], bool] | None = None,
) -> list[Example]:
    """Every conversation at `path` (its `split` and hub `config`, where it has them), tokenised and
    masked, over-long ones truncated or dropped; counts logged. `keep_row(i)` chooses rows by their number
    in the source, before any is dropped (a held-out share: see `datasets.holdout`)."""
    examples: list[Example] = []
    truncated = dropped = skipped = 0
    for number, row in enumerate(read_chat_rows(path, options.fields, split, config)):
        if keep_row is not None and not keep_row(number):
            continue
        try:
            if isinstance(row, DataError):
                raise row
            conv = tokenize_conversation(
                row.messages, template, tokenizer, options.loss_on, row.where, tools=row.tools
            )
        except DataError as err:
            if options.bad_rows == "stop":
                raise
            skipped += 1
            logger.warning("%s (skipped: sft.bad_rows = 'skip')", err)
            continue
        tokens, trained = conv.tokens, conv.trained
        if len(tokens) - 1 > seq_len:
            if options.overlong == "drop":
                dropped += 1
                continue
            truncated += 1
            tokens, trained = tokens[: seq_len + 1], trained[: seq_len + 1]
        if len(tokens) < 2:
            continue
        labels = np.where(trained[1:], tokens[1:], IGNORE)
        examples.append(Example(tokens[:-1], labels))
    if not examples:
        raise DataError(
            f"dataset: {path} holds no usable conversation ({dropped} dropped as longer than seq_len)"
        )
    logger.info(
        "chat data %s: %d conversations; over seq_len %d: %d truncated, %d dropped; %d bad rows skipped",
        path,
        len(examples),
        seq_len,
        truncated,
        dropped,
        skipped,
    )
    return examples


class ChatDataset(WindowDataset):
    """(inputs, labels, positions) rows of `seq_len` from conversations, dealt to streams like pretraining data.

    Conversation i goes to stream i % num_streams. With `packing`, a row takes whole conversations in
    order while they fit; otherwise one conversation per row. The rest of a row is padding: label
    IGNORE, positions counting on (so it joins the last conversation's document, after its tokens).
    Unpacked rows are yielded without positions: theirs are 0..seq_len-1, what a model assumes when
    given none, so a family that builds its own masks (gpt-oss) trains on them too.
    """

    def __init__(
        self,
        examples: list[Example],
        seq_len: int,
        *,
        packing: bool = True,
        pad_id: int = 0,
        streams: StreamLayout = ONE_RANK,
        infinite: bool = True,
        name: str = "chat",
    ):
        super().__init__(seq_len, streams, {"kind": "chat", "source": name, "packing": packing})
        if len(examples) < self.num_streams:
            raise DataError(
                f"dataset: {name} has {len(examples)} conversations, fewer than its {self.num_streams} streams"
            )
        self.packing, self.pad_id, self.infinite = packing, pad_id, infinite
        self.by_stream = {j: examples[j :: self.num_streams] for j in self.owned}

    def _start(self) -> None:
        pass

    def _take(self, stream: int, row_empty: bool) -> Example | None:
        """The stream's next conversation (the state is not advanced); None at the end of an epoch for a
        row already started (an epoch's last row is padded, not filled from the next), and at the end
        of a finite stream."""
        state, examples = self.streams[stream], self.by_stream[stream]
        if state.next_doc >= len(examples):
            if not (self.infinite and row_empty):
                return None
            state.epoch, state.next_doc = state.epoch + 1, 0
        return examples[state.next_doc]

    def _next_window(self, stream: int) -> np.ndarray | None:
        row = np.empty((3, self.seq_len), dtype=np.int64)
        row[0], row[1] = self.pad_id, IGNORE
        filled = 0
        while (example := self._take(stream, filled == 0)) is not None:
            n = len(example.inputs)
            if filled and (not self.packing or filled + n > self.seq_len):
                break
            row[0, filled : filled + n] = example.inputs
            row[1, filled : filled + n] = example.labels
            row[2, filled : filled + n] = np.arange(n)
            filled += n
            self.streams[stream].next_doc += 1
        if not filled:
            return None
        row[2, filled:] = np.arange(row[2, filled - 1] + 1, row[2, filled - 1] + 1 + self.seq_len - filled)
        return row

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        parts = 3 if self.packing else 2
        for window in self.windows():
            yield tuple(torch.from_numpy(window)[:parts])

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """(inputs, labels, positions) batches of `batch_size` rows (the last may be short when finite);
        (inputs, labels) when unpacked."""
        parts = 3 if self.packing else 2
        windows = self.windows()
        while rows := list(islice(windows, batch_size)):
            stacked = torch.from_numpy(np.stack(rows))
            yield tuple(stacked[:, i] for i in range(parts))
