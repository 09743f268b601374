"""The tokenizer and the token loaders of `[training]` and `[validation]`."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from titan_data import (
    ChatDataset,
    ChatOptions,
    PreferenceDataset,
    PromptDataset,
    PromptFields,
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
    load_prompts,
    mix_rows,
)
from titan_train.config.data_rules import default_steps
from titan_train.config.grpo_section import is_prompts
from titan_train.config.schema import JobConfig
from titan_train.config.sft_section import is_chat, is_preference, template_variables
from titan_train.errors import ConfigError
from titan_train.wiring.data_sources import data_section, epoch_steps, row_filter, section_paths, text_source

logger = logging.getLogger(__name__)

BUNDLED_TOKENIZER = Path(__import__("titan_data").__file__).parent / "assets" / "tokenizer"


def build_tokenizer_for(config: JobConfig) -> Tokenizer:
    return build_tokenizer(config.model.hf_assets_path or BUNDLED_TOKENIZER)


def build_loader(
    config: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, *, num_streams: int | None = None
) -> TokenLoader:
    """The training loader, after checking that the training and (if enabled) validation data can be read
    now: a hub that does not answer or a dataset_path without the files stops the run here, in one line,
    rather than at the first batch or the first validation. `num_streams` is the run's (`RunPlan.num_streams`,
    which a resumed position may have set), else `training.dataloader.num_streams`."""
    t, v = config.training, config.validation
    for path in section_paths(t):
        check_dataset(t.dataset, path, t.dataset_split)
    if v.enable and not v.holdout_share:
        check_dataset(v.dataset, v.dataset_path, v.dataset_split)
    return _token_loader(config, t, tokenizer, dp_rank, dp_degree, infinite=True, num_streams=num_streams)


def build_validation_loader(
    config: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int
) -> TokenLoader:
    """One pass over the validation set (not looping), dealt over data-parallel ranks like training data."""
    return _token_loader(config, config.validation, tokenizer, dp_rank, dp_degree, infinite=False)


def chat_template(config: JobConfig):
    """The model's chat template (or `sft.chat_template`), with `sft.template_variables`."""
    return load_chat_template(
        config.model.hf_assets_path or BUNDLED_TOKENIZER,
        config.sft.chat_template,
        template_variables(config.sft.template_variables),
    )


def chat_options(config: JobConfig) -> ChatOptions:
    """The `[sft]` section as titan-data's options."""
    s = config.sft
    fields = RowFields(s.format, s.messages_field, s.prompt_field, s.completion_field)
    return ChatOptions(fields, s.loss_on, s.packing, s.overlong, s.bad_rows)


def _chat_examples(config: JobConfig, section, tokenizer: Tokenizer) -> tuple[list, str]:
    """Conversations rendered with the model's chat template and masked by turn (`[sft]`): one path's, or a
    weighted mixture's, the train or held-out part; and a name that says which (a resume checks it)."""
    template = chat_template(config)
    options = chat_options(config)
    data, part = data_section(config, section)
    keep = row_filter(part, config.validation.holdout_share)
    paths = section_paths(data)
    parts = [
        load_examples(
            path,
            template,
            tokenizer,
            section.seq_len,
            options,
            split=data.dataset_split,
            config=_hub_config(config, data),
            keep_row=keep,
        )
        for path in paths
    ]
    name = str(paths[0]) + (f"[{part}]" if part else "")
    if len(parts) == 1:
        return parts[0], name
    weights = list(data.dataset_weights)
    return mix_rows(parts, weights, [str(p) for p in paths]), f"mixture({paths}, weights {weights})"


def _dataset(config: JobConfig, section, tokenizer: Tokenizer, *, infinite: bool):
    """`make(layout, finite=False)`: the section's windows for the streams of `layout`: chat rows, or
    documents packed (`token_shards` memory-mapped); under a held-out share, the training data's part (see
    `data_sources`). The data is read once; `make` deals it (the epoch count makes a finite copy)."""
    data, part = data_section(config, section)
    if is_prompts(data):
        prompts, g = _prompts(config, section, tokenizer), config.grpo
        return lambda layout, finite=False: PromptDataset(
            prompts,
            g.max_prompt_length,
            pad_id=tokenizer.eos_id,
            streams=layout,
            infinite=infinite and not finite,
            name=str(section.dataset_path),
            repeat=g.num_iterations,
            chunk=_step_prompts(config, layout.world_size),
        )
    if is_preference(data):
        pairs = _preference_pairs(config, section, tokenizer)
        return lambda layout, finite=False: PreferenceDataset(
            pairs,
            section.seq_len,
            packing=config.sft.packing,
            pad_id=tokenizer.eos_id,
            streams=layout,
            infinite=infinite and not finite,
            name=str(section.dataset_path),
            pair_index=config.preference.reference == "precompute",  # precomputed log-probs' key
        )
    if is_chat(data):
        examples, name = _chat_examples(config, section, tokenizer)
        return lambda layout, finite=False: ChatDataset(
            examples,
            section.seq_len,
            packing=config.sft.packing,
            pad_id=tokenizer.eos_id,
            streams=layout,
            infinite=infinite and not finite,
            name=name,
        )
    source = None
    if part is not None or len(section_paths(data)) > 1:
        source = text_source(data, part, config.validation.holdout_share)
    return lambda layout, finite=False: build_dataset(
        data.dataset,
        data.dataset_path,
        tokenizer,
        section.seq_len,
        streams=layout,
        infinite=infinite and not finite,
        split=data.dataset_split,
        source=source,
    )


