"""Train from token shards (`titan-data tokenize`) through memory maps, with the same streams as
`PackedTokenDataset`: document i to stream i % num_streams, streams to ranks, one entry per stream.

Nothing is tokenised here, so a window is a few slices of the maps. For the same text, tokenizer and
num_streams the windows equal those packed on the fly from a source dealt by document.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np

from titan_data.datasets.windows import ONE_RANK, StreamLayout, WindowDataset
from titan_data.errors import DataError
from titan_data.shards.index import ShardIndex, open_shard

BLOCK_TOKENS = 1 << 17  # tokens read per stream at once (512 KiB of uint32)


class TokenShards:
    """Every document of a finished shard folder; tokens addressed in one space across the shards."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.index = ShardIndex.load(self.folder)
        if not self.index.complete:
            raise DataError(
                f"token shards: {self.folder} is unfinished ({len(self.index.shards)} shards so far); "
                "run the same `titan-data tokenize` command again to finish it"
            )
        self.maps = [open_shard(self.folder, s, self.index.dtype) for s in self.index.shards]
        self.tokens = [np.asarray(tokens) for tokens, _ in self.maps]  # plain views: slicing a memmap is slow
        self.first_doc = np.cumsum([0] + [s.documents for s in self.index.shards])
        self.first_token = np.cumsum([0] + [s.tokens for s in self.index.shards])
        self.num_documents = int(self.first_doc[-1])

    def stream_layout(self, stream: int, num_streams: int) -> tuple[np.ndarray, np.ndarray]:
        """For documents stream, stream + num_streams, ...: where each starts in the token space, and
        the cumulative token count of the stream before each (one more entry: the stream's total)."""
        starts, lengths = [], []
        for shard, (_, offsets) in enumerate(self.maps):
            first, count = int(self.first_doc[shard]), len(offsets) - 1
            local = np.arange((stream - first) % num_streams, count, num_streams)
            starts.append(offsets[local].astype(np.int64) + int(self.first_token[shard]))
            lengths.append((offsets[local + 1] - offsets[local]).astype(np.int64))
        return np.concatenate(starts), np.concatenate([[0], np.cumsum(np.concatenate(lengths))])

    def copy_runs(self, begins: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The tokens of runs [begin, end) of the token space, back to back: a slice copy per run
        (per shard where a run crosses from one shard into the next)."""
        bounds = self.first_token.tolist()
        parts = []
        for begin, end in zip(begins.tolist(), ends.tolist(), strict=True):
            shard = bisect.bisect_right(bounds, begin) - 1
            while begin < end:
                stop = min(end, bounds[shard + 1])
                parts.append(self.tokens[shard][begin - bounds[shard] : stop - bounds[shard]])
                begin, shard = stop, shard + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class MemmapTokenDataset(WindowDataset):
    """(input, label) windows of `seq_len` tokens from token shards, resumable like `PackedTokenDataset`."""

    def __init__(
        self,
        folder: str | Path,
        seq_len: int,
        *,
        streams: StreamLayout = ONE_RANK,
        infinite: bool = True,
    ):
        self.shards = TokenShards(folder)
        source = f"{self.shards.index.source['name']} ({self.shards.num_documents} documents)"
        super().__init__(seq_len, streams, {"kind": "memmap", "source": source, "dealing": "document"})
        if self.shards.num_documents < self.num_streams:
            raise DataError(
                f"dataset: {folder} holds {self.shards.num_documents} documents, fewer than num_streams "
                f"({self.num_streams}); lower num_streams"
            )
        self.infinite = infinite
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # Live positions: (epoch, tokens of the stream's epoch consumed); `streams` is filled from them on save.
        self._at = {j: (0, 0) for j in self.owned}
        self._blocks: dict[int, tuple[int, np.ndarray]] = {}

    @property
    def tokenizer_identity(self) -> dict[str, Any]:
        """The tokenizer the shards were written with (file name, sha256, vocab_size, bos_id, eos_id)."""
        return self.shards.index.tokenizer

    def _layout(self, stream: int) -> tuple[np.ndarray, np.ndarray]:
        if stream not in self._layouts:
            self._layouts[stream] = self.shards.stream_layout(stream, self.num_streams)
        return self._layouts[stream]

    def _read(self, stream: int, start: int, count: int) -> np.ndarray:
        """`count` tokens of the stream from position `start` of its endless sequence (epoch after
        epoch), copied as runs of consecutive documents rather than token by token."""
        starts, before = self._layout(stream)
        total = int(before[-1])
        pieces = []
        while count:
            at = start % total
            take = min(count, total - at)
            first, last = np.searchsorted(before, [at, at + take - 1], side="right") - 1
            # where each document's part lies in the token space: all of it, less the head of the
            # first and the tail of the last
            begins = starts[first : last + 1].copy()
            ends = begins + (before[first + 1 : last + 2] - before[first : last + 1])
            begins[0] += at - before[first]
            ends[-1] -= before[last + 1] - (at + take)
            joined = np.flatnonzero(begins[1:] != ends[:-1])  # documents that follow one another are one run
            pieces.append(
                self.shards.copy_runs(begins[np.r_[0, joined + 1]], ends[np.r_[joined, len(ends) - 1]])
            )
            start, count = start + take, count - take
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _start(self) -> None:
        pass  # positions live in `_at`; blocks already read stay valid

    def _next_window(self, stream: int) -> np.ndarray | None:
        """The stream's next window, advancing it; None once a finite stream's epoch has no full window.

        Windows come out of a block of many read at once, since a read costs about the same for
        one window as for fifty: the block is only a cache, the position alone is the state.
        """
        size = self.seq_len + 1
        epoch, at = self._at[stream]
        total = int(self._layout(stream)[1][-1])
        if not self.infinite and at + size > total:
            return None  # the position stays: the partial window is not consumed
        if at == total:
            epoch, at = epoch + 1, 0
        start = epoch * total + at
        block_start, block = self._blocks.get(stream, (0, np.zeros(0, np.uint32)))
        if not block_start <= start <= start + size <= block_start + len(block):
            # to the end of the epoch at most (a tiny stream would loop many epochs), but one window at least
            count = max(size, min(BLOCK_TOKENS, total - at))
            block_start, block = start, self._read(stream, start, count)
            self._blocks[stream] = (block_start, block)
        window = block[start - block_start : start - block_start + size]
        end_epoch, end_at = divmod(start + size, total)
        # a window that ends an epoch leaves the stream at that epoch's end, as the packed dataset does
        self._at[stream] = (end_epoch - 1, total) if end_at == 0 else (end_epoch, end_at)
        return window

    def state_dict(self) -> dict[str, Any]:
        """One pickled entry per owned stream, keyed `stream_J`, as `PackedTokenDataset` saves:
        the position as (epoch, next document, tokens of it already emitted)."""
        for j, (epoch, at) in self._at.items():
            before = self._layout(j)[1]
            doc = int(np.searchsorted(before, at, side="right")) - 1
            state = self.streams[j]
            state.epoch, state.next_doc, state.token_offset = epoch, doc, at - int(before[doc])
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._at = {
            j: (s.epoch, int(self._layout(j)[1][s.next_doc]) + s.token_offset)
            for j, s in self.streams.items()
        }
