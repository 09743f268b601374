"""Replicated data parallel (DDP semantics) built on FSDP2's `replicate`."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy


def apply_ddp(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Keep a full copy of every parameter on each rank of `mesh` and all-reduce gradients.

    FSDP2's `replicate` rather than `DistributedDataParallel`: it composes with tensor-parallel
    DTensor parameters and pipeline schedules (which drive gradient sync of FSDP-style modules), and
    each block becomes its own all-reduce bucket, overlapping communication with backward.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks.values():
        replicate(block, mesh=mesh, mp_policy=mp_policy)
    replicate(model, mesh=mesh, mp_policy=mp_policy)
    return model
