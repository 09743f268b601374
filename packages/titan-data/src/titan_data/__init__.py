"""Tokenizers, packed pretraining, chat and preference datasets with exact resume, resumable loaders, and preprocessing.

Names load on first use (PEP 562), so that preprocessing (`titan-data tokenize` and its worker
processes) starts without importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_HOME = {
    "CHAT": "titan_data.datasets.registry",
    "ChatDataset": "titan_data.chat.dataset",
    "IGNORE_INDEX": "titan_data.chat.dataset",
    "ChatOptions": "titan_data.chat.dataset",
    "ChatTemplate": "titan_data.chat.template",
    "DATASETS": "titan_data.datasets.registry",
    "DataError": "titan_data.errors",
    "DocumentReader": "titan_data.datasets.sources",
    "FileSource": "titan_data.datasets.file_formats",
    "HoldoutSource": "titan_data.datasets.holdout",
    "IterableSource": "titan_data.datasets.sources",
    "MemmapTokenDataset": "titan_data.datasets.memmap",
    "MixtureSource": "titan_data.datasets.mixture",
    "OneShardSource": "titan_data.datasets.sources",
    "PREFERENCE": "titan_data.datasets.registry",
    "PreferenceDataset": "titan_data.preference.dataset",
    "PackedTokenDataset": "titan_data.datasets.packed",
    "PROMPTS": "titan_data.datasets.registry",
    "Prompt": "titan_data.prompts.rows",
    "PromptFields": "titan_data.prompts.rows",
    "PromptDataset": "titan_data.prompts.dataset",
    "RetryPolicy": "titan_data.datasets.http_files",
    "RowFields": "titan_data.chat.rows",
    "RowsSource": "titan_data.datasets.hf_datasets",
    "ShardIndex": "titan_data.shards.index",
    "SourceUnavailable": "titan_data.errors",
    "StreamLayout": "titan_data.datasets.windows",
    "TextSource": "titan_data.datasets.sources",
    "TokenLoader": "titan_data.loader",
    "Tokenizer": "titan_data.tokenizers.base",
    "build_dataset": "titan_data.datasets.build",
    "build_tokenizer": "titan_data.tokenizers.build",
    "chat_prompt": "titan_data.chat.prompt",
    "check_dataset": "titan_data.datasets.registry",
    "get_source": "titan_data.datasets.registry",
    "is_saved_dataset": "titan_data.datasets.hf_datasets",
    "keep_row": "titan_data.datasets.holdout",
    "load_chat_template": "titan_data.chat.template",
    "load_examples": "titan_data.chat.dataset",
    "load_pairs": "titan_data.preference.pairs",
    "load_prompts": "titan_data.prompts.rows",
    "load_rows": "titan_data.datasets.hf_datasets",
    "mix_rows": "titan_data.datasets.mixture",
    "register_dataset": "titan_data.datasets.registry",
    "split_rows": "titan_data.datasets.holdout",
    "tokenize_conversation": "titan_data.chat.masks",
    "tokenize_to_shards": "titan_data.tokenize_job",
}

__all__ = [
    "CHAT",
    "ChatDataset",
    "IGNORE_INDEX",
    "ChatOptions",
    "ChatTemplate",
    "DATASETS",
    "DataError",
    "DocumentReader",
    "FileSource",
    "HoldoutSource",
    "IterableSource",
    "MemmapTokenDataset",
    "MixtureSource",
    "OneShardSource",
    "PREFERENCE",
    "PreferenceDataset",
    "PackedTokenDataset",
    "PROMPTS",
    "Prompt",
    "PromptDataset",
    "PromptFields",
    "RetryPolicy",
    "RowFields",
    "RowsSource",
    "ShardIndex",
    "SourceUnavailable",
    "StreamLayout",
    "TextSource",
    "TokenLoader",
    "Tokenizer",
    "build_dataset",
    "build_tokenizer",
    "chat_prompt",
    "check_dataset",
    "get_source",
    "is_saved_dataset",
    "keep_row",
    "load_chat_template",
    "load_examples",
    "load_pairs",
    "load_prompts",
    "load_rows",
    "mix_rows",
    "register_dataset",
    "split_rows",
    "tokenize_conversation",
    "tokenize_to_shards",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'titan_data' has no attribute '{name}'")
    value = getattr(import_module(_HOME[name]), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from titan_data.chat.dataset import IGNORE_INDEX, ChatDataset, ChatOptions, load_examples
    from titan_data.chat.masks import tokenize_conversation
    from titan_data.chat.prompt import chat_prompt
    from titan_data.chat.rows import RowFields
    from titan_data.chat.template import ChatTemplate, load_chat_template
    from titan_data.datasets.build import build_dataset
    from titan_data.datasets.file_formats import FileSource
    from titan_data.datasets.hf_datasets import RowsSource, is_saved_dataset, load_rows
    from titan_data.datasets.holdout import HoldoutSource, keep_row, split_rows
    from titan_data.datasets.http_files import RetryPolicy
    from titan_data.datasets.memmap import MemmapTokenDataset
    from titan_data.datasets.mixture import MixtureSource, mix_rows
    from titan_data.datasets.packed import PackedTokenDataset
    from titan_data.datasets.registry import (
        CHAT,
        DATASETS,
        PREFERENCE,
        PROMPTS,
        check_dataset,
        get_source,
        register_dataset,
    )
    from titan_data.datasets.sources import DocumentReader, IterableSource, OneShardSource, TextSource
    from titan_data.datasets.windows import StreamLayout
    from titan_data.errors import DataError, SourceUnavailable
    from titan_data.loader import TokenLoader
    from titan_data.preference.dataset import PreferenceDataset
    from titan_data.preference.pairs import load_pairs
    from titan_data.prompts.dataset import PromptDataset
    from titan_data.prompts.rows import Prompt, PromptFields, load_prompts
    from titan_data.shards.index import ShardIndex
    from titan_data.tokenize_job import tokenize_to_shards
    from titan_data.tokenizers.base import Tokenizer
    from titan_data.tokenizers.build import build_tokenizer
