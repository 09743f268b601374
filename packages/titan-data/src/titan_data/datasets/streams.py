"""Data streams: where each stands, saved one entry per stream so ranks can be re-dealt on resume.

An entry is self-contained (it names how documents were dealt and how many streams there were), so
the entries of every rank together describe the whole data position, and any number of ranks can
take them up again as long as the number of streams stays the same.
"""

from __future__ import annotations

import pickle
from dataclasses import asdict, dataclass, field
from typing import Any

from titan_data.errors import DataError

STATE_VERSION = 1


def stream_key(stream: int) -> str:
    return f"stream_{stream}"


@dataclass
class StreamState:
    """One stream's place: the next (epoch, document) it takes, the source position where that
    document starts (`resume`, None for the start of the epoch) and tokens not yet emitted."""

    epoch: int = 0
    next_doc: int = 0
    windows_emitted: int = 0
    buffer: list[int] = field(default_factory=list)
    resume: Any = None
    token_offset: int = 0  # tokens of `next_doc` already emitted (memory-mapped streams only)

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.next_doc)


def save_streams(streams: dict[int, StreamState], layout: dict[str, Any]) -> dict[str, bytes]:
    """One pickled entry per stream, keyed `stream_J`; `layout` says how documents were dealt."""
    return {
        stream_key(j): pickle.dumps({"version": STATE_VERSION, **layout, **asdict(s)})
        for j, s in streams.items()
    }


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
        fields = {k: entry[k] for k in StreamState.__dataclass_fields__}
        streams[j] = StreamState(**fields)
    return streams
