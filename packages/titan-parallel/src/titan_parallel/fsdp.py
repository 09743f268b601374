"""Fully sharded data parallel (FSDP2) applied block by block."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan_parallel.protocols import HasParallelBlocks


def apply_fsdp(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard each block, then the root (embeddings, norm, output), over `mesh` with `fully_shard`.

    Wrapping blocks separately lets FSDP all-gather one block's parameters while the previous one
    computes, and free them right after.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks.values():
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # The root is used last in forward and first in backward: keeping it unsharded saves an all-gather.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    return model


def blocks_of(model: nn.Module) -> dict[str, nn.Module]:
    """The repeated blocks a model declares through `parallel_blocks()`, with a clear error if none."""
    if not isinstance(model, HasParallelBlocks):
        raise TypeError(
            f"{type(model).__name__} does not describe its blocks: give it a parallel_blocks() method "
            "returning {fully-qualified name: block module}"
        )
    return model.parallel_blocks()
