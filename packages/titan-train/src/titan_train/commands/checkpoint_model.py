"""A trained model in one process, straight from a checkpoint folder, for generation and evaluation.

The folder is a DCP step folder that a run wrote at any layout (FSDP, TP, PP: DCP reshards it into
the one unsharded model here) or a Hugging Face safetensors folder. The run's config names the model
and the tokenizer; a Hugging Face folder's `config.json` must describe the same function, field by
field, or the load stops naming what differs.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from titan_ckpt import (
    TITAN_ONLY_PREFIX,
    TITAN_WEIGHT_MAP,
    Checkpointer,
    LoadPolicy,
    ModelState,
    SavePolicy,
    unheld_state,
)
from titan_ckpt.frozen_base import FROZEN_BASE_FILE
from titan_data import Tokenizer
from titan_parallel import adapter_names, dequantized, quantize_base_to_nf4
from titan_train.config import JobConfig
from titan_train.errors import ConfigError
from titan_train.plan import RunPlan, one_process_plan, with_positions
from titan_train.registry import FROM_HF
from titan_train.wiring.checkpointing import hf_adapter_for
from titan_train.wiring.data import build_tokenizer_for
from titan_train.wiring.hf_interop import hf_mapping
from titan_train.wiring.lora_export import LoRAStateDictAdapter
from titan_train.wiring.model import build_model
from titan_train.wiring.qlora import qlora_enabled

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


@dataclass
class CheckpointModel:
    """The model in eval mode, its tokenizer, the training step its weights come from (None if unknown),
    and the positions its rotary table covers (`max_seq_len`)."""

    model: nn.Module
    tokenizer: Tokenizer
    step: int | None
    path: Path
    device: torch.device
    max_seq_len: int
    hf: bool = False


def checkpoint_step(path: Path) -> int | None:
    """N for a folder named `step-N`, as Titan's checkpoints are."""
    match = _STEP_FOLDER.match(Path(path).name)
    return int(match.group(1)) if match else None


CHECKPOINT_FORMATS = ("auto", "dcp", "hf")


