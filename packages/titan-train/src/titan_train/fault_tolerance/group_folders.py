"""Where a torchft replica group writes: torchtitan's launch gives every group the same job.dump_folder.

The checkpoints stay in that folder, shared (`titan_train.fault_tolerance.checkpoints`); the rest of a
group's outputs (metrics.jsonl, TensorBoard, config.json, traces, rollouts, state digests) go to
`dump_folder/replica_group_{replica_id}`, so that the groups, each with its own rank 0, do not write
over each other's files.
"""

from __future__ import annotations

from pathlib import Path

from titan_train.config.schema import JobConfig


def group_output_folder(dump_folder: str | Path, replica_id: int) -> Path:
    return Path(dump_folder) / f"replica_group_{replica_id}"


def separate_group_outputs(config: JobConfig) -> None:
    """Point `config` at this group's output folder, its checkpoint folder at the shared one (absolute)."""
    shared = Path(config.job.dump_folder).resolve()
    config.checkpoint.folder = str(shared / config.checkpoint.folder)
    config.job.dump_folder = str(group_output_folder(shared, config.fault_tolerance.replica_id))
