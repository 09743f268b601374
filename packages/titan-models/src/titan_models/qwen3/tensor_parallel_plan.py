"""Tensor-parallel plan entries Qwen3 and Llama 4 add to Llama's (`titan_models.llama_tp_plan`).

Per-head query/key norms (Qwen3's QK norm) see only the heads of their rank: marked as split on the
head dimension (dim 2), their replicated weights get gradients summed over the ranks, as torchtitan
does. Every tp rank runs the whole MoE layer on the whole sequence, as DeepSeek-V3's plan does with the
same styles; the routed experts are not named: the trainer's expert-parallel plan splits them.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInputOutput, SequenceParallel

from titan_models.deepseek_v3.tensor_parallel_plan import ReplicatedParams


def qk_norm_tp_entries() -> dict[str, ParallelStyle]:
    """The per-head norms of queries and keys, whose inputs are split by head."""
    return {
        f"layers.*.attention.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
        for norm in ("q_norm", "k_norm")
    }


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
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
        )
    return entries
