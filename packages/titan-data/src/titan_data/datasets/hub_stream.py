"""Sources streamed with Hugging Face `datasets` (C4 from the hub, or laid out as on the hub locally).

Resuming uses the streamed dataset's own `state_dict()`: it reopens at the file it stopped in (or the
one before) and skips only inside it, so a restart late in an epoch does not stream the epoch again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from titan_data.datasets.sources import DocumentReader, TextSource
from titan_data.errors import DataError

C4_HUB = "allenai/c4"
# C4's English files, as named on the hub; splits have 1024 and 8 nearly equal files.
C4_FILES = {"train": "en/c4-train.*-of-01024.json.gz", "validation": "en/c4-validation.*-of-00008.json.gz"}
C4_COLUMNS = ("text", "timestamp", "url")


class StreamedSource(TextSource):
    """A `datasets.IterableDataset` read example by example; its files are the shards."""

    def __init__(
        self,
        name: str,
        location: str,
        make_dataset: Callable[[], Any],
        *,
        text_field: str = "text",
        equal_shards: bool = True,
    ):
        self.name, self.location, self.text_field = name, location, text_field
        self.equal_shards = equal_shards
        self._make_dataset = make_dataset
        self._num_shards: int | None = None

    @property
    def num_shards(self) -> int:
        if self._num_shards is None:
            self._num_shards = self._make_dataset().n_shards
        return self._num_shards

    def shard(self, num_shards: int, index: int) -> StreamedSource:
        if num_shards == 1:
            return self
        return StreamedSource(
            self.name, f"{self.location} (shard {index} of {num_shards})",
            lambda: self._make_dataset().shard(num_shards, index, contiguous=False),
            text_field=self.text_field, equal_shards=self.equal_shards,
        )  # fmt: skip

    def open(self, position: Any = None) -> DocumentReader:
        dataset = self._make_dataset()
        if position is not None:
            dataset.load_state_dict(position)

        def documents() -> Iterator[str]:
            for example in dataset:
                yield example[self.text_field]

        # The state after the latest example yielded: exactly where the next document starts.
        return DocumentReader(documents(), dataset.state_dict)


def _stream_c4_json(data_files: str | list[str], hub_path: str | None) -> Any:
    from datasets import Features, Value, load_dataset  # imported here: loading `datasets` takes seconds

    # Naming the columns spares the loader from reading the first file to infer them at every open.
    features = Features({column: Value("string") for column in C4_COLUMNS})
    dataset = load_dataset(
        hub_path or "json", data_files={"train": data_files}, split="train", streaming=True, features=features
    )
    return dataset.select_columns(["text"])


def c4_source(name: str, split: str, path: str | Path | None) -> StreamedSource:
    """C4 English `split`, streamed from the hub, or from `path` laid out as on the hub."""
    pattern = C4_FILES[split]
    if path is None:
        return StreamedSource(name, f"{C4_HUB} {pattern}", lambda: _stream_c4_json(pattern, C4_HUB))
    root = Path(path)
    files = sorted(str(p) for p in root.glob(pattern))
    if not files:
        example = pattern.replace("*", "00000", 1)
        raise DataError(
            f"dataset: '{name}' expects C4 files laid out as on the hub under {root} (like {root / example}); "
            "found none. Point dataset_path at the folder that holds en/"
        )
    return StreamedSource(name, str(root), lambda: _stream_c4_json(files, None))
