"""Tokenise a document stream and pack it into fixed windows, in streams that ranks share out.

Documents are dealt to a fixed number of *streams* (document `i` to stream `i % num_streams`), and
the streams to data-parallel ranks (stream `j` to rank `j % dp_world_size`). Each stream packs its
own documents, framed by BOS/EOS, into windows of `seq_len + 1` tokens. The global batch is therefore
the same set of windows whatever the number of ranks, and a checkpoint (one entry per stream) can be
re-dealt to a different number of ranks without repeating or skipping any document.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset

from titan_data.datasets.sources import TextSource
from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer


@dataclass
class StreamState:
    """Where one stream stands: the next (epoch, document index) it takes, and unemitted tokens."""

    epoch: int = 0
    next_doc: int = 0
    windows_emitted: int = 0
    buffer: list[int] = field(default_factory=list)

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.next_doc)


def stream_key(stream: int) -> str:
    return f"stream_{stream}"


class PackedTokenDataset(IterableDataset):
    """(input, label) pairs shifted by one token, from this rank's streams in round-robin order.

    With `infinite`, every stream loops over epochs. `state_dict()` holds one entry per owned stream,
    keyed `stream_J`, so entries from every rank together describe the whole data position.
    """

    def __init__(
        self,
        source: TextSource,
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        num_streams: int = 0,
        infinite: bool = True,
    ):
        num_streams = num_streams or dp_world_size
        if not 0 <= dp_rank < dp_world_size:
            raise DataError(f"dataset: dp_rank {dp_rank} is outside dp_world_size {dp_world_size}")
        if num_streams < dp_world_size:
            raise DataError(
                f"dataset: num_streams ({num_streams}) is smaller than the data-parallel degree "
                f"({dp_world_size}); every rank needs at least one stream, so raise num_streams"
            )
        if seq_len < 1:
            raise DataError(f"dataset: seq_len must be >= 1, got {seq_len}")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.num_streams = num_streams
        self.infinite = infinite
        self.owned = list(range(dp_rank, num_streams, dp_world_size))
        self.streams = {j: StreamState() for j in self.owned}
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size

    def _documents_from(self, start: tuple[int, int]) -> Iterator[tuple[int, int, str]]:
        """(epoch, index, text) of every document from `start` on, looping if `infinite`."""
        epoch, first = start
        while True:
            seen_any = False
            for index, text in enumerate(self.source.read()):
                seen_any = True
                if index >= first:
                    yield epoch, index, text
            if not seen_any:
                raise DataError(f"dataset: '{self.source.name}' at {self.source.path} holds no documents")
            if not self.infinite:
                return
            epoch, first = epoch + 1, 0

    def _take(self, stream: StreamState, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.tensor(stream.buffer[:window], dtype=torch.long)
        del stream.buffer[:window]
        stream.windows_emitted += 1
        return tokens[:-1], tokens[1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        window = self.seq_len + 1
        start = min(s.position for s in self.streams.values())
        documents = self._documents_from(start)
        while True:
            # The stream that has emitted least goes next: a round robin that needs no saved cursor.
            j = min(self.owned, key=lambda k: (self.streams[k].windows_emitted, k))
            stream = self.streams[j]
            while len(stream.buffer) < window:
                document = next(documents, None)
                if document is None:
                    return
                epoch, index, text = document
                owner = self.streams.get(index % self.num_streams)
                if owner is None or (epoch, index) < owner.position:
                    continue  # another rank's document, or one this stream consumed before a resume
                owner.buffer.extend(self.tokenizer.encode(text, bos=True, eos=True))
                owner.epoch, owner.next_doc = epoch, index + 1
            yield self._take(stream, window)

    def state_dict(self) -> dict[str, Any]:
        """One pickled entry per owned stream (bytes, so checkpoints store it as an opaque object)."""
        return {stream_key(j): pickle.dumps(self.streams[j]) for j in self.owned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [stream_key(j) for j in self.owned if stream_key(j) not in state]
        if missing:
            raise DataError(
                f"dataset: the saved data state lacks {', '.join(missing)}; was it saved with fewer streams?"
            )
        self.streams = {j: pickle.loads(state[stream_key(j)]) for j in self.owned}
