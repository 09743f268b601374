"""Hugging Face checkpoints in and out: the model shape a run uses, and the files an export carries.

Import: weights load by shape, so a checkpoint whose rotary scaling, rope theta or tied embeddings
differ from the flavor would train another function without a word. Its `config.json` is therefore
compared with the flavor before any work, and every differing field is named; a checkpoint that
differs only in its norm epsilon lends the run its own, with one log line. The flavor `from_hf`
takes the shape from that `config.json` instead.

Export: besides the weights and `config.json`, the folder gets `generation_config.json` and the
tokenizer files of `model.hf_assets_path`, so `AutoModelForCausalLM` and `AutoTokenizer` load it as
it is.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from titan_models.errors import ModelError
from titan_train.config.schema import JobConfig
from titan_train.errors import ConfigError
from titan_train.registry import FROM_HF, ModelFamily
from titan_train.wiring.data import BUNDLED_TOKENIZER

HF_CONFIG = "config.json"
# Differences from the flavor that a run takes from the checkpoint (with one log line) instead of
# refusing: published configs state their own norm epsilon (DeepSeek-V3's 1e-6 against torchtitan's
# 671B flavor's 1e-5), which moves the function by rounding, not its shape.
HARMLESS_FIELDS = frozenset({"rms_norm_eps", "latent_norm_eps"})
_EPSILON_ARGS = ("norm_eps", "latent_norm_eps", "final_norm_eps")
logger = logging.getLogger(__name__)
# Files of a Hugging Face tokenizer folder that AutoTokenizer reads (those present are copied).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def hf_checkpoint_folder(config: JobConfig) -> Path | None:
    """The Hugging Face folder whose weights the run loads at start, or None."""
    c = config.checkpoint
    folder = c.initial_load_path or config.model.hf_assets_path
    if not (c.enable and c.initial_load_in_hf and folder):
        return None  # (checkpoint.initial_load_in_hf without a folder is refused on its own)
    return Path(folder)


def _read_hf_config(folder: Path, why: str) -> dict:
    path = folder / HF_CONFIG
    if not path.is_file():
        raise ConfigError(
            f"config: {why}, but {folder} has no {HF_CONFIG}; put the checkpoint's {HF_CONFIG} there "
            "(apps/scripts/download_hf_assets.py --assets config fetches it)"
        )
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"config: {path} is not valid JSON ({err})") from err


def hf_mapping(family: ModelFamily, why: str):
    """The family's Hugging Face mapping, or the ConfigError saying it has none."""
    if family.hf is None:
        raise ConfigError(f"config: {why}, but model family {family.name} has no Hugging Face mapping")
    return family.hf


def model_args(config: JobConfig, family: ModelFamily, **overrides) -> Any:
    """The args of the run's model: its flavor (or, for `from_hf`, the Hugging Face config.json), with
    `overrides`. Refuses a Hugging Face checkpoint to load whose config.json differs from the flavor.

    Read once per run, by the resolve step (`titan_train.plan.resolve`)."""
    m = config.model
    folder = hf_checkpoint_folder(config)
    if m.flavor == FROM_HF:
        source = folder or (Path(m.hf_assets_path) if m.hf_assets_path else None)
        if source is None:
            raise ConfigError(
                f"config: model.flavor = '{FROM_HF}' reads the shape from a Hugging Face {HF_CONFIG}: set "
                "model.hf_assets_path (or checkpoint.initial_load_path with initial_load_in_hf) to its folder"
            )
        hf = _read_hf_config(
            source, f"model.flavor = '{FROM_HF}' reads the model shape from {source / HF_CONFIG}"
        )
        return hf_mapping(family, f"model.flavor = '{FROM_HF}'").args_from_config(hf, **overrides)
    args = family.args_for(m.flavor, **overrides)
    if folder is not None:
        hf = _read_hf_config(
            folder, "checkpoint.initial_load_in_hf checks the checkpoint's shape against the flavor"
        )
        hf_map = hf_mapping(family, "checkpoint.initial_load_in_hf")
        differences = hf_map.config_differences(args, hf)  # the run's args (seq_len decides YaRN)
        if differences and all(d.split(":", 1)[0] in HARMLESS_FIELDS for d in differences):
            args = _with_checkpoint_epsilons(args, hf_map.args_from_config(hf), differences, folder)
        elif differences:
            raise ConfigError(
                f"config: the Hugging Face checkpoint in {folder} is not {m.name} {m.flavor}: "
                f"{'; '.join(differences)}; set model.flavor = '{FROM_HF}' to train the checkpoint's own shape, "
                "or pick the flavor it was trained as"
            )
    return args


