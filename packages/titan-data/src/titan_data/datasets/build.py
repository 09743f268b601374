"""The one call a trainer makes: a dataset by name and path, packed on the fly or memory-mapped."""

from __future__ import annotations

from pathlib import Path

from titan_data.datasets.memmap import MemmapTokenDataset
from titan_data.datasets.packed import PackedTokenDataset
from titan_data.datasets.registry import TOKEN_SHARDS, get_source
from titan_data.datasets.sources import TextSource
from titan_data.datasets.windows import ONE_RANK, StreamLayout
from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer


def build_dataset(
    name: str,
    path: str | Path | None,
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    streams: StreamLayout = ONE_RANK,
    infinite: bool = True,
    split: str = "",
    source: TextSource | None = None,
) -> PackedTokenDataset | MemmapTokenDataset:
    """Dataset `name` (see `DATASETS`) read from `path` (its `split`, where it has splits), this rank's
    `streams` of it; `source`, when given, is read instead (a mixture, a held-out part). `token_shards`
    memory-maps a folder that `titan-data tokenize` wrote, after checking it was tokenised like
    `tokenizer` tokenises."""
    if name != TOKEN_SHARDS:
        return PackedTokenDataset(
            source or get_source(name, path, split), tokenizer, seq_len, streams=streams, infinite=infinite
        )
    if split:
        raise DataError(f"dataset: '{TOKEN_SHARDS}' has no splits; leave dataset_split empty")
    if path is None:
        raise DataError(
            f"dataset: '{TOKEN_SHARDS}' needs dataset_path: the folder `titan-data tokenize` wrote"
        )
    dataset = MemmapTokenDataset(path, seq_len, streams=streams, infinite=infinite)
    written = dataset.tokenizer_identity
    ours = {"vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    if any(written[k] != v for k, v in ours.items()):
        raise DataError(
            f"dataset: {path} was tokenised with {written['file']} (vocab_size {written['vocab_size']}, bos "
            f"{written['bos_id']}, eos {written['eos_id']}), but this run's tokenizer has vocab_size "
            f"{ours['vocab_size']}, bos {ours['bos_id']}, eos {ours['eos_id']}; tokenise again with this "
            "tokenizer or point the run at the one the shards were written with"
        )
    return dataset
