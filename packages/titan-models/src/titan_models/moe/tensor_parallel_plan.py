"""Tensor-parallel plan entries for MoE layers, the same in every family.

Every tensor-parallel rank runs the whole MoE layer on the whole sequence: the router and shared experts
are replicated DTensors; the routed experts are not named, since titan-parallel's expert-parallel plan
(`apply_expert_parallel`, which also splits them over tp when etp = tp) places them.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInputOutput

from titan_models.parallel_styles import ReplicatedParams


def moe_tp_entries(*, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Every MoE layer replicated on the tensor-parallel ranks, fed the whole sequence."""
    entries: dict[str, ParallelStyle] = {
        "layers.*.moe.router.gate": ReplicatedParams(),
        "layers.*.moe.shared_experts": ReplicatedParams(),
    }
    if sequence_parallel:
        entries["layers.*.moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,  # the MoE routes plain tensors
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
        )
    return entries
