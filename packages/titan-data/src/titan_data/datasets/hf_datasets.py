"""Hugging Face `datasets` data: `save_to_disk` folders and named splits, read row by row.

A folder that `Dataset.save_to_disk` wrote holds `state.json`, `dataset_info.json` and `data-*.arrow`
files; one that `DatasetDict.save_to_disk` wrote holds `dataset_dict.json` and a folder per split.
Read as plain files, their JSON metadata would pass for documents, so they are recognised first and
opened with `datasets.load_from_disk`. A split of any other dataset (a hub id, or a local folder whose
files are named by split, `train-00000.parquet`, `test/part.jsonl`, ...) is chosen by
`datasets.load_dataset(path, split=...)`, which applies the hub's naming rules.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from titan_data.datasets.sources import DocumentReader, OneShardSource
from titan_data.errors import DataError

BATCH_ROWS = 1024  # rows read from arrow at a time


def is_saved_dataset(path: str | Path | None) -> bool:
    """Whether `path` is a folder `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote."""
    if path is None:
        return False
    folder = Path(path)
    if (folder / "dataset_dict.json").is_file():
        return True
    return (folder / "state.json").is_file() and any(folder.glob("data-*.arrow"))


def is_dataset_repository(path: str | Path | None) -> bool:
    """Whether `path` is a local copy of a Hub dataset repository whose README names its configurations
    (a YAML `configs:` list, as openai/gsm8k publishes main and socratic): `datasets` reads those, where
    the folder's files read one by one would mix every configuration and split."""
    readme = Path(path) / "README.md" if path is not None else None
    if readme is None or not readme.is_file():
        return False
    text = readme.read_text(errors="replace")
    if not text.startswith("---"):
        return False
    front = text[3:].split("\n---", 1)[0]
    return any(line.startswith("configs:") for line in front.splitlines())


def load_rows(path: str | Path, split: str = "", config: str = "") -> Any:
    """The rows of `path` as a `datasets.Dataset`: a `save_to_disk` folder (its `split` when it holds
    several), else `datasets.load_dataset(path, config, split=split or "train")`: `config` names one of a
    hub dataset's configurations (GSM8K's "main" or "socratic"), as `load_dataset`'s `name` does."""
    import datasets  # imported here: plain files need none of it

    if is_saved_dataset(path):
        if config:
            raise DataError(
                f"dataset: {path} is a saved dataset, which has no configurations; leave dataset_config empty"
            )
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            return _pick_split(loaded, path, split)
        if split:
            raise DataError(
                f"dataset: {path} is one saved Dataset, with no splits to choose from; leave dataset_split "
                "empty, or save a DatasetDict"
            )
        return loaded
    try:
        return datasets.load_dataset(str(path), config or None, split=split or "train")
    except Exception as err:  # the hub client and the builders raise many types; the message says what
        which = f"split '{split or 'train'}'" + (f" of configuration '{config}'" if config else "")
        raise DataError(
            f"dataset: cannot load {which} of {path} ({type(err).__name__}: {err}); "
            "check dataset_split, dataset_config and dataset_path"
        ) from None


def _pick_split(splits: Any, path: str | Path, split: str) -> Any:
    names = sorted(splits)
    if split:
        if split not in splits:
            raise DataError(f"dataset: {path} has no split '{split}'; its splits are {', '.join(names)}")
        return splits[split]
    if len(names) == 1:
        return splits[names[0]]
    if "train" in splits:
        return splits["train"]
    raise DataError(f"dataset: {path} holds the splits {', '.join(names)}; choose one with dataset_split")


class RowsSource(OneShardSource):
    """The `text_field` column of a `datasets.Dataset`, one document per row; a position is a row number,
    so resuming seeks straight there."""

    def __init__(self, name: str, rows: Any, *, text_field: str = "text", location: str = ""):
        if text_field not in rows.column_names:
            raise DataError(
                f"dataset: {location or name} has no '{text_field}' column; its columns are "
                f"{', '.join(rows.column_names)}"
            )
        self.name, self.location, self.text_field = name, location or name, text_field
        self.rows = rows.select_columns([text_field])

    def __len__(self) -> int:
        return len(self.rows)

    def open(self, position: Any = None) -> DocumentReader:
        at = [position or 0]

        def documents() -> Iterator[str]:
            for start in range(at[0], len(self.rows), BATCH_ROWS):
                for text in self.rows[start : start + BATCH_ROWS][self.text_field]:
                    if not isinstance(text, str):
                        raise DataError(
                            f"dataset: {self.location} row {at[0]}: '{self.text_field}' is "
                            f"{type(text).__name__}, not text"
                        )
                    at[0] += 1
                    yield text

        return DocumentReader(documents(), lambda: at[0])


def rows_source(name: str, path: str | Path, split: str = "") -> RowsSource:
    """Dataset `name`'s documents from a `save_to_disk` folder or a named split at `path`."""
    where = f"{path} (split {split})" if split else str(path)
    return RowsSource(name, load_rows(path, split), location=where)
