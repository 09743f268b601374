"""Atomic, resumable, reshardable checkpoints on torch.distributed.checkpoint."""

from titan_ckpt.async_save import ASYNC_MODES, SaveTiming
from titan_ckpt.checkpointer import Checkpointer
from titan_ckpt.errors import CheckpointError
from titan_ckpt.frozen_base import FrozenBase
from titan_ckpt.hf_safetensors import (
    TITAN_ONLY_PREFIX,
    TITAN_WEIGHT_MAP,
    HasKeptDtypes,
    HasUnheldState,
    HFStateDictAdapter,
    unheld_state,
)
from titan_ckpt.load_source import LoadResult
from titan_ckpt.policies import EXPORT_DTYPES, LastSavePolicy, LoadPolicy, SavePolicy
from titan_ckpt.stateful import ModelState, OptimizerState
from titan_ckpt.step_folders import complete_steps

__all__ = [
    "ASYNC_MODES",
    "EXPORT_DTYPES",
    "FrozenBase",
    "CheckpointError",
    "Checkpointer",
    "HFStateDictAdapter",
    "HasKeptDtypes",
    "HasUnheldState",
    "LastSavePolicy",
    "LoadPolicy",
    "LoadResult",
    "ModelState",
    "OptimizerState",
    "SavePolicy",
    "SaveTiming",
    "TITAN_ONLY_PREFIX",
    "TITAN_WEIGHT_MAP",
    "complete_steps",
    "unheld_state",
]
