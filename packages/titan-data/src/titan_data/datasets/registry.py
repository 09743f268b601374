"""Datasets by name: the built-in ones and any a user registers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from titan_data.datasets.c4 import C4_NUM_FILES, c4_source
from titan_data.datasets.file_formats import FileSource
from titan_data.datasets.hf_datasets import is_saved_dataset, rows_source
from titan_data.datasets.sources import TextSource
from titan_data.errors import DataError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TOKEN_SHARDS = "token_shards"
CHAT = "chat"  # conversations for fine-tuning: see titan_data.chat, not a text source
PREFERENCE = "preference"  # prompt, chosen and rejected for DPO and its family: see titan_data.preference
PROMPTS = "prompts"  # prompt-only rows for learning from rewards (GRPO): see titan_data.prompts


@dataclass(frozen=True)
class DatasetEntry:
    """How to open a dataset: `open_source(path)` gives its text; None marks pre-tokenised shards.
    `open_split(path, split)`, where the dataset has splits, opens a named one."""

    help: str
    open_source: Callable[[str | Path | None], TextSource] | None
    open_split: Callable[[str | Path | None, str], TextSource] | None = None


def _local(
    name: str, formats: tuple[str, ...] | None, default: Path | None, path: str | Path | None, split: str = ""
) -> TextSource:
    """Local files; a `save_to_disk` folder, or a split of a folder whose files are named by split, is read
    through `datasets` (see hf_datasets)."""
    path = path or default
    if path is None:
        raise DataError(f"dataset: '{name}' reads local files; set dataset_path to a file or folder")
    if not Path(path).exists():
        raise DataError(f"dataset: '{name}' expects its files at {path}, which does not exist")
    if split or is_saved_dataset(path):
        return rows_source(name, path, split)
    return FileSource.from_path(name, path, **({"formats": formats} if formats else {}))


def _c4_split(name: str, path: str | Path | None, split: str) -> TextSource:
    if split not in C4_NUM_FILES:
        raise DataError(f"dataset: '{name}' has the splits {', '.join(C4_NUM_FILES)}, not '{split}'")
    return c4_source(name, split, path)


DATASETS: dict[str, DatasetEntry] = {
    "c4": DatasetEntry(
        "C4 English train split (allenai/c4), streamed from the hub; dataset_path: a copy `titan-data prepare` wrote",
        partial(c4_source, "c4", "train"),
        partial(_c4_split, "c4"),
    ),
    "c4_validation": DatasetEntry(
        "C4 English validation split, streamed; dataset_path: a copy `titan-data prepare c4_validation` wrote",
        partial(c4_source, "c4_validation", "validation"),
        partial(_c4_split, "c4_validation"),
    ),
    "c4_test": DatasetEntry(
        "2000 C4-style documents bundled with titan-data, for tests and debug runs",
        partial(_local, "c4_test", ("json",), ASSETS / "c4_test"),
        partial(_local, "c4_test", ("json",), ASSETS / "c4_test"),
    ),
    "json": DatasetEntry(
        "JSON lines (.jsonl, .json, .gz) with a 'text' field at dataset_path",
        partial(_local, "json", ("json",), None),
        partial(_local, "json", ("json",), None),
    ),
    "parquet": DatasetEntry(
        "parquet files with a 'text' column at dataset_path",
        partial(_local, "parquet", ("parquet",), None),
        partial(_local, "parquet", ("parquet",), None),
    ),
    "text": DatasetEntry(
        "text files (.txt, .txt.gz) at dataset_path, one document per line",
        partial(_local, "text", ("text",), None),
        partial(_local, "text", ("text",), None),
    ),
    CHAT: DatasetEntry(
        "chat rows (messages, prompt/completion or alpaca) at dataset_path: .jsonl/.json/.parquet, or a hub "
        "dataset id; rendered with the model's chat template and masked by turn (see [sft])",
        None,
    ),
    PREFERENCE: DatasetEntry(
        "preference pairs (prompt/chosen/rejected, conversational, plain text or implicit prompt) at "
        "dataset_path: .jsonl/.json/.parquet, or a hub dataset id; rendered with the model's chat template",
        None,
    ),
    PROMPTS: DatasetEntry(
        "prompt-only rows (TRL's layout: 'prompt' as a conversation or text, other columns for the reward "
        "functions) at dataset_path: .jsonl/.json/.parquet, or a hub dataset id; see [grpo]",
        None,
    ),
    TOKEN_SHARDS: DatasetEntry(
        "token shards written by `titan-data tokenize` at dataset_path, memory-mapped", None
    ),
}


def register_dataset(
    name: str, open_source: Callable[[str | Path | None], TextSource], help: str = ""
) -> None:
    """Make `name` usable as a dataset: `open_source(dataset_path)` returns its `TextSource`.

    For a plain iterable of texts, return `IterableSource(name, lambda: texts)`; for local files,
    `FileSource.from_path(name, path, text_field=...)`.
    """
    if name in DATASETS:
        raise DataError(f"dataset: '{name}' is already registered; choose another name")
    DATASETS[name] = DatasetEntry(help or name, open_source)


def get_source(name: str, path: str | Path | None = None, split: str = "") -> TextSource:
    """The text of registered dataset `name`, read from `path` when given instead of its default location;
    `split` names one of its splits (a hub dataset's, a `DatasetDict`'s); empty: its default."""
    if name not in DATASETS:
        raise DataError(f"dataset: unknown dataset '{name}'; registered: {', '.join(sorted(DATASETS))}")
    entry = DATASETS[name]
    if name in (CHAT, PREFERENCE, PROMPTS):
        raise DataError(
            f"dataset: '{name}' holds conversations, not text; build it with ChatDataset, PreferenceDataset "
            "or PromptDataset"
        )
    if entry.open_source is None:
        raise DataError(f"dataset: '{name}' holds tokens, not text; build it with build_dataset()")
    if split:
        if entry.open_split is None:
            raise DataError(f"dataset: '{name}' has no splits to choose; leave dataset_split empty")
        return entry.open_split(path, split)
    return entry.open_source(path)


def check_dataset(name: str, path: str | Path | None = None, split: str = "") -> None:
    """Raise DataError, with the fix, unless dataset `name` can be read from `path` now: its files
    exist, or its remote source answers. A trainer calls it before any work."""
    if name in (CHAT, PREFERENCE, PROMPTS):
        if path is None:
            raise DataError(
                f"dataset: '{name}' needs dataset_path: a {name} file or folder, or a hub dataset id"
            )
        return  # reading the rows (load_examples) checks them and names the bad one
    if DATASETS.get(name) is not None and DATASETS[name].open_source is None:
        if path is None:
            raise DataError(f"dataset: '{name}' needs dataset_path: the folder `titan-data tokenize` wrote")
        return  # local shards: opening them (build_dataset) checks the folder and says what is wrong
    get_source(name, path, split).check()
