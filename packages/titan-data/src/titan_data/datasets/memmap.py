"""Train from token shards (`titan-data tokenize`) through memory maps, with the same streams as
`PackedTokenDataset`: document i to stream i % num_streams, streams to ranks, one entry per stream.

Nothing is tokenised here, so a window is a few slices of the maps. For the same text, tokenizer and
num_streams the windows equal those packed on the fly from a source dealt by document.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from titan_data.datasets.packed import assign_streams, next_stream
from titan_data.datasets.streams import StreamState, load_streams, save_streams
from titan_data.errors import DataError
from titan_data.shards.index import ShardIndex, open_shard


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

    def gather(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at increasing `positions` of the token space (a few slices per shard crossed)."""
        bounds = np.searchsorted(positions, self.first_token)
        parts = []
        for shard, (tokens, _) in enumerate(self.maps):
            lo, hi = int(bounds[shard]), int(bounds[shard + 1])
            if lo < hi:
                parts.append(tokens[positions[lo:hi] - int(self.first_token[shard])])
        return np.concatenate(parts)


class MemmapTokenDataset(IterableDataset):
    """(input, label) windows of `seq_len` tokens from token shards, resumable like `PackedTokenDataset`."""

    def __init__(
        self,
        folder: str | Path,
        seq_len: int,
        *,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        num_streams: int = 0,
        infinite: bool = True,
    ):
        num_streams, self.owned = assign_streams(seq_len, dp_rank, dp_world_size, num_streams)
        self.shards = TokenShards(folder)
        if self.shards.num_documents < num_streams:
            raise DataError(
                f"dataset: {folder} holds {self.shards.num_documents} documents, fewer than num_streams "
                f"({num_streams}); lower num_streams"
            )
        self.seq_len, self.num_streams, self.infinite = seq_len, num_streams, infinite
        source = self.shards.index.source
        self.layout = {"kind": "memmap", "source": f"{source['name']} ({self.shards.num_documents} documents)",
                       "dealing": "document", "num_streams": num_streams}  # fmt: skip
        self.streams = {j: StreamState() for j in self.owned}
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def tokenizer_identity(self) -> dict[str, Any]:
        """The tokenizer the shards were written with (file name, sha256, vocab_size, bos_id, eos_id)."""
        return self.shards.index.tokenizer

    def _layout(self, stream: int) -> tuple[np.ndarray, np.ndarray]:
        if stream not in self._layouts:
            self._layouts[stream] = self.shards.stream_layout(stream, self.num_streams)
        return self._layouts[stream]

    def _window(self, j: int, size: int) -> np.ndarray | None:
        """The stream's next `size` tokens, advancing its state; None if a finite stream runs out.

        The state's (next_doc, token_offset) is a position in the stream's own token sequence; the
        window's tokens are found for all positions at once rather than document by document.
        """
        state = self.streams[j]
        starts, before = self._layout(j)
        total = int(before[-1])
        epoch, at = state.epoch, int(before[state.next_doc]) + state.token_offset
        pieces, need = [], size
        while need:
            if at == total:
                if not self.infinite:
                    return None  # the state stays put: the partial window is not consumed
                epoch, at = epoch + 1, 0
            take = min(need, total - at)
            first, last = np.searchsorted(before, [at, at + take - 1], side="right") - 1
            # each position's document, as runs: document d covers positions up to before[d + 1]
            ends = np.minimum(before[first + 1 : last + 2], at + take)
            runs = np.diff(ends, prepend=at)
            shift = np.repeat(starts[first : last + 1] - before[first : last + 1], runs)
            pieces.append(self.shards.gather(np.arange(at, at + take) + shift))
            need, at = need - take, at + take
        doc = int(np.searchsorted(before, at, side="right")) - 1
        state.epoch, state.next_doc, state.token_offset = epoch, doc, at - int(before[doc])
        state.windows_emitted += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        active = list(self.owned)
        while active:
            j = next_stream(self.streams, active)
            window = self._window(j, self.seq_len + 1)
            if window is None:
                active.remove(j)
                continue
            tokens = torch.from_numpy(window.astype(np.int64))
            yield tokens[:-1], tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        """One pickled entry per owned stream, keyed `stream_J`, as `PackedTokenDataset` saves."""
        return save_streams(self.streams, self.layout)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streams = load_streams(state, self.owned, self.layout)
