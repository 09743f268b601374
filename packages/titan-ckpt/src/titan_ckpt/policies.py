"""A Checkpointer's options, as three frozen policies that refuse a bad value when they are made.

Each field has the name of the torchtitan `[checkpoint]` option it mirrors (the last save's without
its `last_save_` prefix), so a trainer maps a config section onto them field by field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from titan_ckpt.async_save import check_async_mode
from titan_ckpt.errors import CheckpointError
from titan_ckpt.hf_safetensors import DEFAULT_MAX_SHARD_BYTES
from titan_ckpt.load_source import InitialLoad

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class SavePolicy:
    """What to save and when: every `interval` steps (and step 1 with `enable_first_step_checkpoint`),
    keeping the newest `keep_latest_k` (0 keeps all), in the background per `async_mode`; nothing at
    all with `load_only`."""

    interval: int = 500
    keep_latest_k: int = 0
    async_mode: str = "disabled"
    enable_first_step_checkpoint: bool = False
    load_only: bool = False

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise CheckpointError(f"checkpoint: interval must be >= 1, got {self.interval}")
        if self.keep_latest_k < 0:
            raise CheckpointError(
                f"checkpoint: keep_latest_k must be >= 0 (0 keeps all), got {self.keep_latest_k}"
            )
        check_async_mode(self.async_mode)


@dataclass(frozen=True)
class LoadPolicy:
    """What to load first: the run's checkpoint at `load_step` (-1: the newest), else the weights at
    `initial_load_path` (the model alone with `initial_load_model_only`; Hugging Face files with
    `initial_load_in_hf`, float8 block-quantised ones with `initial_load_in_hf_quantized` even where
    their config.json does not say so); states named in `exclude_from_loading` keep their values."""

    load_step: int = -1
    initial_load_path: str | Path | None = None
    initial_load_model_only: bool = True
    initial_load_in_hf: bool = False
    initial_load_in_hf_quantized: bool = False
    exclude_from_loading: Iterable[str] = ()

    def __post_init__(self) -> None:
        if self.load_step < -1:
            raise CheckpointError(
                f"checkpoint: load_step must be a step >= 0, or -1 for the newest; got {self.load_step}"
            )
        if self.initial_load_in_hf and not self.initial_load_model_only:
            raise CheckpointError(
                "checkpoint: initial_load_in_hf loads model weights only; set initial_load_model_only = true"
            )
        if self.initial_load_in_hf_quantized and not self.initial_load_in_hf:
            raise CheckpointError(
                "checkpoint: initial_load_in_hf_quantized describes Hugging Face files; set initial_load_in_hf = true"
            )
        object.__setattr__(self, "exclude_from_loading", tuple(self.exclude_from_loading))

    @property
    def initial(self) -> InitialLoad:
        path = str(self.initial_load_path) if self.initial_load_path else None
        return InitialLoad(path, self.initial_load_model_only, self.initial_load_in_hf)


@dataclass(frozen=True)
class LastSavePolicy:
    """The last step's save, always a full checkpoint, and the export published beside it: with
    `model_only`, the model in `export_dtype`, as DCP files or with `in_hf` as Hugging Face files
    (with `hf_extra_files`, name -> bytes or a file to copy, `hf_config_keys` set in its config.json over
    the adapter's (a base model's token ids), in shards of at most `max_shard_bytes`;
    with `hf_lossy`, even where the format cannot hold trained state: see `titan_ckpt.hf_export`)."""

    model_only: bool = False
    in_hf: bool = False
    export_dtype: str = "float32"
    hf_extra_files: Mapping[str, bytes | Path] = field(default_factory=dict)
    hf_config_keys: Mapping[str, Any] = field(default_factory=dict)
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    hf_lossy: bool = False

    def __post_init__(self) -> None:
        if self.in_hf and not self.model_only:
            raise CheckpointError(
                "checkpoint: last_save_in_hf saves only the model; set last_save_model_only = true"
            )
        if self.export_dtype not in EXPORT_DTYPES:
            raise CheckpointError(
                f"checkpoint: export_dtype '{self.export_dtype}' is not one of {', '.join(EXPORT_DTYPES)}"
            )
        object.__setattr__(self, "hf_extra_files", dict(self.hf_extra_files))
        object.__setattr__(self, "hf_config_keys", dict(self.hf_config_keys))

    @property
    def dtype(self) -> torch.dtype:
        """`export_dtype` as a torch dtype."""
        return EXPORT_DTYPES[self.export_dtype]
