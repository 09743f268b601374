"""Tensor-parallel plan entries for MoE layers, the same in every family.

MoE layers are not split across tensor-parallel ranks (that is expert parallelism's job): every rank
runs the whole MoE on the whole sequence, its parameters replicated DTensors.
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
        "layers.*.moe.experts": ReplicatedParams(convert_io=False),
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
