"""The token-shard folder format: `index.json` plus, per shard, tokens and document offsets.

    DIR/index.json           dtype, tokenizer identity, source, settings, finished shards
    DIR/shard_00000.bin      every document's tokens, framed by BOS/EOS, back to back (uint16 or uint32)
    DIR/shard_00000.idx      uint64 start of each document in the .bin, plus the end (documents + 1)

A shard is listed in the index only after both of its files are complete, so an interrupted run
leaves a folder whose index names exactly the work that is done.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from titan_data.errors import DataError

INDEX_FILE = "index.json"
FORMAT = "titan-data token shards"
VERSION = 1
OFFSET_DTYPE = np.uint64


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned type that holds every id."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class ShardEntry:
    """One finished shard, and the source position right after its last document."""

    name: str
    documents: int
    tokens: int
    resume: Any


@dataclass
class ShardIndex:
    """What `index.json` holds."""

    dtype: str
    tokenizer: dict[str, Any]
    source: dict[str, str]
    documents_per_shard: int
    shards: list[ShardEntry] = field(default_factory=list)
    complete: bool = False

    @property
    def num_documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def settings(self) -> dict[str, Any]:
        """Everything that must match for a run to continue this folder."""
        return {
            "dtype": self.dtype,
            "tokenizer": self.tokenizer,
            "source": self.source,
            "documents_per_shard": self.documents_per_shard,
        }

    def save(self, folder: Path) -> None:
        """Write atomically: a reader never sees a half-written index."""
        data = {"format": FORMAT, "version": VERSION, **asdict(self)}
        tmp = folder / (INDEX_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, folder / INDEX_FILE)

    @classmethod
    def load(cls, folder: Path) -> ShardIndex:
        path = Path(folder) / INDEX_FILE
        if not path.is_file():
            raise DataError(
                f"token shards: {folder} has no {INDEX_FILE}; write one with `titan-data tokenize`"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise DataError(f"token shards: {path} is not valid JSON: {err}") from err
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise DataError(f"token shards: {path} is not a version-{VERSION} '{FORMAT}' index")
        shards = [ShardEntry(**s) for s in data["shards"]]
        return cls(
            data["dtype"],
            data["tokenizer"],
            data["source"],
            data["documents_per_shard"],
            shards,
            data["complete"],
        )


def shard_name(number: int) -> str:
    return f"shard_{number:05d}"


def write_shard(folder: Path, name: str, tokens: np.ndarray, offsets: np.ndarray) -> None:
    """Write a shard's two files under temporary names, then rename them into place."""
    for suffix, array in ((".bin", tokens), (".idx", offsets.astype(OFFSET_DTYPE))):
        tmp = folder / f"{name}{suffix}.tmp"
        array.tofile(tmp)
        os.replace(tmp, folder / f"{name}{suffix}")


def open_shard(folder: Path, entry: ShardEntry, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Memory-maps of a shard's tokens and document offsets, checked against the index."""
    arrays = []
    for suffix, array_dtype, length in (
        (".bin", dtype, entry.tokens),
        (".idx", OFFSET_DTYPE, entry.documents + 1),
    ):
        path = folder / f"{entry.name}{suffix}"
        expected = length * np.dtype(array_dtype).itemsize
        if not path.is_file() or path.stat().st_size != expected:
            raise DataError(
                f"token shards: {path} is missing or not {expected} bytes as {INDEX_FILE} says; "
                "the folder is damaged, so write it again with `titan-data tokenize`"
            )
        arrays.append(np.memmap(path, dtype=array_dtype, mode="r") if length else np.zeros(0, array_dtype))
    return arrays[0], arrays[1]
