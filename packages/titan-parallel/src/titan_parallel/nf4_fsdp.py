"""QLoRA's NF4 base under FSDP 2: a frozen weight that FSDP already shards, re-sharded as NF4.

Why after sharding, and why whole: Titan loads the base (initial load, resume) into the model FSDP has
already sharded, so the final values exist only as shards. Quantising each shard on its own is wrong:
torchao's NF4 keeps one mean of the block scales per tensor (`scaler_mean`), and its FSDP2 all-gather
(`fsdp_post_all_gather`) rebuilds the whole weight with the local shard's mean, so shards quantised
apart dequantise with another rank's mean. So each weight is gathered whole once (one weight at a
time: its full-precision copy is the only extra memory), quantised exactly as one process quantises
it, and handed to FSDP as torchtune hands it an NF4 weight before `fully_shard`: FSDP chunks it along
dim 0 (torchao's NF4 split) and from then on all-gathers the NF4 codes and scales (torchao's FSDP2
hooks), never the full-precision values. A shard must hold whole groups of NF4 blocks: dim 0 divides
by the shard count and each shard's size by 64 x the scaler block size (`nf4_shard_problem`).

Re-sharding an existing FSDP parameter has no public API in torch 2.15: this re-runs the two steps
`FSDPParam.__init__` takes for a new parameter (`_init_sharded_param`, `_init_extensions`), which
replace the module's parameter by the new sharded one. It must run before the first forward (FSDP's
lazy init), as the trainer's restore does. Those internals are torch 2.15's (2.11 takes other arguments), so
older torches are refused (`nf4_fsdp_torch_problem`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.torch_version import TorchVersion

from titan_parallel.errors import ParallelConfigError

NF4_FSDP_TORCH = (2, 15)  # the torch whose FSDP internals the re-sharding calls (and the layout tests ran on)


def nf4_fsdp_torch_problem(version: str | None = None) -> str | None:
    """Why an NF4 base cannot be sharded by FSDP on torch `version` (this one by default), or None."""
    version = version or torch.__version__
    if TorchVersion(version) >= NF4_FSDP_TORCH:
        return None
    floor = ".".join(map(str, NF4_FSDP_TORCH))
    return (
        f"qlora: an NF4 base under FSDP needs torch >= {floor} (this is torch {version}; Titan re-shards the "
        f"quantised weights through FSDP internals as {floor} has them); upgrade torch, or train QLoRA on one "
        "process"
    )


def nf4_shard_problem(name: str, shape: tuple[int, ...], shards: int, group_size: int) -> str | None:
    """Why a weight of `shape` cannot be split into `shards` NF4 shards (each whole groups of `group_size`
    values: 64 x the scaler block size), or None."""
    numel = math.prod(shape)
    if shape[0] % shards or (numel // shards) % group_size:
        return (
            f"qlora: {name}.weight {list(shape)} cannot be split into {shards} NF4 shards: its dim 0 must divide "
            f"by {shards} and each shard's values by {group_size} (64 x lora.nf4_scaler_block_size); choose a "
            "smaller nf4_scaler_block_size or fewer dp_shard ranks"
        )
    return None


def fsdp_params_by_weight(model: nn.Module) -> dict[tuple[int, str], object]:
    """FSDP's record of each parameter it manages in `model`, by (id of the owning module, parameter name)."""
    found = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            info = fsdp_param._module_info
            found[(id(info.module), info.param_name)] = fsdp_param
    return found


def quantize_sharded_weight(
    name: str, module: nn.Module, fsdp_param, quantize: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Replace `module.weight`, a frozen FSDP-sharded DTensor, by FSDP's shard of `quantize(whole weight)`."""
    weight = module.weight
    if not isinstance(weight, DTensor) or any(
        not (isinstance(p, Replicate) or p == Shard(0)) for p in weight.placements
    ):
        raise ParallelConfigError(
            f"qlora: {name}.weight is split as {getattr(weight, 'placements', None)}; an NF4 base under FSDP needs "
            "FSDP's dim-0 shards only (no tensor, context or expert parallelism)"
        )
    too_old = nf4_fsdp_torch_problem()
    if too_old:
        raise ParallelConfigError(too_old)
    # Resharding after forward onto the same mesh (a bool) keeps the shard sizes; onto another (an int) does not.
    if fsdp_param.fsdp_placement != Shard(0) or fsdp_param.post_forward_mesh_info not in (
        None,
        fsdp_param.mesh_info,
    ):
        raise ParallelConfigError(
            f"qlora: FSDP holds {name}.weight as {fsdp_param.fsdp_placement}, resharded after forward onto another "
            "mesh; an NF4 base needs FSDP's default dim-0 shards"
        )
    # A collective: every rank of the weight's mesh quantises the same values.
    whole = weight.full_tensor().to(fsdp_param.device)
    frozen = nn.Parameter(quantize(whole), requires_grad=False)
    del whole
    fsdp_param._init_sharded_param(frozen, fsdp_param.device, None, fsdp_param.mesh_info)
    fsdp_param._init_extensions()
