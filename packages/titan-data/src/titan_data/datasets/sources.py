"""Named text sources: where a dataset's documents come from."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from titan_data.errors import DataError

ASSETS = Path(__file__).resolve().parent.parent / "assets"


@dataclass(frozen=True)
class TextSource:
    """A named, re-readable sequence of documents; `read()` starts again from the first document."""

    name: str
    path: Path
    read_documents: Callable[[Path], Iterator[str]]

    def read(self) -> Iterator[str]:
        return self.read_documents(self.path)


def read_jsonl_text(path: Path) -> Iterator[str]:
    """The `text` field of every JSON line in `path` (a file, or every *.jsonl/*.json file of a folder)."""
    files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json")) if path.is_dir() else [path]
    for file in files:
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError) as err:
                    raise DataError(
                        f"dataset: {file} line {number} is not a JSON object with a 'text' field"
                    ) from err


DATASETS: dict[str, tuple[Path, Callable[[Path], Iterator[str]]]] = {
    "c4_test": (ASSETS / "c4_test", read_jsonl_text),
}


def get_source(name: str, path: str | Path | None = None) -> TextSource:
    """The registered source `name`, read from `path` when given instead of its default location."""
    if name not in DATASETS:
        raise DataError(f"dataset: unknown dataset '{name}'; registered: {', '.join(sorted(DATASETS))}")
    default_path, reader = DATASETS[name]
    source_path = Path(path) if path else default_path
    if not source_path.exists():
        raise DataError(f"dataset: '{name}' expects its files at {source_path}, which does not exist")
    return TextSource(name, source_path, reader)
