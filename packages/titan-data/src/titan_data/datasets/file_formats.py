"""Local document files: JSON lines, parquet and plain text, each readable from a saved offset.

A position is (file number, offset): a byte offset for JSON lines and text (decompressed bytes for
.gz), a row number for parquet. Seeking there makes resuming cost nothing for plain files.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
from collections.abc import Callable, Iterator
from json.decoder import scanstring
from pathlib import Path
from typing import IO, Any

from titan_data.datasets.sources import DocumentReader, TextSource
from titan_data.errors import DataError

# What a file reader yields: a record not yet decoded, and the offset of the next document in that
# file. The format's decoder makes the record's text; keeping the two apart lets a rank pass over the
# documents other ranks own without decoding them.
FileReader = Callable[[Path, int, str], Iterator[tuple[Any, int]]]
Decoder = Callable[[Any, str], str]


def _open_bytes(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def read_lines(path: Path, start: int, text_field: str) -> Iterator[tuple[tuple[Path, int, bytes], int]]:
    """((path, byte offset, line), the next line's offset) for every non-blank line from `start` on."""
    with _open_bytes(path) as f:
        f.seek(start)
        offset = start
        for line in f:
            record_at, offset = offset, offset + len(line)
            if not line.isspace():  # (isspace, unlike strip, copies nothing)
                yield (path, record_at, line), offset


@functools.cache
def _leading_field(text_field: str) -> re.Pattern[str]:
    """Matches a line that opens with `text_field` as its first key, up to its string's first character."""
    return re.compile(r'\{\s*"' + re.escape(text_field) + r'"\s*:\s*"')


def _parse_text(line: str, text_field: str) -> str:
    """The `text_field` string of one JSON object line.

    C4 writes the text as the first field, so its string is scanned in place and the other fields
    (url, timestamp) and the dict are never built. Any other layout, a repeated key, or a line not
    closed by "}" takes the full `json.loads`.
    """
    found = _leading_field(text_field).match(line)
    if found:
        text, end = scanstring(line, found.end())
        if line.rstrip().endswith("}") and f'"{text_field}"' not in line[end:]:
            return text
    return json.loads(line)[text_field]


def decode_json_line(record: tuple[Path, int, bytes], text_field: str) -> str:
    """The text of one JSON object line, its `text_field`."""
    path, record_at, line = record
    try:
        # decoding first spares json the encoding sniffing it does on bytes (JSON lines are UTF-8)
        text = _parse_text(line.decode("utf-8-sig" if record_at == 0 else "utf-8"), text_field)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise DataError(
            f"dataset: {path} at byte {record_at} is not a JSON object with a '{text_field}' field; "
            "write one JSON object per line"
        ) from err
    if not isinstance(text, str):
        raise DataError(
            f"dataset: {path} at byte {record_at}: '{text_field}' is {type(text).__name__}, not text"
        )
    return text


def decode_text_line(record: tuple[Path, int, bytes], text_field: str) -> str:
    """One non-empty line of a UTF-8 text file is one document (`text_field` does not apply)."""
    path, record_at, line = record
    try:
        return line.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise DataError(f"dataset: {path} at byte {record_at} is not UTF-8 text") from err


def read_parquet_rows(path: Path, start: int, text_field: str) -> Iterator[tuple[str, int]]:
    """One document per row of a parquet file, from its `text_field` column; skips whole row groups."""
    import pyarrow.parquet as pq  # imported here: only parquet users pay for it

    try:
        file = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own error types for unreadable files
        raise DataError(f"dataset: {path} is not a readable parquet file: {err}") from err
    if text_field not in file.schema_arrow.names:
        raise DataError(
            f"dataset: {path} has no '{text_field}' column; its columns are {', '.join(file.schema_arrow.names)}"
        )
    row = 0
    for group in range(file.num_row_groups):
        size = file.metadata.row_group(group).num_rows
        if row + size <= start:
            row += size
            continue
        for batch in file.iter_batches(row_groups=[group], columns=[text_field]):
            for text in batch.column(0).to_pylist():
                row += 1
                if row > start:
                    yield text, row


def decode_parquet_text(record: str, text_field: str) -> str:
    return record  # the reader took the column already


FORMATS: dict[str, tuple[tuple[str, ...], FileReader, Decoder]] = {
    "json": ((".jsonl", ".json", ".jsonl.gz", ".json.gz"), read_lines, decode_json_line),
    "parquet": ((".parquet",), read_parquet_rows, decode_parquet_text),
    "text": ((".txt", ".txt.gz"), read_lines, decode_text_line),
}


def _format_of(path: Path, formats: tuple[str, ...]) -> str | None:
    return next((f for f in formats if path.name.endswith(FORMATS[f][0])), None)


def find_files(path: Path, formats: tuple[str, ...]) -> list[Path]:
    """`path` itself, or the files of the given formats anywhere under the folder `path`, sorted."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"dataset: {path} does not exist")
    files = sorted(p for p in path.rglob("*") if p.is_file() and _format_of(p, formats))
    if not files:
        suffixes = ", ".join(s for f in formats for s in FORMATS[f][0])
        raise DataError(f"dataset: no {suffixes} files under {path}")
    return files


class FileSource(TextSource):
    """Documents of local files read in order, one shard per file, format by file name."""

    def __init__(
        self,
        name: str,
        files: list[Path],
        *,
        text_field: str = "text",
        formats: tuple[str, ...] = tuple(FORMATS),
        equal_shards: bool = False,
        location: str | None = None,
    ):
        self.name, self.files, self.text_field = name, list(files), text_field
        self.formats, self.equal_shards = formats, equal_shards
        self.location = location or (str(files[0]) if len(files) == 1 else f"{len(files)} files")
        self._readers = []
        for file in self.files:
            fmt = _format_of(file, formats)
            if fmt is None:
                known = ", ".join(s for f in formats for s in FORMATS[f][0])
                raise DataError(f"dataset: {file} is not a file {name} can read; expected one of {known}")
            self._readers.append(FORMATS[fmt][1:])

    @classmethod
    def from_path(cls, name: str, path: str | Path, **kwargs) -> FileSource:
        """Every readable file at `path` (a file, or a folder searched recursively)."""
        formats = kwargs.get("formats", tuple(FORMATS))
        return cls(name, find_files(Path(path), formats), location=str(path), **kwargs)

    @property
    def num_shards(self) -> int:
        return len(self.files)

    def shard(self, num_shards: int, index: int) -> FileSource:
        return FileSource(
            self.name,
            self.files[index::num_shards],
            text_field=self.text_field,
            formats=self.formats,
            equal_shards=self.equal_shards,
            location=f"{self.location} (shard {index} of {num_shards})",
        )

    def open(self, position: Any = None) -> DocumentReader:
        at = list(position or (0, 0))
        text_field = self.text_field

        def records() -> Iterator[tuple[Decoder, Any]]:
            while at[0] < len(self.files):
                file, (reader, decode) = self.files[at[0]], self._readers[at[0]]
                for record, next_offset in reader(file, at[1], text_field):
                    at[1] = next_offset  # before the yield: position() then points past this document
                    yield decode, record
                at[0], at[1] = at[0] + 1, 0

        return DocumentReader(records(), lambda: (at[0], at[1]), lambda item: item[0](item[1], text_field))
