"""How the ranks agree: one decides and tells the others, and a failure on any rank fails them all.

A rank that raises while the others enter a collective leaves them waiting until a timeout; every
check that can fail on some ranks only is therefore shared before anyone acts on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from titan_ckpt.errors import CheckpointError


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def raise_on_every_rank(problem: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise a CheckpointError on every rank if any rank has a `problem` (the first one found)."""
    problems = [problem]
    if _distributed(group):
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    found = next((p for p in problems if p), None)
    if found:
        raise CheckpointError(found)


def decide_on_rank0(decide: Callable[[], Any], group: dist.ProcessGroup | None) -> Any:
    """Run `decide()` on rank 0 and hand its result, or its CheckpointError, to every rank."""
    box: list[Any] = [None]
    if group_rank(group) == 0:
        try:
            box = [decide()]
        except CheckpointError as err:
            box = [err]
    if _distributed(group):
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(box[0], CheckpointError):
        raise CheckpointError(str(box[0]))
    return box[0]
