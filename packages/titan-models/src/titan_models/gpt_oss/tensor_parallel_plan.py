"""Tensor-parallel plan entries gpt-oss adds to the shared decoder plan: its per-head sinks.

q/k/v are split by output column with their biases (each rank holds whole heads, `gqa_tp_entries`),
`wo` by input row with its bias added once after the reduction (the shared plan). Each rank's heads
need their own sink logits: `sinks` (heads,) is sharded on dim 0 alike. The style wraps the one the
shared plan gives the attention module (gathering the sequence-split input), since a plan names each
module once.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.tensor_parallel_plan import gqa_tp_entries


class HeadShardedSinks(ParallelStyle):
    """Shard the module's `sinks` by head (Shard(0)), then apply `inner` (if any) to the module."""

    def __init__(self, inner: ParallelStyle | None = None):
        super().__init__()
        self.inner = inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = distribute_tensor(module.sinks, device_mesh, [Shard(0)])
        module.register_parameter("sinks", nn.Parameter(sinks, requires_grad=module.sinks.requires_grad))
        return self.inner._apply(module, device_mesh) if self.inner is not None else module


def gpt_oss_attention_tp_entries() -> dict[str, ParallelStyle]:
    """q/k/v split by head with their biases; the sinks by head (wrapped into the attention's entry by
    `GptOssModel.tp_plan`)."""
    return gqa_tp_entries()
