"""Hugging Face checkpoints in and out: the model shape a run uses, and the files an export carries.

Import: weights load by shape, so a checkpoint whose rotary scaling, rope theta or tied embeddings
differ from the flavor would train another function without a word. Its `config.json` is therefore
compared with the flavor before any work, and every differing field is named; a checkpoint that
differs only in its norm epsilon lends the run its own, with one log line. The flavor `from_hf`
takes the shape from that `config.json` instead.

Export: a drop-in for the folder the run started from. Besides the weights (in the base's dtype unless
`checkpoint.export_dtype` names one) and `config.json` (keeping the base's token ids, an `eos_token_id`
list included), the folder gets the base's `generation_config.json`, the tokenizer files of
`model.hf_assets_path` and the chat template the run trained with, so `AutoModelForCausalLM`,
`AutoTokenizer` (with `apply_chat_template`) and `generate` use it as they used the base.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from titan_ckpt import unheld_state
from titan_models.errors import ModelError
from titan_train.config.schema import JobConfig
from titan_train.errors import ConfigError
from titan_train.family_args import moe_args_of, norm_epsilon_fields
from titan_train.registry import FROM_HF, ModelFamily
from titan_train.wiring.data import BUNDLED_TOKENIZER

HF_CONFIG = "config.json"
logger = logging.getLogger(__name__)
# Files of a Hugging Face tokenizer folder that AutoTokenizer reads (those present are copied).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",  # BPE tokenizers' slow files, which some folders ship beside tokenizer.json
    "merges.txt",
    "tiktoken.model",  # tiktoken BPE ranks read by the tokenizer code that tokenizer_config.json's auto_map names
)
CHAT_TEMPLATE = "chat_template.jinja"  # where transformers 5 writes a tokenizer's chat template
GENERATION_CONFIG = "generation_config.json"
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
AUTO_DTYPE = "auto"  # checkpoint.export_dtype: the base's dtype
EXPORT_DTYPES = ("float16", "bfloat16", "float32")


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
        taken = _with_checkpoint_epsilons(args, hf_map, hf) if differences else None
        if taken is not None:
            logger.info(
                "config: the Hugging Face checkpoint in %s differs from the flavor only in its norm epsilon (%s); "
                "the run takes the checkpoint's",
                folder,
                "; ".join(differences),
            )
            args = taken
        elif differences:
            raise ConfigError(
                f"config: the Hugging Face checkpoint in {folder} is not {m.name} {m.flavor}: "
                f"{'; '.join(differences)}; set model.flavor = '{FROM_HF}' to train the checkpoint's own shape, "
                "or pick the flavor it was trained as"
            )
    return args


def hf_export_problems(config: JobConfig, family: ModelFamily, args: Any) -> list[str]:
    """For the plan's check: a `last_save_in_hf` export the Hugging Face class cannot compute, or one that
    would drop trained state without `checkpoint.hf_export_lossy` (refused where it changes nothing; without
    an export at all, by config/run_checks.py)."""
    c, m = config.checkpoint, config.model
    if not c.last_save_in_hf:
        return []
    adapter = hf_mapping(family, "checkpoint.last_save_in_hf writes Hugging Face files").adapter(args)
    unheld = unheld_state(adapter)
    # The expert bias is the only such state today; the run trains it unless balancing is off (a flavor's
    # default, or model.moe_load_balance_coeff = 0). A bias loaded nonzero and never trained is caught
    # by the export itself, which reads the values.
    moe = moe_args_of(args)
    trained = unheld and moe is not None and moe.update_bias
    if trained and not c.hf_export_lossy:
        return [
            f"config: checkpoint.last_save_in_hf: {m.name} {m.flavor} trains {', '.join(unheld)} (auxiliary-loss-free "
            "balancing), which its Hugging Face format cannot hold, so the exported model would route tokens to "
            "other experts; set checkpoint.hf_export_lossy = true to export anyway (Titan keeps it under titan.* "
            "keys for its own re-import), or model.moe_load_balance_coeff = 0 to train without it"
        ]
    if c.hf_export_lossy and not unheld:
        return [
            f"config: checkpoint.hf_export_lossy is set but {m.name} {m.flavor} has no state its Hugging Face "
            "format cannot hold, so it would be ignored; drop it"
        ]
    try:
        adapter.hf_config()
    except ModelError as err:
        return [
            f"config: checkpoint.last_save_in_hf cannot export {m.name} {m.flavor}: "
            f"{str(err).removeprefix('model: ')}; pick a flavor it can compute, or set "
            "checkpoint.last_save_in_hf = false (the DCP checkpoint is saved either way)"
        ]
    return []


def _with_checkpoint_epsilons(args: Any, hf_map: Any, hf: dict) -> Any | None:
    """`args` with the checkpoint's norm epsilons (the fields the family's args name, `norm_epsilon_fields`)
    where those are all it differs in, else None. Published configs state their own epsilon (1e-6 in a
    published MLA checkpoint against torchtitan's flavor's 1e-5), which moves the function by rounding,
    not its shape: a run takes it instead of refusing."""
    try:
        checkpoint = hf_map.args_from_config(hf)
    except (ModelError, ConfigError):
        return None  # a shape Titan cannot read is no epsilon difference: the caller names the differences
    taken = replace(args, **{name: getattr(checkpoint, name) for name in norm_epsilon_fields(args)})
    return None if hf_map.config_differences(taken, hf) else taken


def export_base_folder(config: JobConfig) -> Path | None:
    """The Hugging Face folder an export descends from: the one the run loaded its weights from, else
    `model.hf_assets_path` (None with neither)."""
    folder = hf_checkpoint_folder(config)
    if folder is None and config.model.hf_assets_path:
        folder = Path(config.model.hf_assets_path)
    return folder


def _base_config(config: JobConfig) -> dict:
    """The base folder's config.json, or {} where there is none (a run from the bundled tokenizer)."""
    folder = export_base_folder(config)
    if folder is None or not (folder / HF_CONFIG).is_file():
        return {}
    return _read_hf_config(folder, "the Hugging Face export keeps the base's token ids and dtype")


