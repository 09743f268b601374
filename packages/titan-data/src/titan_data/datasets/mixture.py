"""Several sources mixed by weight into one stream of documents, resumable exactly.

Which source gives the next document is not sampled: each draw takes the source furthest behind its
share (largest `weight * draws - taken`, the first on ties). After any number of draws every source's
count is within one document of its share, so a mixture's proportions hold over a short run as well as
a long one, and the whole choice is a function of the counts: a saved position (the counts, and where
each source stands) continues exactly the sequence an uninterrupted run reads.

One pass of a mixture lasts until every source has been read to its end at least once; a source that
ends sooner starts again from its first document (so a small source weighted high is repeated). The
same rule mixes in-memory rows (`mix_rows`, for chat examples).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from titan_data.datasets.sources import DocumentReader, OneShardSource, TextSource
from titan_data.errors import DataError

logger = logging.getLogger(__name__)

Row = TypeVar("Row")


def normalised_weights(weights: Sequence[float], count: int, what: str = "dataset_weights") -> list[float]:
    """`weights` as shares summing to 1 (empty: equal shares of `count` sources); DataError naming the fix."""
    if not weights:
        return [1.0 / count] * count
    if len(weights) != count:
        raise DataError(
            f"dataset: {what} has {len(weights)} weights for {count} sources; give one per source"
        )
    if any(not w > 0 for w in weights):
        raise DataError(f"dataset: {what} {list(weights)} must all be above 0")
    total = float(sum(weights))
    return [w / total for w in weights]


def next_source(taken: Sequence[int], shares: Sequence[float]) -> int:
    """The source the next draw takes: the one furthest behind its share after that draw."""
    draws = sum(taken) + 1
    return max(range(len(shares)), key=lambda i: (shares[i] * draws - taken[i], -i))


class _MixtureReader(DocumentReader):
    """Documents drawn from the sources' readers; position: (taken, ended, the sources' positions)."""

    def __init__(self, mixture: MixtureSource, position: Any):
        taken, ended, positions = position or (
            [0] * len(mixture.sources),
            [False] * len(mixture.sources),
            None,
        )
        self.mixture, self.taken, self.ended = mixture, list(taken), list(ended)
        positions = positions or [None] * len(mixture.sources)
        self.readers = [source.open(at) for source, at in zip(mixture.sources, positions, strict=True)]

    def _draw(self, decode: bool) -> Any:
        """The next document (or True when only passing over it); None once every source has ended."""
        i = next_source(self.taken, self.mixture.shares)
        reader = self.readers[i]
        item = next(reader, None) if decode else (reader.skip() or None)
        if item is None:
            source = self.mixture.sources[i]
            if not self.ended[i]:  # its length is known now: said once a pass
                logger.info(
                    "mixture: %s at %s ended after %d of the mixture's %d documents (weight %.4g)",
                    source.name,
                    source.location,
                    self.taken[i],
                    sum(self.taken),
                    self.mixture.shares[i],
                )
            self.ended[i] = True
            if all(self.ended):
                return None
            self.readers[i] = reader = source.open(None)  # this source starts again; the others go on
            item = next(reader, None) if decode else (reader.skip() or None)
            if item is None:
                raise DataError(f"dataset: {source.name} at {source.location} holds no documents")
        self.taken[i] += 1
        return item

    def __next__(self) -> str:
        text = self._draw(decode=True)
        if text is None:
            raise StopIteration
        return text

    def skip(self) -> bool:
        return self._draw(decode=False) is not None

    def position(self) -> Any:
        return (tuple(self.taken), tuple(self.ended), tuple(r.position() for r in self.readers))


class MixtureSource(OneShardSource):
    """`sources` mixed by `weights` (see the module); one shard, so ranks deal its documents one by one.

    Its name holds every source's name and share, so a checkpoint of one mixture is refused by another.
    """

    def __init__(self, sources: Sequence[TextSource], weights: Sequence[float] = ()):
        if len(sources) < 2:
            raise DataError("dataset: a mixture needs at least two sources")
        self.sources, self.shares = list(sources), normalised_weights(weights, len(sources))
        parts = [
            f"{s.name}@{s.location}:{share:.6g}" for s, share in zip(self.sources, self.shares, strict=True)
        ]
        self.name = "mixture(" + ", ".join(parts) + ")"
        self.location = ", ".join(s.location for s in self.sources)
        self.remote = any(s.remote for s in self.sources)

    def open(self, position: Any = None) -> DocumentReader:
        return _MixtureReader(self, position)

    def check(self) -> None:
        for source in self.sources:
            source.check()


def mix_rows(
    parts: Sequence[Sequence[Row]], weights: Sequence[float] = (), names: Sequence[str] = ()
) -> list[Row]:
    """One pass of `parts` mixed by `weights` (see the module): ends once every part was taken whole at
    least once. Each part's rows, share and repeats are logged."""
    shares = normalised_weights(weights, len(parts))
    if any(not part for part in parts):
        raise DataError("dataset: a mixture source holds no rows")
    taken, ended, at, mixed = [0] * len(parts), [False] * len(parts), [0] * len(parts), []
    while True:
        i = next_source(taken, shares)
        if at[i] == len(parts[i]):
            ended[i] = True
            if all(ended):
                break
            at[i] = 0
        mixed.append(parts[i][at[i]])
        at[i], taken[i] = at[i] + 1, taken[i] + 1
    for k, part in enumerate(parts):
        logger.info(
            "mixture: %s: %d rows, weight %.4g, %d of the %d mixed rows (%.2f%%, each row %.2f times)",
            names[k] if k < len(names) else f"source {k}",
            len(part),
            shares[k],
            taken[k],
            len(mixed),
            100 * taken[k] / len(mixed),
            taken[k] / len(part),
        )
    return mixed
