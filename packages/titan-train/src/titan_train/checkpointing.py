"""The trainer's checkpointing: the `[checkpoint]` section mapped onto titan-ckpt's Checkpointer.

A switch that would be silently ignored is refused here instead: an `initial_load_path` (or
`load_step`, `load_only`, `create_seed_checkpoint`) with `checkpoint.enable = false` would load
nothing, and a week-long run would quietly start from scratch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from titan_ckpt import Checkpointer, HFStateDictAdapter
from titan_train.config import JobConfig
from titan_train.errors import ConfigError

logger = logging.getLogger(__name__)


def check_checkpoint_config(config: JobConfig, world_size: int) -> None:
    """Refuse [checkpoint] combinations that cannot do what they say, naming the fix."""
    c = config.checkpoint
    if not c.enable:
        ignored = [
            name
            for name, is_set in (
                ("initial_load_path", bool(c.initial_load_path)),
                ("load_step", c.load_step >= 0),
                ("load_only", c.load_only),
                ("create_seed_checkpoint", c.create_seed_checkpoint),
            )
            if is_set
        ]
        if ignored:
            raise ConfigError(
                f"config: checkpoint.{ignored[0]} is set but checkpoint.enable is false, so it would be ignored; "
                "add --checkpoint.enable true (with --checkpoint.load_only true to load without saving)"
            )
        return
    if c.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            f"config: checkpoint.create_seed_checkpoint writes the unsharded model from one process, but "
            f"WORLD_SIZE is {world_size}; run it with NGPU=1 (one process, no parallelism)"
        )
    if c.initial_load_in_hf and not (c.initial_load_path or config.model.hf_assets_path):
        raise ConfigError(
            "config: checkpoint.initial_load_in_hf needs the Hugging Face folder: set checkpoint.initial_load_path "
            "or model.hf_assets_path"
        )


def hf_adapter_for(model: nn.Module) -> HFStateDictAdapter:
    """The Hugging Face weight mapping of a Titan model (every registered family has the Llama layout)."""
    from titan_models import LlamaStateDictAdapter

    return LlamaStateDictAdapter(model.args)


def build_checkpointer(
    config: JobConfig, states: dict[str, Any], *, world_size: int, model: nn.Module | None = None
) -> Checkpointer | None:
    """The run's Checkpointer (None when checkpoint.enable is false); `states` as titan-ckpt takes them."""
    check_checkpoint_config(config, world_size)
    c = config.checkpoint
    if not c.enable:
        return None
    initial_load_path = c.initial_load_path
    if c.initial_load_in_hf and not initial_load_path:
        initial_load_path = config.model.hf_assets_path
        logger.info(
            "checkpoint: initial_load_in_hf with no initial_load_path: using model.hf_assets_path %s",
            initial_load_path,
        )
    needs_hf = c.initial_load_in_hf or c.last_save_in_hf
    return Checkpointer(
        Path(config.job.dump_folder) / c.folder,
        states,
        interval=c.interval,
        keep_latest_k=c.keep_latest_k,
        async_mode=c.async_mode,
        load_step=c.load_step,
        initial_load_path=initial_load_path,
        initial_load_model_only=c.initial_load_model_only,
        initial_load_in_hf=c.initial_load_in_hf,
        last_save_model_only=c.last_save_model_only,
        last_save_in_hf=c.last_save_in_hf,
        export_dtype=c.export_dtype,
        exclude_from_loading=c.exclude_from_loading,
        enable_first_step_checkpoint=c.enable_first_step_checkpoint,
        load_only=c.load_only,
        hf_adapter=hf_adapter_for(model) if needs_hf and model is not None else None,
    )


def restore_or_write_seed(checkpointer: Checkpointer | None, config: JobConfig) -> bool:
    """At the start of training: restore the run, or write the seed checkpoint and return True (stop)."""
    if checkpointer is None:
        return False
    if config.checkpoint.create_seed_checkpoint:
        checkpointer.save(0, model_only=True, wait=True)
        logger.info("checkpoint: seed checkpoint written to %s; exiting", checkpointer.step_folder(0))
        return True
    checkpointer.load()
    return False
