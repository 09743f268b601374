"""Gradient-norm clipping over parameters that may be sharded (FSDP, TP) or split (PP)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    pp_mesh: DeviceMesh | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before clipping.

    DTensor gradients yield a DTensor norm over their mesh, which `full_tensor()` reduces; pipeline
    stages hold disjoint parameters, so their partial norms are combined across `pp_mesh`.
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite=False, foreach=foreach)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_mesh is not None:
        if norm_type == float("inf"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        else:
            total = total**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
            total = total ** (1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=foreach)
    return total
