"""Tokenise a document stream and pack it into fixed windows, in streams that ranks share out.

Documents are dealt to a fixed number of *streams* (see `dealing.py`), and the streams to
data-parallel ranks (stream `j` to rank `j % dp_world_size`). Each stream packs its own documents,
framed by BOS/EOS, into windows of `seq_len + 1` tokens. The global batch is therefore the same set
of windows whatever the number of ranks (when it divides num_streams), and a checkpoint (one entry
per stream) can be re-dealt to a different number of ranks without repeating or skipping a document.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from titan_data.datasets.dealing import DEALINGS, choose_dealing
from titan_data.datasets.sources import TextSource
from titan_data.datasets.streams import StreamState, load_streams, save_streams
from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer

logger = logging.getLogger(__name__)


def assign_streams(seq_len: int, dp_rank: int, dp_world_size: int, num_streams: int) -> tuple[int, list[int]]:
    """(num_streams, the streams rank `dp_rank` reads: j, j + dp_world_size, ...); validates the layout.
    num_streams 0 means one stream per rank."""
    num_streams = num_streams or dp_world_size
    if seq_len < 1:
        raise DataError(f"dataset: seq_len must be >= 1, got {seq_len}")
    if not 0 <= dp_rank < dp_world_size:
        raise DataError(f"dataset: dp_rank {dp_rank} is outside dp_world_size {dp_world_size}")
    if num_streams < dp_world_size:
        raise DataError(
            f"dataset: num_streams ({num_streams}) is smaller than the data-parallel degree "
            f"({dp_world_size}); every rank needs at least one stream, so raise num_streams"
        )
    if num_streams % dp_world_size:
        logger.warning(
            "dataset: num_streams (%d) is not a multiple of the data-parallel degree (%d): ranks read "
            "unequal numbers of streams, so batches differ from those at other world sizes",
            num_streams, dp_world_size,
        )  # fmt: skip
    return num_streams, list(range(dp_rank, num_streams, dp_world_size))


def next_stream(streams: dict[int, StreamState], candidates: list[int]) -> int:
    """The stream that has emitted fewest windows (lowest id on ties): a round robin with no cursor
    to save, and the same global order at any number of ranks."""
    return min(candidates, key=lambda j: (streams[j].windows_emitted, j))


class PackedTokenDataset(IterableDataset):
    """(input, label) pairs shifted by one token, from this rank's streams in round-robin order.

    With `infinite`, every stream loops over epochs; otherwise iteration ends when the streams run
    out of full windows. `state_dict()` holds one entry per owned stream, keyed `stream_J`, so
    entries from every rank together describe the whole data position.
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
        num_streams, self.owned = assign_streams(seq_len, dp_rank, dp_world_size, num_streams)
        self.source, self.tokenizer, self.seq_len = source, tokenizer, seq_len
        self.num_streams, self.infinite = num_streams, infinite
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.dealing = choose_dealing(source, num_streams)
        self.layout = {
            "kind": "packed",
            "source": source.name,
            "dealing": self.dealing,
            "num_streams": num_streams,
        }
        self.streams = {j: StreamState() for j in self.owned}

    def _encode(self, text: str) -> np.ndarray:
        return self.tokenizer.encode_array(text, bos=True, eos=True)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        window = self.seq_len + 1
        feeder = DEALINGS[self.dealing](
            self.source, self.streams, self.num_streams, self.infinite, self._encode
        )
        active = list(self.owned)
        while active:
            j = next_stream(self.streams, active)
            stream = self.streams[j]
            while len(stream.buffer) < window:
                if not feeder.feed(j):
                    active.remove(j)  # a finite source ran out for this stream
                    break
            else:
                tokens = torch.from_numpy(stream.buffer.take(window).astype(np.int64))
                stream.windows_emitted += 1
                yield tokens[:-1], tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        """One pickled entry per owned stream (bytes, so checkpoints store it as an opaque object)."""
        return save_streams(self.streams, self.layout)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streams = load_streams(state, self.owned, self.layout)
