"""DeepSeek-V3's tensor-parallel plan: attention heads and dense feed-forwards split Megatron-style.

Each rank holds whole heads: the per-head projections (`wq` or `wq_b`, `wkv_b`) are split by output
column, `wo` by input row. The low-rank latents (`wq_a`, `q_norm`, `wkv_a`, `kv_norm`) are small and
feed every head, so each rank computes them in full (`ReplicatedParams`). Their gradients arrive whole
through the column-split projections, except the shared rotary key, which each rank uses for its own
heads only: `SumGradients` on `attention.shared_rope_key` adds those partial gradients over the ranks.
MoE experts are left to expert parallelism (not named); the router and shared experts stay replicated.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)


class ReplicatedParams(ParallelStyle):
    """Every rank holds the whole module (parameters as replicated DTensors) and computes it on its
    whole input; inputs and outputs stay plain tensors, and gradients arriving at the output must be
    the same on every rank.

    `convert_io=False` leaves inputs and outputs alone, for a module that computes with its
    parameters' local tensors itself (the routed experts).
    """

    def __init__(self, convert_io: bool = True):
        super().__init__()
        self.convert_io = convert_io

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def to_dtensor(mod, inputs, mesh):
            # The attention's input arrives as a replicated DTensor (PrepareModuleInput), the router's plain.
            return tuple(
                t.redistribute(mesh, [Replicate()])
                if isinstance(t, DTensor)
                else DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                if isinstance(t, torch.Tensor)
                else t
                for t in inputs
            )

        if not self.convert_io:
            return distribute_module(module, device_mesh, replicate)
        return distribute_module(
            module,
            device_mesh,
            replicate,
            input_fn=to_dtensor,
            output_fn=lambda mod, out, mesh: out.to_local(),
        )


class SumGradients(ParallelStyle):
    """Identity forward; backward sums the output's gradient over the ranks (each holds a partial one)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def sum_grad(mod, out, mesh):
            return DTensor.from_local(out, mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()]
            )

        return distribute_module(module, device_mesh, output_fn=sum_grad)


def deepseek_tp_plan(
    *, low_rank_q: bool, sequence_parallel: bool = True, loss_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """Module FQN ("*" for any block) -> style, for `parallelize_module(model, tp_mesh, plan)`.

    Keys of dense-only modules (`feed_forward.*`) match only the dense blocks.
    """
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
        "layers.*.attention.wkv_a": ReplicatedParams(),
        "layers.*.attention.kv_norm": ReplicatedParams(),
        "layers.*.attention.wkv_b": ColwiseParallel(),
        "layers.*.attention.shared_rope_key": SumGradients(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=residual),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=residual),
        # Every rank runs the whole MoE on the whole sequence; the routed experts are split by the
        # trainer's expert-parallel plan (titan_parallel.apply_expert_parallel), so not named here.
        "layers.*.moe.router.gate": ReplicatedParams(),
        "layers.*.moe.shared_experts": ReplicatedParams(),
    }
    if low_rank_q:
        plan |= {
            "layers.*.attention.wq_a": ReplicatedParams(),
            "layers.*.attention.q_norm": ReplicatedParams(),
            "layers.*.attention.wq_b": ColwiseParallel(),
        }
    else:
        plan["layers.*.attention.wq"] = ColwiseParallel()
    if sequence_parallel:
        plan |= {
            "norm": SequenceParallel(),
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.ffn_norm": SequenceParallel(),
            "layers.*.attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "layers.*.feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "layers.*.moe": PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,  # the MoE routes plain tensors
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
            ),
        }
    return plan
