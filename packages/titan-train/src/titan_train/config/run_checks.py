"""The checks a run's config must pass once the world size and the device are known: one entry point.

Reading a config (`load_job_config`) has already checked every field and the rules across fields
(`validate_config`). `check_run` adds the rules that need the run's world size or device: settings
this build cannot honour on the device (`refuse_unsupported`) and `[checkpoint]` switches that would
do nothing or cannot work at that world size. `titan-train` calls it once, before it joins the
process group; `titan-train check` once, for the ranks it plans for. The trainer does not check
again. What needs the built model or mesh (heads against tp, the tokenizer against the vocabulary,
the checkpoint in the folder) is checked where it is built, still before the first step.
"""

from __future__ import annotations

from titan_ckpt import CheckpointError, LoadPolicy
from titan_train.config.schema import JobConfig
from titan_train.config.unsupported import refuse_unsupported
from titan_train.errors import ConfigError
from titan_train.registry import FROM_HF


def check_run(config: JobConfig, *, world_size: int, device_type: str) -> None:
    """Raise the ConfigError that would stop a run of `config` on `world_size` ranks of `device_type`."""
    refuse_unsupported(config, device_type)
    check_checkpoint_config(config, world_size)
    h = config.health
    if h.drill != "none" and not h.drill_rank < world_size:
        raise ConfigError(
            f"config: health.drill_rank ({h.drill_rank}) is not a rank of this {world_size}-rank job; "
            f"pick one in 0..{world_size - 1}"
        )


def check_checkpoint_config(config: JobConfig, world_size: int) -> None:
    """Refuse [checkpoint] combinations that cannot do what they say, naming the fix.

    A switch that would be silently ignored is refused: an `initial_load_path` (or `load_step`,
    `load_only`, `create_seed_checkpoint`) with `checkpoint.enable = false` would load nothing, and a
    week-long run would quietly start from scratch; a `last_save_in_hf` would export nothing. So is
    `model.flavor = "from_hf"` with nothing to load its weights from (the trainer refuses the same when
    checkpointing is on but no checkpoint or initial load is found).
    """
    c = config.checkpoint
    if c.hf_export_lossy and not c.last_save_in_hf:
        raise ConfigError(
            "config: checkpoint.hf_export_lossy is set but checkpoint.last_save_in_hf is false, so it "
            "would be ignored; set last_save_in_hf = true, or drop hf_export_lossy"
        )
    if not c.enable:
        ignored = [
            name
            for name, is_set in (
                ("initial_load_path", bool(c.initial_load_path)),
                ("initial_load_in_hf", c.initial_load_in_hf),  # the trainer's checkpointer does the load
                ("load_step", c.load_step >= 0),
                ("load_only", c.load_only),
                ("create_seed_checkpoint", c.create_seed_checkpoint),
                ("initial_load_in_hf_quantized", c.initial_load_in_hf_quantized),
                ("last_save_in_hf", c.last_save_in_hf),  # no last save, so no export
            )
            if is_set
        ]
        if ignored:
            raise ConfigError(
                f"config: checkpoint.{ignored[0]} is set but checkpoint.enable is false, so it would be ignored; "
                "add --checkpoint.enable true (with --checkpoint.load_only true to load without saving)"
            )
        if config.model.flavor == FROM_HF:
            raise ConfigError(
                f"config: model.flavor = '{FROM_HF}' with checkpoint.enable false would train the Hugging Face "
                "shape from random weights; add --checkpoint.enable --checkpoint.initial_load_in_hf to load the "
                "folder's weights, or name a flavor to train from scratch"
            )
        return
    if c.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            f"config: checkpoint.create_seed_checkpoint writes the unsharded model from one process, but "
            f"WORLD_SIZE is {world_size}; run it with NGPU=1 (one process, no parallelism)"
        )
    try:  # titan-ckpt's rules of what to load first (Hugging Face files: the model alone, a quantised format)
        LoadPolicy(
            load_step=c.load_step,
            initial_load_model_only=c.initial_load_model_only,
            initial_load_in_hf=c.initial_load_in_hf,
            initial_load_in_hf_quantized=c.initial_load_in_hf_quantized,
        )
    except CheckpointError as err:
        raise ConfigError(f"config: {err}") from err
    if c.initial_load_in_hf and not (c.initial_load_path or config.model.hf_assets_path):
        raise ConfigError(
            "config: checkpoint.initial_load_in_hf needs the Hugging Face folder: set checkpoint.initial_load_path "
            "or model.hf_assets_path"
        )
