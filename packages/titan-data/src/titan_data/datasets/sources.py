"""Text sources: re-readable, ordered document sequences that can resume from a saved position.

A source is split into shards (files, or a hub dataset's files) that can be read independently;
`shard(n, i)` keeps shards i, i + n, i + 2n, ... A reader's `position()` is a small picklable value
naming where the next document starts, so a data state can reopen a source there instead of reading
it again from the beginning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any


class DocumentReader(Iterator[str]):
    """Documents of a source in order; `position()` is where the next one starts.

    A source may hand over records that still need decoding (a JSON line, say) with a `decode`
    function, so that `skip()` can pass over a document another rank owns at the cost of reading it.
    """

    def __init__(
        self, records: Iterator[Any], position: Callable[[], Any], decode: Callable[[Any], str] | None = None
    ):
        self._records = records
        self._position = position
        self._decode = decode

    def __next__(self) -> str:
        record = next(self._records)
        return record if self._decode is None else self._decode(record)

    def skip(self) -> bool:
        """Pass over the next document without decoding it; False when there is none."""
        return next(self._records, _END) is not _END

    def position(self) -> Any:
        return self._position()


_END = object()


class TextSource(ABC):
    """A named, re-readable sequence of documents in a fixed order, split into shards.

    `equal_shards` says that the shards hold about the same number of documents (as C4's files
    do), so that dealing whole shards to data streams keeps the streams balanced.
    """

    name: str
    location: str
    equal_shards: bool = False
    # Read over a network, so it may stop answering mid-run (`SourceUnavailable`): a trainer with several
    # ranks then checks each step that every rank got its batches before any collective (a local source
    # costs that check nothing).
    remote: bool = False

    @property
    @abstractmethod
    def num_shards(self) -> int:
        """How many independently readable parts the source has."""

    @abstractmethod
    def shard(self, num_shards: int, index: int) -> TextSource:
        """The source made of shards `index`, `index + num_shards`, ... in order."""

    @abstractmethod
    def open(self, position: Any = None) -> DocumentReader:
        """Read from `position` (a value a reader's `position()` returned), or from the start."""

    def read(self) -> Iterator[str]:
        """Every document from the first."""
        return self.open(None)

    def check(self) -> None:
        """Raise DataError, naming the fix, when the source cannot be read (a remote one that does not
        answer); cheap, so a run calls it at start. Local sources check their files when made."""
        return None  # nothing to ask: a local source found its files when it was made


class OneShardSource(TextSource):
    """A source read as one part (its positions count over the whole of it), so ranks deal its documents
    one by one."""

    @property
    def num_shards(self) -> int:
        return 1

    def shard(self, num_shards: int, index: int) -> TextSource:
        if num_shards != 1:
            raise ValueError(f"{self.name} has one shard; it cannot be split {num_shards} ways")
        return self


class IterableSource(OneShardSource):
    """A source over any re-iterable collection of texts (a user's own reader); one shard.

    Resuming skips the documents already read, so it costs a read up to the position.
    """

    def __init__(self, name: str, documents: Callable[[], Iterable[str]], location: str = ""):
        self.name, self.location = name, location or name
        self._documents = documents

    def open(self, position: Any = None) -> DocumentReader:
        count = [position or 0]

        def documents() -> Iterator[str]:
            for text in islice(self._documents(), count[0], None):
                count[0] += 1
                yield text

        return DocumentReader(documents(), lambda: count[0])
