"""Atomic, resumable checkpoints on torch.distributed.checkpoint."""

from titan_ckpt.checkpointer import Checkpointer, complete_steps
from titan_ckpt.errors import CheckpointError
from titan_ckpt.stateful import ModelState, OptimizerState

__all__ = ["CheckpointError", "Checkpointer", "ModelState", "OptimizerState", "complete_steps"]
