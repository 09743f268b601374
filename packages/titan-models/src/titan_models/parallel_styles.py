"""Two tensor-parallel styles torch does not ship, which the decoder families' plans use.

`ReplicatedParams` keeps a module whole on every rank (small latents, routers, shared experts) while
its parameters still become DTensors, so optimizers and checkpoints see one kind of parameter. `SumGradients` adds up a gradient each rank holds only part of.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class ReplicatedParams(ParallelStyle):
    """Every rank holds the whole module (parameters as replicated DTensors) and computes it on its
    whole input; inputs and outputs stay plain tensors, and gradients arriving at the output must be
    the same on every rank.
    """

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
