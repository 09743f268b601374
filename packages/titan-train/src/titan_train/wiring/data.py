"""The tokenizer and the token loaders of `[training]` and `[validation]`."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from titan_data import (
    CHAT,
    PREFERENCE,
    ChatDataset,
    ChatOptions,
    PreferenceDataset,
    RowFields,
    StreamLayout,
    Tokenizer,
    TokenLoader,
    build_dataset,
    build_tokenizer,
    check_dataset,
    load_chat_template,
    load_examples,
    load_pairs,
)
from titan_train.config.schema import JobConfig

logger = logging.getLogger(__name__)

BUNDLED_TOKENIZER = Path(__import__("titan_data").__file__).parent / "assets" / "tokenizer"


def build_tokenizer_for(config: JobConfig) -> Tokenizer:
    return build_tokenizer(config.model.hf_assets_path or BUNDLED_TOKENIZER)


def build_loader(config: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int) -> TokenLoader:
    """The training loader, after checking that the training and (if enabled) validation data can be read
    now: a hub that does not answer or a dataset_path without the files stops the run here, in one line,
    rather than at the first batch or the first validation."""
    check_dataset(config.training.dataset, config.training.dataset_path)
    if config.validation.enable:
        check_dataset(config.validation.dataset, config.validation.dataset_path)
    return _token_loader(config, config.training, tokenizer, dp_rank, dp_degree, infinite=True)


def build_validation_loader(
    config: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int
) -> TokenLoader:
    """One pass over the validation set (not looping), dealt over data-parallel ranks like training data."""
    return _token_loader(config, config.validation, tokenizer, dp_rank, dp_degree, infinite=False)


def chat_options(config: JobConfig) -> ChatOptions:
    """The `[sft]` section as titan-data's options."""
    s = config.sft
    fields = RowFields(s.format, s.messages_field, s.prompt_field, s.completion_field)
    return ChatOptions(fields, s.loss_on, s.packing, s.overlong, s.bad_rows)


def _chat_dataset(config: JobConfig, section, tokenizer: Tokenizer, streams: StreamLayout, *, infinite: bool):
    """Conversations rendered with the model's chat template and masked by turn (`[sft]`)."""
    template = load_chat_template(config.model.hf_assets_path or BUNDLED_TOKENIZER, config.sft.chat_template)
    options = chat_options(config)
    examples = load_examples(section.dataset_path, template, tokenizer, section.seq_len, options)
    return ChatDataset(
        examples,
        section.seq_len,
        packing=options.packing,
        pad_id=tokenizer.eos_id,
        streams=streams,
        infinite=infinite,
        name=str(section.dataset_path),
    )


def _preference_dataset(
    config: JobConfig, section, tokenizer: Tokenizer, streams: StreamLayout, *, infinite: bool
) -> PreferenceDataset:
    """Preference pairs rendered with the chat template as chat rows are ([sft]'s packing, overlong,
    bad_rows and chat_template apply), a pair one unit of the stream."""
    template = load_chat_template(config.model.hf_assets_path or BUNDLED_TOKENIZER, config.sft.chat_template)
    s = config.sft
    pairs = load_pairs(
        section.dataset_path,
        template,
        tokenizer,
        section.seq_len,
        packing=s.packing,
        overlong=s.overlong,
        bad_rows=s.bad_rows,
    )
    return PreferenceDataset(
        pairs,
        section.seq_len,
        packing=s.packing,
        pad_id=tokenizer.eos_id,
        streams=streams,
        infinite=infinite,
        name=str(section.dataset_path),
    )


def _token_loader(
    config: JobConfig, section, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, *, infinite: bool
) -> TokenLoader:
    """A loader for `[training]` or `[validation]`: both name dataset, path, seq_len, batch size and streams."""
    streams = StreamLayout(dp_rank, dp_degree, section.dataloader.num_streams)
    if section.dataset == CHAT:
        dataset = _chat_dataset(config, section, tokenizer, streams, infinite=infinite)
    elif section.dataset == PREFERENCE:
        dataset = _preference_dataset(config, section, tokenizer, streams, infinite=infinite)
    else:
        dataset = build_dataset(
            section.dataset,
            section.dataset_path,
            tokenizer,
            section.seq_len,
            streams=streams,
            infinite=infinite,
        )
    d = section.dataloader
    return TokenLoader(
        dataset,
        batch_size=section.local_batch_size,
        num_workers=d.num_workers,
        pin_memory=d.pin_memory and _pinning_applies(section),
        persistent_workers=d.persistent_workers,
        prefetch_factor=d.prefetch_factor,
    )


def _pinning_applies(section) -> bool:
    """Pinned (page-locked) batches speed up copies to an accelerator; without one, batches already sit in
    the memory the CPU trains from, so there is nothing to pin: said once, at start."""
    if torch.accelerator.is_available():
        return True
    logger.warning(
        "%s.dataloader.pin_memory: no accelerator here, so batches stay in ordinary host memory, which the "
        "CPU reads directly (pinning only speeds up copies to a GPU)",
        "validation" if hasattr(section, "freq") else "training",
    )
    return False
