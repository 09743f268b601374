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

from titan_data.datasets.packed import next_stream, owned_streams
from titan_data.datasets.streams import StreamState, load_streams, save_streams
from titan_data.errors import DataError
from titan_data.shards.index import ShardIndex, open_shard


class TokenShards:
    """Every document of a finished shard folder, addressed by its global number."""

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
        self.num_documents = int(self.first_doc[-1])

    def document(self, number: int) -> np.ndarray:
        shard = int(np.searchsorted(self.first_doc, number, side="right")) - 1
        tokens, offsets = self.maps[shard]
        local = number - int(self.first_doc[shard])
        return tokens[int(offsets[local]) : int(offsets[local + 1])]


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
        num_streams = num_streams or dp_world_size
        self.owned = owned_streams(dp_rank, dp_world_size, num_streams)
        if seq_len < 1:
            raise DataError(f"dataset: seq_len must be >= 1, got {seq_len}")
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

    @property
    def tokenizer_identity(self) -> dict[str, Any]:
        """The tokenizer the shards were written with (file name, sha256, vocab_size, bos_id, eos_id)."""
        return self.shards.index.tokenizer

    def _stream_length(self, stream: int) -> int:
        return (self.shards.num_documents - stream + self.num_streams - 1) // self.num_streams

    def _window(self, j: int, size: int) -> np.ndarray | None:
        """The stream's next `size` tokens, advancing its state; None if a finite stream runs out."""
        state, length = self.streams[j], self._stream_length(j)
        parts, need = [], size
        epoch, doc, offset = state.epoch, state.next_doc, state.token_offset
        while need:
            if doc == length:
                if not self.infinite:
                    return None  # the state stays put: the partial window is not consumed
                epoch, doc, offset = epoch + 1, 0, 0
            tokens = self.shards.document(j + doc * self.num_streams)
            part = tokens[offset : offset + need]
            parts.append(part)
            need, offset = need - len(part), offset + len(part)
            if offset == len(tokens):
                doc, offset = doc + 1, 0
        state.epoch, state.next_doc, state.token_offset = epoch, doc, offset
        state.windows_emitted += 1
        return np.concatenate(parts)

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