def export_dtype(config: JobConfig) -> str:
    """`checkpoint.export_dtype`, with `auto` read as the dtype the base's config.json states (transformers
    5 writes `dtype`, older versions `torch_dtype`), else float32 (the training dtype)."""
    chosen = config.checkpoint.export_dtype
    if chosen != AUTO_DTYPE:
        return chosen
    base = _base_config(config)
    stated = base.get("dtype") or base.get("torch_dtype")
    return stated if stated in EXPORT_DTYPES else "float32"


def export_token_ids(config: JobConfig) -> dict[str, Any]:
    """The token ids an export's config.json keeps from the base's (an `eos_token_id` list stays a list:
    transformers' `generate` stops at any of them)."""
    base = _base_config(config)
    return {k: base[k] for k in TOKEN_ID_KEYS if base.get(k) is not None}


def hf_export_files(config: JobConfig, bos_id: int, eos_id: int) -> dict[str, bytes | Path]:
    """The files beside an export's weights: the base's `generation_config.json` (else one with the
    base's or the tokenizer's token ids), the tokenizer files of `model.hf_assets_path` (or the bundled
    tokenizer) and the chat template the run trained with (`sft.chat_template`, else the tokenizer's), so
    transformers, PEFT and vLLM load the folder as it is."""
    files: dict[str, bytes | Path] = tokenizer_files(config)
    base = export_base_folder(config)
    if base is not None and (base / GENERATION_CONFIG).is_file():
        files[GENERATION_CONFIG] = base / GENERATION_CONFIG
    else:
        generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, **export_token_ids(config)}
        generation["do_sample"] = False
        files[GENERATION_CONFIG] = json.dumps(generation, indent=2).encode()
    return files


def tokenizer_files(config: JobConfig) -> dict[str, bytes | Path]:
    """The tokenizer files and the chat template of the run, by name in an export (or PEFT) folder."""
    assets = Path(config.model.hf_assets_path) if config.model.hf_assets_path else BUNDLED_TOKENIZER
    names = (*TOKENIZER_FILES, *_auto_map_code(assets))
    files: dict[str, bytes | Path] = {name: assets / name for name in names if (assets / name).is_file()}
    if config.sft.chat_template:
        files[CHAT_TEMPLATE] = Path(config.sft.chat_template)
    elif (assets / CHAT_TEMPLATE).is_file():
        files[CHAT_TEMPLATE] = assets / CHAT_TEMPLATE
    return files


def _auto_map_code(assets: Path) -> list[str]:
    """The tokenizer code files `tokenizer_config.json`'s auto_map names ("module.Class" -> module.py), which
    transformers imports with trust_remote_code: an export without them cannot load its tokenizer."""
    config = assets / "tokenizer_config.json"
    if not config.is_file():
        return []
    refs = json.loads(config.read_text()).get("auto_map") or {}
    flat = [r for v in refs.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
    return sorted({ref.rsplit(".", 1)[0] + ".py" for ref in flat if "." in ref})
