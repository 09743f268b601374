"""Tokenizers, packed pretraining datasets with exact resume, and resumable loaders."""

from titan_data.datasets.packed import PackedTokenDataset
from titan_data.datasets.sources import DATASETS, TextSource, get_source
from titan_data.errors import DataError
from titan_data.loader import TokenLoader
from titan_data.tokenizers.base import Tokenizer
from titan_data.tokenizers.build import build_tokenizer

__all__ = [
    "DATASETS",
    "DataError",
    "PackedTokenDataset",
    "TextSource",
    "TokenLoader",
    "Tokenizer",
    "build_tokenizer",
    "get_source",
]
