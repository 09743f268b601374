"""How a rank's streams get their documents: dealt one by one, or whole shards at a time.

Document dealing: document i of the source goes to stream i % num_streams, so every rank reads the
whole source and keeps its streams' documents. Shard dealing (when the source's shards are equal
and their number is a multiple of num_streams): stream j reads only shards j, j + num_streams, ...
so a rank reads nothing it throws away, which matters when C4 is streamed over the network.
Both give every stream the same documents in the same order at any number of ranks.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from titan_data.datasets.sources import DocumentReader, TextSource
from titan_data.datasets.streams import StreamState
from titan_data.errors import DataError

logger = logging.getLogger(__name__)

Encode = Callable[[str], np.ndarray]


def choose_dealing(source: TextSource, num_streams: int) -> str:
    """ "shard" when whole shards can be dealt evenly to the streams, else "document"."""
    shards = source.num_shards
    if num_streams > 1 and source.equal_shards and shards % num_streams == 0:
        return "shard"
    if num_streams > 1 and source.equal_shards and shards > num_streams:
        logger.warning(
            "%s: its %d shards are not a multiple of num_streams (%d), so every rank reads the whole "
            "source and keeps every %d-th document; a num_streams that divides %d lets each rank read "
            "only its own shards",
            source.name,
            shards,
            num_streams,
            num_streams,
            shards,
        )
    return "document"


class Dealing(ABC):
    """Feeds a rank's streams with encoded documents; `feed(j)` adds at least one document's tokens to
    some owned stream (stream j for shard dealing) and returns False once a finite source is spent."""

    def __init__(
        self,
        source: TextSource,
        streams: dict[int, StreamState],
        num_streams: int,
        infinite: bool,
        encode: Encode,
    ):
        self.source, self.streams, self.num_streams = source, streams, num_streams
        self.infinite, self.encode = infinite, encode

    @abstractmethod
    def feed(self, stream: int) -> bool: ...


class DocumentDealing(Dealing):
    """One reader over the whole source; document i feeds stream i % num_streams if this rank owns it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Start where the least advanced stream stands; documents others already took are skipped.
        first = min(self.streams.values(), key=lambda s: s.position)
        self.epoch, self.index = first.position
        self.reader: DocumentReader | None = None
        self.start_resume = first.resume

    def feed(self, stream: int) -> bool:
        """Read one document into whichever owned stream it belongs to; False when a finite source ends.
        Documents of other ranks' streams (or taken before a resume) are passed over undecoded."""
        if self.reader is None:
            self.reader = self.source.open(self.start_resume)
        owner = self.streams.get(self.index % self.num_streams)
        wanted = owner is not None and (self.epoch, self.index) >= owner.position
        if wanted:
            text = next(self.reader, None)
            more = text is not None
        else:
            more = self.reader.skip()
        if not more:
            if self.index == 0:
                raise DataError(
                    f"dataset: '{self.source.name}' at {self.source.location} holds no documents; point dataset_path at files with a non-empty 'text' field"
                )
            if self.infinite and self.index < self.num_streams:
                raise DataError(
                    f"dataset: '{self.source.name}' holds {self.index} documents, fewer than num_streams "
                    f"({self.num_streams}), so some streams would never get one; lower num_streams"
                )
            if not self.infinite:
                return False
            self.epoch, self.index = self.epoch + 1, 0
            self.reader = self.source.open(None)
            return True
        self.index += 1
        if wanted:
            owner.buffer.extend(self.encode(text))
            owner.epoch, owner.next_doc, owner.resume = self.epoch, self.index, self.reader.position()
        return True


class ShardDealing(Dealing):
    """Each stream reads its own shards of the source with its own reader."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shards = {j: self.source.shard(self.num_streams, j) for j in self.streams}
        self.readers: dict[int, DocumentReader] = {}

    def feed(self, stream: int) -> bool:
        """Read the stream's next document; False when its finite shards end."""
        state, shard = self.streams[stream], self.shards[stream]
        if stream not in self.readers:
            self.readers[stream] = shard.open(state.resume)
        text = next(self.readers[stream], None)
        if text is None:
            if state.next_doc == 0:
                raise DataError(
                    f"dataset: '{shard.name}' at {shard.location} holds no documents; point dataset_path at files with a non-empty 'text' field"
                )
            if not self.infinite:
                return False
            state.epoch, state.next_doc, state.resume = state.epoch + 1, 0, None
            self.readers[stream] = shard.open(None)
            return True
        state.buffer.extend(self.encode(text))
        state.next_doc += 1
        state.resume = self.readers[stream].position()
        return True


DEALINGS = {"document": DocumentDealing, "shard": ShardDealing}
