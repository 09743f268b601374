"""Fully sharded data parallel (FSDP2), and HSDP on a 2-D mesh, applied block by block."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from titan_parallel.errors import ModelDescriptionError, ParallelConfigError, check_choice
from titan_parallel.protocols import HasParallelBlocks

RESHARD_POLICIES = ("default", "always", "never")


@dataclass(frozen=True)
class DataParallelOptions:
    """How FSDP2/HSDP (and, for the dtypes, DDP) hold and reduce parameters: torchtitan's
    `[training] mixed_precision_param/reduce, enable_cpu_offload` and `[parallelism] fsdp_reshard_after_forward`.

    `reshard_after_forward`: "default" (reshard unless pipelining), "always" or "never".
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: str = "default"
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        check_choice("data_parallel.reshard_after_forward", self.reshard_after_forward, RESHARD_POLICIES)


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
    experts: dict[str, nn.Module] | None = None,
    experts_mesh: DeviceMesh | None = None,
    experts_gradient_divide_factor: int | None = None,
) -> nn.Module:
    """Shard each block, then the root (embeddings, norm, output), over `mesh` with `fully_shard`.

    A 1-D mesh shards (FSDP); a 2-D (dp_replicate, dp_shard) mesh replicates over the first dim and
    shards over the second (HSDP). Wrapping blocks separately lets FSDP all-gather one block's
    parameters while the previous one computes, and free them right after.

    `reshard_after_forward`: a bool, or "default" (reshard, except under pipeline parallelism where
    each microbatch would all-gather again), "always", "never".

    `experts` (expert-parallel experts modules, from `apply_expert_parallel`) become FSDP units of
    their own over `experts_mesh` (ParallelDims.submesh("experts_fsdp")), before the blocks that
    hold them, with their gradients divided by `experts_gradient_divide_factor`
    (ParallelDims.expert_gradient_divide_factor).
    """
    mp_policy, offload = _policies(param_dtype, reduce_dtype, cpu_offload)
    reshard = resolve_reshard_after_forward(reshard_after_forward, pp_enabled)
    if experts:
        if experts_mesh is None or experts_gradient_divide_factor is None:
            raise ParallelConfigError(
                "parallelism: FSDP of expert-parallel experts needs experts_mesh and experts_gradient_divide_factor "
                "(ParallelDims.submesh('experts_fsdp') and .expert_gradient_divide_factor)"
            )
        for module in experts.values():
            shard_experts(module, experts_mesh, experts_gradient_divide_factor, mp_policy, reshard, offload)
    for block in blocks.values():
        fully_shard(
            block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard, offload_policy=offload
        )
    # The root is used last in forward and first in backward: keeping it unsharded saves an all-gather.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=offload)
    return model


def _policies(
    param_dtype: torch.dtype, reduce_dtype: torch.dtype, cpu_offload: bool
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Without a GPU there is no pinned memory to offload into.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    return mp_policy, offload


def apply_experts_fsdp(
    experts: dict[str, nn.Module],
    mesh: DeviceMesh,
    divide_factor: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool | str = "default",
    cpu_offload: bool = False,
    pp_enabled: bool = False,
) -> None:
    """FSDP units for expert-parallel experts alone, where the dense parameters are not sharded."""
    mp_policy, offload = _policies(param_dtype, reduce_dtype, cpu_offload)
    reshard = resolve_reshard_after_forward(reshard_after_forward, pp_enabled)
    for module in experts.values():
        shard_experts(module, mesh, divide_factor, mp_policy, reshard, offload)


def shard_experts(
    experts: nn.Module,
    mesh: DeviceMesh,
    divide_factor: int,
    mp_policy: MixedPrecisionPolicy,
    reshard: bool,
    offload: OffloadPolicy,
) -> None:
    """One FSDP unit for an experts module already sharded over ep: shard it further over `mesh`.

    Its own unit, even on a mesh of one rank, so the block's FSDP (over the dense mesh) leaves
    these DTensors alone. Its gradient arrives summed over its ep group, so FSDP divides by the
    number of ranks that see different tokens instead of by its mesh size.
    """
    weight = next(experts.parameters())
    local_experts = weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0]
    # With more FSDP ranks than local experts, sharding dim 0 would leave ranks holding padding.
    placement = (lambda _param: Shard(1)) if mesh.shape[-1] > local_experts else None
    fully_shard(
        experts,
        mesh=mesh,
        mp_policy=mp_policy,
        reshard_after_forward=reshard,
        offload_policy=offload,
        shard_placement_fn=placement,
    )
    experts.set_gradient_divide_factor(float(divide_factor))
    # A custom factor is a pre-multiplied sum (PREMUL_SUM), which gloo lacks: sum, then divide. On a
    # reduce-scatter group of one rank torch divides already (and would divide twice when forced).
    if mesh.shape[-1] > 1 and mesh.device_type == "cpu":
        experts.set_force_sum_reduction_for_comms(True)


def resolve_reshard_after_forward(policy: bool | str, pp_enabled: bool) -> bool:
    """The bool `fully_shard` takes, from a bool or a torchtitan policy name."""
    if isinstance(policy, bool):
        return policy
    check_choice("reshard_after_forward", policy, RESHARD_POLICIES)
    return {"default": not pp_enabled, "always": True, "never": False}[policy]


def blocks_of(model: nn.Module) -> dict[str, nn.Module]:
    """The repeated blocks a model declares through `parallel_blocks()`, with a clear error if none."""
    if not isinstance(model, HasParallelBlocks):
        raise ModelDescriptionError(
            f"{type(model).__name__} does not describe its blocks: give it a parallel_blocks() method "
            "returning {fully-qualified name: block module}"
        )
    return model.parallel_blocks()
