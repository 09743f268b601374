"""The trainer's checkpointing: the `[checkpoint]` section mapped onto titan-ckpt's Checkpointer.

Switches that would be silently ignored were refused before the run started
(`titan_train.config.run_checks.check_checkpoint_config`).

At start, the run adapts to the checkpoint it resumes rather than refusing it: with
`training.dataloader.num_streams` unset, the saved number of data streams is adopted (so a run
resumes on another number of ranks with default settings), and a finished run started again with
more steps continues from its last step, its learning-rate schedule rebuilt for the new total. Both
are said in the log.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_ckpt import (
    Checkpointer,
    FrozenBase,
    HFStateDictAdapter,
    LastSavePolicy,
    LoadPolicy,
    LoadResult,
    SavePolicy,
    unheld_state,
)
from titan_parallel import moe_layers_of, plain_name
from titan_train.config.schema import JobConfig
from titan_train.errors import ConfigError
from titan_train.fault_tolerance.checkpoints import GroupCheckpointer, data_position_folder
from titan_train.fault_tolerance.replica_group import ReplicaGroup
from titan_train.registry import FROM_HF, ModelFamily
from titan_train.run_plan import RunPlan
from titan_train.train_state import TrainState
from titan_train.wiring.data import build_tokenizer_for
from titan_train.wiring.hf_interop import (
    export_dtype,
    export_token_ids,
    hf_checkpoint_folder,
    hf_export_files,
    hf_mapping,
)
from titan_train.wiring.hf_unheld import BiasEffect
from titan_train.wiring.lora import lora_enabled
from titan_train.wiring.lora_export import LoRAStateDictAdapter

logger = logging.getLogger(__name__)


def hf_adapter_for(
    family: ModelFamily, model_args: Any, *, bos_id: int | None = None, eos_id: int | None = None
) -> HFStateDictAdapter:
    """The family's Hugging Face weight mapping of a model built from `model_args` (titan-ckpt takes
    it as it is: it knows no model)."""
    return hf_mapping(family, "Hugging Face weights are read or written").adapter(
        model_args, bos_id=bos_id, eos_id=eos_id
    )


def _hf_export(plan: RunPlan, model_args: Any) -> tuple[HFStateDictAdapter | None, dict]:
    """The weight mapping, with the tokenizer's bos/eos, and the files a Hugging Face export carries."""
    config, c = plan.config, plan.config.checkpoint
    if not (c.initial_load_in_hf or c.last_save_in_hf):
        return None, {}
    if not c.last_save_in_hf:
        return hf_adapter_for(plan.family, model_args), {}
    tokenizer = build_tokenizer_for(config)
    adapter = hf_adapter_for(plan.family, model_args, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    return adapter, hf_export_files(config, tokenizer.bos_id, tokenizer.eos_id)


def build_checkpointer(
    plan: RunPlan, states: dict[str, Any], *, model_args: Any, replicas: ReplicaGroup | None = None
) -> Checkpointer | GroupCheckpointer | None:
    """The run's Checkpointer (None when checkpoint.enable is false); `states` as titan-ckpt takes them,
    `model_args` those the model was built from (for Hugging Face weights, mapped by the plan's
    family). Under torchft (`replicas`), the groups' shared layout (`GroupCheckpointer`). The settings
    passed `check_run` (titan_train.config.run_checks)."""
    config = plan.config
    c = config.checkpoint
    if not c.enable:
        return None
    hf_folder = hf_checkpoint_folder(config)
    initial_load_path = c.initial_load_path or hf_folder
    if hf_folder is not None and not c.initial_load_path:
        logger.info(
            "checkpoint: initial_load_in_hf with no initial_load_path: using model.hf_assets_path %s",
            initial_load_path,
        )
    hf_adapter, hf_files = _hf_export(plan, model_args)
    if hf_adapter is not None and lora_enabled(config):
        hf_adapter = _with_adapters(hf_adapter, plan, states)
    unheld_effect = None
    if hf_adapter is not None and c.last_save_in_hf and unheld_state(hf_adapter):
        unheld_effect = _bias_effect(states["model"].model_parts)
    folder = Path(config.job.dump_folder) / c.folder
    saving = SavePolicy(
        interval=c.interval,
        keep_latest_k=c.keep_latest_k,
        async_mode=c.async_mode,
        enable_first_step_checkpoint=c.enable_first_step_checkpoint,
        load_only=c.load_only,
    )
    full = Checkpointer(
        folder,
        states,
        shared_folder=replicas is not None,
        saving=saving,
        loading=LoadPolicy(
            load_step=c.load_step,
            initial_load_path=initial_load_path,
            initial_load_model_only=c.initial_load_model_only,
            initial_load_in_hf=c.initial_load_in_hf,
            initial_load_in_hf_quantized=c.initial_load_in_hf_quantized,
            # Under torchft each group's data position is its own, beside the full checkpoint.
            exclude_from_loading=[*c.exclude_from_loading, *(["dataloader"] if replicas is not None else [])],
        ),
        last_save=LastSavePolicy(
            model_only=c.last_save_model_only,
            in_hf=c.last_save_in_hf,
            export_dtype=export_dtype(config),
            hf_extra_files=hf_files,
            hf_config_keys=export_token_ids(config) if c.last_save_in_hf else {},
            max_shard_bytes=c.hf_max_shard_bytes,
            hf_lossy=c.hf_export_lossy,
        ),
        hf_adapter=hf_adapter,
        hf_unheld_effect=unheld_effect,
        frozen_base=_frozen_base(plan, states) if lora_enabled(config) else None,
    )
    if replicas is None:
        return full
    positions = data_position_folder(folder, config.fault_tolerance.replica_id)
    return GroupCheckpointer(
        full,
        Checkpointer(positions, {"dataloader": states["dataloader"]}, saving=saving),
        replicas.writes_checkpoints,
    )


def _bias_effect(model_parts: list) -> BiasEffect:
    """The share of each training batch's routings the expert bias changes, counted on the MoE layers that
    have one: the export's warning (or refusal) says how much the Hugging Face model, which has no place
    for the bias, would route elsewhere."""
    layers = {f"{i}.{fqn}": m for i, part in enumerate(model_parts) for fqn, m in moe_layers_of(part).items()}
    return BiasEffect({fqn: m for fqn, m in layers.items() if m.expert_bias is not None})


def _frozen_base(plan: RunPlan, states: dict[str, Any]) -> FrozenBase:
    """A LoRA run's frozen weights (by state-dict name) and what builds them without an initial load: the
    model's arguments, dtype and initialisation seed."""
    config = plan.config
    frozen: set[str] = set()
    for part in states["model"].model_parts:
        frozen.update(plain_name(n) for n, p in part.named_parameters() if not p.requires_grad)
    seed = plan.seed
    digest = hashlib.sha256(repr((plan.model_args, config.training.dtype)).encode()).hexdigest()[:12]
    origin = (
        f"{config.model.name} {config.model.flavor} initialised with seed {seed} (model arguments {digest})"
    )
    return FrozenBase(frozenset(frozen), origin, trainable_only_saves=config.lora.save_adapter_only)


def _with_adapters(base: HFStateDictAdapter, plan: RunPlan, states: dict[str, Any]) -> HFStateDictAdapter:
    """The mapping of a LoRA run: merged weights out, the base in with the adapters' initial values."""
    shapes = {
        name: tuple(t.shape)
        for name, t in states["model"].state_dict().items()
        if name.endswith((".lora_A.weight", ".lora_B.weight"))
    }
    return LoRAStateDictAdapter(base, scale=plan.options.lora.scale, adapter_shapes=shapes, seed=plan.seed)


@dataclass(frozen=True)
class FoundCheckpoint:
    """What a run found to start from, before anything is loaded: the checkpointer's load plan, and the
    number of data streams its data position was saved with where that differs from this run's loader
    and `training.dataloader.num_streams` is unset (None otherwise). The trainer decides what to do
    with it (a loader with the saved number of streams), then calls `load_found`."""

    plan: LoadResult
    saved_streams: int | None = None


def write_seed_checkpoint(checkpointer: Checkpointer) -> None:
    """`checkpoint.create_seed_checkpoint`: the initial weights as step 0, then the run stops."""
    checkpointer.save(0, model_only=True, wait=True)
    logger.info("checkpoint: seed checkpoint written to %s; exiting", checkpointer.step_folder(0))


def find_checkpoint(checkpointer: Checkpointer, config: JobConfig) -> FoundCheckpoint:
    """What the run would resume or start from, as found on disk; nothing is loaded or changed."""
    plan = checkpointer.plan_load()
    if plan.kind == "fresh" and config.model.flavor == FROM_HF:
        raise ConfigError(
            f"config: model.flavor = '{FROM_HF}', but {checkpointer.folder} holds no checkpoint and nothing "
            "else is loaded, so the Hugging Face shape would train from random weights; add "
            "--checkpoint.initial_load_in_hf to load the weights of model.hf_assets_path (or of "
            "checkpoint.initial_load_path), or name a flavor to train from scratch"
        )
    saved = _saved_streams(checkpointer, config, plan)
    if saved is None:
        return FoundCheckpoint(plan)
    default = checkpointer.states["dataloader"].packed.num_streams
    note = (
        f"data: {saved} streams, as saved (training.dataloader.num_streams is unset; {default} would be this "
        f"run's default); set it to {saved} to keep it so"
    )
    return FoundCheckpoint(plan.with_note(note), saved)


def load_found(checkpointer: Checkpointer, found: FoundCheckpoint, state: TrainState, steps: int) -> None:
    """Load what `find_checkpoint` found into the checkpointer's states and say where training goes on."""
    result = checkpointer.load(found.plan)
    if result.kind == "resumed" or (result.kind == "initial" and "train_state" in result.states):
        _say_where_training_continues(state, steps)


_STREAM_KEY = re.compile(r"^dataloader\.stream_(\d+)$")


def _saved_streams(checkpointer: Checkpointer, config: JobConfig, plan: LoadResult) -> int | None:
    """The number of streams a resumed data position was saved with, where num_streams is unset and it
    differs from this run's loader; else None."""
    if (
        "dataloader" not in plan.states
        or plan.hf
        or plan.path is None
        or config.training.dataloader.num_streams
    ):
        return None
    streams = [int(m.group(1)) for key in checkpointer.saved_keys(plan.path) if (m := _STREAM_KEY.match(key))]
    loader = checkpointer.states["dataloader"]
    default = getattr(getattr(loader, "packed", None), "num_streams", None)
    if not streams or default is None or max(streams) + 1 == default:
        return None
    return max(streams) + 1


def _say_where_training_continues(state: TrainState, steps: int) -> None:
    saved = state.saved_training_steps
    if state.step >= steps:
        logger.info("checkpoint: step %d is training.steps (%d): nothing left to train", state.step, steps)
    elif saved is not None and state.step == saved:
        logger.info(
            "checkpoint: extending the run: step-%d ended a %d-step run; training continues at step %d of %d "
            "with its optimizer and data stream, the learning-rate schedule rebuilt for %d steps",
            state.step,
            saved,
            state.step + 1,
            steps,
            steps,
        )
    else:
        logger.info("checkpoint: training continues at step %d of %d", state.step + 1, steps)
