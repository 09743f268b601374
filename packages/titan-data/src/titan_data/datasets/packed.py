"""Tokenise a document stream and pack it into fixed windows, in streams that ranks share out.

Documents are dealt to a fixed number of *streams* (see `dealing.py`), and the streams to
data-parallel ranks (stream `j` to rank `j % world_size`, see `StreamLayout`). Each stream packs its own documents,
framed by BOS/EOS, into windows of `seq_len + 1` tokens. The global batch is therefore the same set
of windows whatever the number of ranks (when it divides num_streams), and a checkpoint (one entry
per stream) can be re-dealt to a different number of ranks without repeating or skipping a document.
"""

from __future__ import annotations

import numpy as np

from titan_data.datasets.dealing import DEALINGS, Dealing, choose_dealing
from titan_data.datasets.sources import TextSource
from titan_data.datasets.windows import ONE_RANK, StreamLayout, WindowDataset
from titan_data.tokenizers.base import Tokenizer


class PackedTokenDataset(WindowDataset):
    """(input, label) pairs shifted by one token, from this rank's streams in round-robin order.

    `streams` says which of the dataset's streams this rank reads. With `infinite`, every stream loops over epochs; otherwise iteration ends when the streams run
    out of full windows. `state_dict()` holds one entry per owned stream, keyed `stream_J`, so
    entries from every rank together describe the whole data position.
    """

    def __init__(
        self,
        source: TextSource,
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        streams: StreamLayout = ONE_RANK,
        infinite: bool = True,
    ):
        self.dealing = choose_dealing(source, streams.num_streams)
        layout = {"kind": "packed", "source": source.name, "dealing": self.dealing}
        super().__init__(seq_len, streams, layout)
        self.source, self.tokenizer, self.infinite = source, tokenizer, infinite
        self.remote = source.remote
        self._feeder: Dealing | None = None

    def _encode(self, text: str) -> np.ndarray:
        return self.tokenizer.encode_array(text, bos=True, eos=True)

    def _start(self) -> None:
        self._feeder = DEALINGS[self.dealing](
            self.source, self.streams, self.num_streams, self.infinite, self._encode
        )

    def _next_window(self, stream: int) -> np.ndarray | None:
        buffer = self.streams[stream].buffer
        while len(buffer) < self.seq_len + 1:
            if not self._feeder.feed(stream):
                return None  # a finite source ran out for this stream
        return buffer.take(self.seq_len + 1)
