"""Fully sharded data parallel (FSDP2), and HSDP on a 2-D mesh, applied block by block."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titan_parallel.errors import ModelDescriptionError, ParallelConfigError
from titan_parallel.options import RESHARD_POLICIES
from titan_parallel.protocols import HasParallelBlocks


def apply_fsdp(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool | str = "default",
    cpu_offload: bool = False,
    pp_enabled: bool = False,
) -> nn.Module:
    """Shard each block, then the root (embeddings, norm, output), over `mesh` with `fully_shard`.

    A 1-D mesh shards (FSDP); a 2-D (dp_replicate, dp_shard) mesh replicates over the first dim and
    shards over the second (HSDP). Wrapping blocks separately lets FSDP all-gather one block's
    parameters while the previous one computes, and free them right after.

    `reshard_after_forward`: a bool, or "default" (reshard, except under pipeline parallelism where
    each microbatch would all-gather again), "always", "never".
    """
    reshard = resolve_reshard_after_forward(reshard_after_forward, pp_enabled)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Without a GPU there is no pinned memory to offload into.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for block in blocks.values():
        fully_shard(
            block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard, offload_policy=offload
        )
    # The root is used last in forward and first in backward: keeping it unsharded saves an all-gather.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=offload)
    return model


def resolve_reshard_after_forward(policy: bool | str, pp_enabled: bool) -> bool:
    """The bool `fully_shard` takes, from a bool or a torchtitan policy name."""
    if isinstance(policy, bool):
        return policy
    if policy not in RESHARD_POLICIES:
        raise ParallelConfigError(
            f"parallelism: reshard_after_forward={policy!r} is unknown; choose one of {list(RESHARD_POLICIES)}"
        )
    return {"default": not pp_enabled, "always": True, "never": False}[policy]


def blocks_of(model: nn.Module) -> dict[str, nn.Module]:
    """The repeated blocks a model declares through `parallel_blocks()`, with a clear error if none."""
    if not isinstance(model, HasParallelBlocks):
        raise ModelDescriptionError(
            f"{type(model).__name__} does not describe its blocks: give it a parallel_blocks() method "
            "returning {fully-qualified name: block module}"
        )
    return model.parallel_blocks()