def _weights_format(path: Path, wanted: str) -> str:
    """ "dcp" or "hf": what `path` holds, DCP first when a final save holds both (an export beside it)."""
    if not path.is_dir():
        raise ConfigError(
            f"config: checkpoint {path} is not a folder; pass a step-N folder or a Hugging Face folder"
        )
    found = [
        name
        for name, present in (
            ("dcp", (path / ".metadata").is_file()),
            ("hf", (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors"))),
        )
        if present
    ]
    if wanted not in CHECKPOINT_FORMATS:
        raise ConfigError(
            f"config: checkpoint format '{wanted}' is not one of {', '.join(CHECKPOINT_FORMATS)}"
        )
    if wanted == "auto" and found:
        return found[0]
    if wanted in found:
        return wanted
    raise ConfigError(
        f"config: {path} holds no {'DCP checkpoint (.metadata)' if wanted == 'dcp' else 'Hugging Face safetensors'}"
        + (f" (it holds {found[0]})" if found else "")
        + "; pass a checkpoint/step-N folder written by titan-train, or a Hugging Face model folder"
    )


def _model_args(plan: RunPlan, path: Path, fmt: str, eos_id: int):
    """The model shape: the run's flavor (a Hugging Face config.json must agree with it field by field),
    or with model.flavor = from_hf the shape a Hugging Face folder's config.json states."""
    config, family = plan.config, plan.family
    config_file = path / "config.json"
    hf_config = json.loads(config_file.read_text()) if fmt == "hf" and config_file.is_file() else None
    # The run's args, as training resolved them: a model whose function depends on the positions it was
    # built for (YaRN's rotary scaling) computes here what it computed in training.
    run_args = replace(plan.model_args, eos_id=eos_id)
    if hf_config is None:
        return run_args
    hf = hf_mapping(family, f"{path} is a Hugging Face checkpoint")
    if config.model.flavor == FROM_HF:
        return hf.args_from_config(hf_config, eos_id=eos_id)
    args = run_args
    differences = hf.config_differences(args, hf_config)
    if differences:
        raise ConfigError(
            f"config: {config_file} describes another model than {config.model.name} {config.model.flavor}: "
            f"{'; '.join(differences)}; pass the run's config, or model.flavor = '{FROM_HF}' to use the folder's shape"
        )
    return args


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _warn_if_trained_state_is_missing(path: Path, adapter: Any, model: torch.nn.Module) -> None:
    """One line where a Hugging Face folder lacks Titan's copy of state its format cannot hold (a
    trained expert bias): the model then runs with it at zero, not as it was trained."""
    unheld = unheld_state(adapter)
    wanted = [k for k in model.state_dict() if unheld and k.endswith(unheld)]
    if not wanted:
        return
    index = path / "model.safetensors.index.json"
    if index.is_file():
        saved = set(json.loads(index.read_text()).get(TITAN_WEIGHT_MAP, {}))
    else:
        saved = set()
        for file in path.glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                saved |= set(f.keys())
    missing = [k for k in wanted if TITAN_ONLY_PREFIX + k not in saved]
    if missing:
        logger.warning(
            "checkpoint: %s holds no Titan copy of %s (%d tensors; its Hugging Face format has no place for "
            "them): the model runs with them at zero, which differs from the trained model if they were trained",
            path,
            ", ".join(unheld),
            len(missing),
        )


def _load_frozen_base(path: Path, model: nn.Module, plan: RunPlan, args: Any) -> None:
    """Read the base of an adapter-only step folder from the Hugging Face folder its `frozen_base.json`
    names (the adapters are read over it after); refuse, in one line, a base that cannot be read again."""
    record = json.loads((path / FROZEN_BASE_FILE).read_text())
    source = record.get("initial_load_path")
    if not (source and record.get("initial_load_in_hf")) or not Path(source).exists():
        where = f"from {source}" if source else f"from the run's own initialisation ({record.get('origin')})"
        raise ConfigError(
            f"checkpoint: {path} holds the trained adapters only; its frozen base came {where}, which generate and "
            "eval read only from a Hugging Face folder that still exists: use a step folder that holds the whole "
            "model (the run's last one)"
        )
    shapes = {
        n: tuple(t.shape)
        for n, t in model.state_dict().items()
        if n.endswith((".lora_A.weight", ".lora_B.weight"))
    }
    adapter = LoRAStateDictAdapter(
        hf_adapter_for(plan.family, args),
        scale=plan.options.lora.scale,
        adapter_shapes=shapes,
        seed=0,
    )
    base = Checkpointer(
        Path(source),
        {"model": ModelState([model])},
        saving=SavePolicy(interval=1, load_only=True),
        loading=LoadPolicy(
            initial_load_path=Path(source),
            initial_load_in_hf=True,
            initial_load_in_hf_quantized=bool(record.get("initial_load_in_hf_quantized")),
        ),
        hf_adapter=adapter,
    )
    found = base.plan_load()
    base.load(
        replace(found, message=f"{path} holds the adapters only: reading its frozen base from {source}")
    )
    base.close()
    if qlora_enabled(plan.config):  # the run trained over the NF4 base: its dequantised values
        quantize_base_to_nf4(model, plan.config.lora.nf4_scaler_block_size)
        for name in adapter_names(model):
            linear = model.get_submodule(name)
            linear.weight = nn.Parameter(dequantized(linear.weight), requires_grad=False)


def load_checkpoint_model(
    config: JobConfig,
    checkpoint: str | Path,
    *,
    device: torch.device | None = None,
    dtype: str = "float32",
    max_seq_len: int | None = None,
    weights: str = "auto",
) -> CheckpointModel:
    """The model that `config` describes, with the weights of `checkpoint`, on `device` in `dtype`.

    The rotary table covers `max_seq_len` positions (default: the flavor's context length). `weights`
    picks "dcp" or "hf" where a folder holds both; "auto" prefers DCP.
    """
    path = Path(checkpoint)
    fmt = _weights_format(path, weights)
    if dtype not in DTYPES:
        raise ConfigError(f"config: dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    device = torch.device(device) if device is not None else default_device()  # a name such as "cpu" too
    if config.experimental.custom_import:
        importlib.import_module(config.experimental.custom_import)  # may register flavors
    # A LoRA run's DCP checkpoint holds its adapters beside the base (its Hugging Face export is merged).
    plan = one_process_plan(config, device.type, adapters=fmt == "dcp")
    tokenizer = build_tokenizer_for(config)
    args = _model_args(plan, path, fmt, tokenizer.eos_id)
    args = with_positions(args, max_seq_len or args.context_len)
    # seed 0 fills the rotary table (and whatever the checkpoint lacks); the weights come from the checkpoint
    built = build_model(plan, device, eos_id=tokenizer.eos_id, seed=0, args=args)
    model, args = built.parts[0], built.args
    adapter = hf_adapter_for(plan.family, args) if fmt == "hf" else None
    checkpointer = Checkpointer(
        path,
        {"model": ModelState([model])},
        saving=SavePolicy(interval=1, load_only=True),
        loading=LoadPolicy(initial_load_path=path, initial_load_in_hf=fmt == "hf"),
        hf_adapter=adapter,
    )
    if fmt == "dcp" and (path / FROZEN_BASE_FILE).is_file():
        _load_frozen_base(path, model, plan, args)
    # The folder is the checkpoint itself, not a run's folder of step-N checkpoints: say what is loaded
    # instead of the run's "no checkpoint in X; loading initial weights from X".
    found = checkpointer.plan_load()
    what = "Hugging Face safetensors" if fmt == "hf" else "DCP checkpoint"
    checkpointer.load(replace(found, message=f"loading the model weights of {path} ({what})"))
    checkpointer.close()
    if adapter is not None:
        _warn_if_trained_state_is_missing(path, adapter, model)
    with torch.no_grad():  # parameters only: buffers (the rotary table) stay complex float32, as in training
        for param in model.parameters():
            param.data = param.data.to(DTYPES[dtype])
    model.eval()
    step = checkpoint_step(path)
    logger.info(
        "loaded %s %s from %s (%s, step %s) on %s in %s",
        config.model.name,
        config.model.flavor,
        path,
        fmt,
        "unknown" if step is None else step,
        device,
        dtype,
    )
    return CheckpointModel(model, tokenizer, step, path, device, args.max_seq_len, fmt == "hf")