def _preference_pairs(config: JobConfig, section, tokenizer: Tokenizer) -> list:
    """Preference pairs rendered with the chat template as chat rows are ([sft]'s packing, overlong,
    bad_rows, chat_template and template_variables apply), a pair one unit of the stream."""
    template = chat_template(config)
    s = config.sft
    return load_pairs(
        section.dataset_path,
        template,
        tokenizer,
        section.seq_len,
        packing=s.packing,
        overlong=s.overlong,
        bad_rows=s.bad_rows,
        config=_hub_config(config, section),
    )


def _step_prompts(config: JobConfig, dp_degree: int) -> int:
    """The prompts one rank's optimizer step continues: its micro-batches' completions / num_generations."""
    t = config.training
    accumulation = t.global_batch_size // (t.local_batch_size * dp_degree) if t.global_batch_size > 0 else 1
    return accumulation * t.local_batch_size // config.grpo.num_generations


def _prompts(config: JobConfig, section, tokenizer: Tokenizer) -> list:
    """Prompt-only rows, conversations rendered with the chat template and its generation prompt ([grpo])."""
    template = chat_template(config)
    g = config.grpo
    return load_prompts(
        section.dataset_path,
        template,
        tokenizer,
        g.max_prompt_length,
        fields=PromptFields(g.prompt_field, g.text_prompts == "user_turn", g.system_prompt),
        split=section.dataset_split,
        config=_hub_config(config, section),
        overlong=g.overlong_prompts,
        bad_rows=config.sft.bad_rows,
    )


def _hub_config(config: JobConfig, section) -> str:
    """A section's hub dataset configuration: training.dataset_config (validation data reads its default)."""
    return config.training.dataset_config if section is config.training else ""


def planned_steps(config: JobConfig, tokenizer: Tokenizer, dp_degree: int) -> int:
    """The steps the run trains: training.steps, or with training.epochs the steps that many passes over
    the (finite) training data take, counted here once, before the schedule is built from them (a
    training.steps given as another number is refused). For chat rows (in memory: cheap) the steps of an
    epoch are logged either way."""
    t = config.training
    if not (t.epochs or is_chat(t)):
        return t.steps
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp_degree
    what = ", ".join(map(str, section_paths(t)))
    make = _dataset(config, t, tokenizer, infinite=True)
    steps = epoch_steps(lambda layout: make(layout, finite=True), global_batch, what)
    if not t.epochs:
        return t.steps
    if t.steps not in (default_steps(config), t.epochs * steps):
        raise ConfigError(
            f"config: training.epochs ({t.epochs}) is {t.epochs * steps} steps, and training.steps is "
            f"{t.steps}; remove training.steps or set it to {t.epochs * steps}"
        )
    logger.info("data: training.epochs %d: %d steps", t.epochs, t.epochs * steps)
    return t.epochs * steps


def _token_loader(
    config: JobConfig,
    section,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_degree: int,
    *,
    infinite: bool,
    num_streams: int | None = None,
) -> TokenLoader:
    """A loader for `[training]` or `[validation]`: both name dataset, path, seq_len, batch size and streams."""
    streams = StreamLayout(
        dp_rank, dp_degree, section.dataloader.num_streams if num_streams is None else num_streams
    )
    make = _dataset(config, section, tokenizer, infinite=infinite)
    dataset = make(streams)
    d = section.dataloader
    # Prompts: a micro-batch of local_batch_size completions continues local_batch_size / num_generations prompts.
    per_batch = section.local_batch_size
    if is_prompts(section):
        per_batch //= config.grpo.num_generations
    return TokenLoader(
        dataset,
        batch_size=per_batch,
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
