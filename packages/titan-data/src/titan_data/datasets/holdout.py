"""A held-out share of a source for validation: train and validation rows split by row number, never both.

Row `i` is held out when the fractional part of `i * phi` (phi the golden ratio's fraction, computed in
64-bit integers so every machine gets the same answer) is below the share. That sequence spreads evenly
over [0, 1), so the held-out rows are an even sprinkle through the source and their count is within a
row or two of `share * rows` at every prefix. It needs no seed, no pass over the data and no state: every
rank, every resume and the validation loader decide a row the same way from its number alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, TypeVar

from titan_data.datasets.sources import DocumentReader, OneShardSource, TextSource
from titan_data.errors import DataError

GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / phi, rounded to odd
PARTS = ("train", "holdout")
Row = TypeVar("Row")


def is_held_out(index: int, share: float) -> bool:
    """Whether row `index` of a source belongs to its held-out `share`."""
    return (index * GOLDEN) % (1 << 64) < share * (1 << 64)


def check_share(share: float) -> None:
    if not 0 < share < 1:
        raise DataError(f"dataset: holdout_share must be above 0 and below 1, got {share}")


def _in_part(index: int, share: float, held: bool) -> bool:
    return is_held_out(index, share) == held


def keep_row(share: float, part: str) -> Callable[[int], bool]:
    """A test of row numbers: True for the rows of `part` ("train" or "holdout") of a `share` split
    (picklable, so loader worker processes started by spawn get it too)."""
    check_share(share)
    if part not in PARTS:
        raise DataError(f"dataset: a held-out split's part is one of {', '.join(PARTS)}, not {part!r}")
    return partial(_in_part, share=share, held=part == "holdout")


def split_rows(rows: Iterable[Row], share: float, part: str) -> Iterator[Row]:
    """The rows of `part` ("train" or "holdout") of an iterable, by their number in it."""
    keep = keep_row(share, part)
    return (row for i, row in enumerate(rows) if keep(i))


class _PartReader(DocumentReader):
    """The source's documents of one part; the others passed over undecoded. Position: (source position,
    number of the source row read next)."""

    def __init__(self, source: HoldoutSource, position: Any):
        inner_at, self.index = position or (None, 0)
        self.inner, self.keep = source.source.open(inner_at), source.keep

    def _pass_others(self) -> bool:
        while not self.keep(self.index):
            if not self.inner.skip():
                return False
            self.index += 1
        return True

    def __next__(self) -> str:
        if not self._pass_others():
            raise StopIteration
        text = next(self.inner)
        self.index += 1
        return text

    def skip(self) -> bool:
        if not (self._pass_others() and self.inner.skip()):
            return False
        self.index += 1
        return True

    def position(self) -> Any:
        return (self.inner.position(), self.index)


class HoldoutSource(OneShardSource):
    """One part ("train" or "holdout") of `source` split by `share` (see the module)."""

    def __init__(self, source: TextSource, share: float, part: str):
        self.keep = keep_row(share, part)
        self.source, self.share, self.part = source, share, part
        self.name = f"{source.name}[{part} of holdout {share:g}]"
        self.location, self.remote = source.location, source.remote

    def open(self, position: Any = None) -> DocumentReader:
        return _PartReader(self, position)

    def check(self) -> None:
        self.source.check()
