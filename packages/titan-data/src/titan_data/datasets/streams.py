"""Data streams: where each stands, saved one entry per stream so ranks can be re-dealt on resume.

An entry is self-contained (it names how documents were dealt and how many streams there were), so
the entries of every rank together describe the whole data position, and any number of ranks can
take them up again as long as the number of streams stays the same.
"""

from __future__ import annotations

import pickle
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from titan_data.errors import DataError

STATE_VERSION = 1


def stream_key(stream: int) -> str:
    return f"stream_{stream}"


class TokenBuffer:
    """Tokens waiting to be packed, kept as the arrays the tokenizer returned (no copy per token)."""

    def __init__(self, tokens: np.ndarray | list[int] = ()):
        self._chunks: deque[np.ndarray] = deque()
        self._size = 0
        self.extend(np.asarray(tokens, dtype=np.uint32))

    def __len__(self) -> int:
        return self._size

    def extend(self, tokens: np.ndarray) -> None:
        if len(tokens):
            self._chunks.append(tokens)
            self._size += len(tokens)

    def take(self, count: int) -> np.ndarray:
        """Remove and return the first `count` tokens (the caller checked there are enough)."""
        parts = []
        while count:
            chunk = self._chunks[0]
            if len(chunk) <= count:
                parts.append(self._chunks.popleft())
            else:
                parts.append(chunk[:count])
                self._chunks[0] = chunk[count:]
            count -= len(parts[-1])
            self._size -= len(parts[-1])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def to_array(self) -> np.ndarray:
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.uint32)


@dataclass
class StreamState:
    """One stream's place: the next (epoch, document) it takes, the source position where that
    document starts (`resume`, None for the start of the epoch) and tokens not yet emitted."""

    epoch: int = 0
    next_doc: int = 0
    windows_emitted: int = 0
    buffer: TokenBuffer = field(default_factory=TokenBuffer)
    resume: Any = None
    token_offset: int = 0  # tokens of `next_doc` already emitted (memory-mapped streams only)

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.next_doc)


def save_streams(streams: dict[int, StreamState], layout: dict[str, Any]) -> dict[str, bytes]:
    """One pickled entry per stream, keyed `stream_J`; `layout` says how documents were dealt."""
    entries = {}
    for j, state in streams.items():
        values = {f.name: getattr(state, f.name) for f in fields(StreamState)}
        values["buffer"] = state.buffer.to_array()
        entries[stream_key(j)] = pickle.dumps({"version": STATE_VERSION, **layout, **values})
    return entries


def load_streams(state: dict[str, Any], owned: list[int], layout: dict[str, Any]) -> dict[int, StreamState]:
    """The owned streams' states from `state` (which may hold other ranks' entries too)."""
    missing = [stream_key(j) for j in owned if stream_key(j) not in state]
    if missing:
        raise DataError(
            f"dataset: the saved data state lacks {', '.join(missing)}; was it saved with fewer streams? "
            "Resume with the num_streams it was saved with"
        )
    streams = {}
    for j in owned:
        entry = pickle.loads(state[stream_key(j)])
        saved = {k: entry.get(k) for k in layout}
        if saved != layout:
            differences = ", ".join(
                f"{k} {saved[k]} (now {layout[k]})" for k in layout if saved[k] != layout[k]
            )
            raise DataError(
                f"dataset: the saved data state was written with {differences}; resume with the same "
                "dataset and num_streams it was saved with"
            )
        values = {f.name: entry[f.name] for f in fields(StreamState)}
        streams[j] = StreamState(**{**values, "buffer": TokenBuffer(values["buffer"])})
    return streams
