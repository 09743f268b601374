"""Expert load counts summed over every rank that routes different tokens, so balancing acts as one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


@torch.no_grad()
def sum_tokens_per_expert(moe_layers: dict[str, nn.Module], mesh: DeviceMesh | None) -> torch.Tensor:
    """Replace each MoE layer's `tokens_per_expert` by its sum over `mesh`; return them stacked [layers, E].

    Pass `ParallelDims.submesh("dp_cp")`: the data-parallel and context-parallel ranks route
    different tokens, while tensor-parallel ranks route the same ones and pipeline stages hold
    different layers, so neither is summed over. One all-reduce covers every layer. Call it
    before the expert-bias update or a load-balancing loss reads the counts, and zero the counts
    after the update as one process would.
    """
    if not moe_layers:
        return torch.zeros(0)
    counts = torch.stack([layer.tokens_per_expert for layer in moe_layers.values()])
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=mesh.get_group())
        for layer, summed in zip(moe_layers.values(), counts, strict=True):
            layer.tokens_per_expert.copy_(summed)
    return counts
