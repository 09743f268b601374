"""Tensor-parallel plan entries for MoE layers, the same in every family.

Every tensor-parallel rank routes the whole sequence (the MoE layer's input is all-gathered under
sequence parallelism) with a replicated router; the routed experts are not named, since titan-parallel's
expert-parallel plan (`apply_expert_parallel`) places them.

Where the routing allows it, as in torchtitan 0.2.2: a layer that weights its tokens by the router's
scores before the experts (`score_before_experts`, Llama 4's routing) splits its shared experts like a
dense feed-forward (w1, w3 column-wise, w2 row-wise), its routed experts' output stays a partial sum over
tp, and the layer's output is declared Partial and reduce-scattered (all-reduced without sequence
parallelism). A layer that weights the experts' outputs after them (DeepSeek-V2/V3 and Qwen3-MoE routing)
needs those outputs whole on every rank, else the router's gradient would be a partial sum
(`MoE.tp_output_whole`): its shared experts stay replicated and its output is whole.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
)

from titan_models.parallel_styles import ReplicatedParams


def moe_tp_entries(
    *, sequence_parallel: bool, split_shared_experts: bool, has_shared_experts: bool
) -> dict[str, ParallelStyle]:
    """The MoE layers' entries: split shared experts and a Partial output with `split_shared_experts`
    (score-before-experts routing), else shared experts replicated and a whole output."""
    entries: dict[str, ParallelStyle] = {"layers.*.moe.router.gate": ReplicatedParams()}
    output = Partial() if split_shared_experts else Replicate()
    if has_shared_experts and split_shared_experts:
        entries |= {
            "layers.*.moe.shared_experts.w1": ColwiseParallel(),
            "layers.*.moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
            "layers.*.moe.shared_experts.w3": ColwiseParallel(),
        }
    elif has_shared_experts:
        entries["layers.*.moe.shared_experts"] = ReplicatedParams()
    if sequence_parallel:
        entries["layers.*.moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,  # the MoE routes plain tensors
            output_layouts=(output,),
            desired_output_layouts=(Shard(1),),
        )
    elif split_shared_experts:
        entries["layers.*.moe"] = PrepareModuleOutput(
            output_layouts=(output,), desired_output_layouts=(Replicate(),)
        )
    return entries
