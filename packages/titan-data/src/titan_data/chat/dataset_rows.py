"""Chat rows from a Hugging Face `datasets` dataset: a `save_to_disk` folder, or a named split.

Plain local files and a hub id's train split are read by `rows.read_chat_rows`; this module takes the
rows `hf_datasets.load_rows` gives and turns them into the same `ChatRow`s (or the DataError naming a
bad row), so masks and templates see one shape whatever held the data.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from titan_data.chat.rows import ChatRow, RowFields, read_chat_rows, row_to_messages
from titan_data.datasets.hf_datasets import is_saved_dataset, load_rows
from titan_data.errors import DataError


def read_rows(path: str | Path, fields: RowFields, split: str = "") -> Iterator[ChatRow | DataError]:
    """Every chat row at `path`, in order: a `save_to_disk` folder or `split` through `datasets`, else
    the files (or the hub id's train split) as `read_chat_rows` reads them."""
    if not (split or is_saved_dataset(path)):
        yield from read_chat_rows(path, fields)
        return
    where = f"{path} (split {split})" if split else str(path)
    for i, row in enumerate(load_rows(path, split)):
        try:
            yield ChatRow(row_to_messages(row, fields, f"{where} row {i}"), f"{where} row {i}")
        except DataError as err:
            yield err