def check_hf_export(config: JobConfig, family: ModelFamily, args: Any) -> None:
    """Refuse, before any step, a `last_save_in_hf` export the Hugging Face class cannot compute, or
    one that would drop trained state without `checkpoint.hf_export_lossy` (which is refused where it
    changes nothing)."""
    c, m = config.checkpoint, config.model
    if not c.last_save_in_hf:
        if c.hf_export_lossy:
            raise ConfigError(
                "config: checkpoint.hf_export_lossy is set but checkpoint.last_save_in_hf is false, so it "
                "would be ignored; set last_save_in_hf = true, or drop hf_export_lossy"
            )
        return
    adapter = hf_mapping(family, "checkpoint.last_save_in_hf writes Hugging Face files").adapter(args)
    unheld = getattr(adapter, "hf_unheld_state", ())
    # The expert bias is the only such state today; the run trains it unless balancing is off (Qwen3-MoE's
    # default, or model.moe_load_balance_coeff = 0). A bias loaded nonzero and never trained is caught
    # by the export itself, which reads the values.
    trained = unheld and getattr(getattr(args, "moe_args", None), "update_bias", False)
    if trained and not c.hf_export_lossy:
        raise ConfigError(
            f"config: checkpoint.last_save_in_hf: {m.name} {m.flavor} trains {', '.join(unheld)} (auxiliary-loss-free "
            "balancing), which its Hugging Face format cannot hold, so the exported model would route tokens to "
            "other experts; set checkpoint.hf_export_lossy = true to export anyway (Titan keeps it under titan.* "
            "keys for its own re-import), or model.moe_load_balance_coeff = 0 to train without it"
        )
    if c.hf_export_lossy and not unheld:
        raise ConfigError(
            f"config: checkpoint.hf_export_lossy is set but {m.name} {m.flavor} has no state its Hugging Face "
            "format cannot hold, so it would be ignored; drop it"
        )
    try:
        adapter.hf_config()
    except ModelError as err:
        raise ConfigError(
            f"config: checkpoint.last_save_in_hf cannot export {m.name} {m.flavor}: "
            f"{str(err).removeprefix('model: ')}; pick a flavor it can compute, or set "
            "checkpoint.last_save_in_hf = false (the DCP checkpoint is saved either way)"
        ) from err


def _with_checkpoint_epsilons(args: Any, checkpoint: Any, differences: list[str], folder: Path) -> Any:
    """`args` with the norm epsilons of the checkpoint's args, said in one line."""
    taken = {name: getattr(checkpoint, name) for name in _EPSILON_ARGS if hasattr(args, name)}
    logger.info(
        "config: the Hugging Face checkpoint in %s differs from the flavor only in its norm epsilon (%s); "
        "the run takes the checkpoint's",
        folder,
        "; ".join(differences),
    )
    return replace(args, **taken)


def hf_export_files(config: JobConfig, bos_id: int, eos_id: int) -> dict[str, bytes | Path]:
    """`generation_config.json` and the tokenizer files of `model.hf_assets_path`, for an export folder."""
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}
    files: dict[str, bytes | Path] = {"generation_config.json": json.dumps(generation, indent=2).encode()}
    assets = Path(config.model.hf_assets_path) if config.model.hf_assets_path else None
    if assets is None:
        assets = BUNDLED_TOKENIZER
    for name in TOKENIZER_FILES:
        if (assets / name).is_file():
            files[name] = assets / name
    return files
