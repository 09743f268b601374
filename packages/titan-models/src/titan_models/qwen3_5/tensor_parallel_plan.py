"""Tensor parallelism for Qwen3.5: both kinds of layer split by head, Megatron-style.

Full attention: `wq` (each head's query and gate together), `wk`, `wv` by output column, the per-head QK
norms marked as split on the head dimension (their replicated weights get gradients summed over the
ranks). Linear attention: `in_proj_qkv` by output column, whole head groups per rank since its rows are
grouped by key head (`qwen3_5.linear_attention`); `in_proj_z`, `in_proj_b`, `in_proj_a` alike; the
convolution's channels, `A_log` and `dt_bias` sharded on dim 0 to match; the per-head output norm like
the QK norms. `wo` of both splits by input row in the shared decoder plan.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from titan_models.errors import ModelConfigError
from titan_models.qwen3_5.linear_attention import GatedDeltaNet

HEAD_SHARDED = ("conv_weight", "A_log", "dt_bias")


class HeadShardedParameters(ParallelStyle):
    """Shard whichever of the module's `HEAD_SHARDED` parameters it has on dim 0, then apply `inner` (the
    shared plan's style for the attention module, if any), since a plan names each module once."""

    def __init__(self, inner: ParallelStyle | None = None):
        super().__init__()
        self.inner = inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        if isinstance(module, GatedDeltaNet) and module.key_heads % tp:
            # A rank must hold whole head groups; an uneven split would cut one.
            raise ModelConfigError(
                f"model: tensor_parallel_degree ({tp}) must divide linear_num_key_heads ({module.key_heads}) "
                "of qwen3_5's linear layers; pick a degree that divides it"
            )
        for name in HEAD_SHARDED:
            param = module._parameters.get(name)
            if param is not None:
                sharded = distribute_tensor(param, device_mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return self.inner._apply(module, device_mesh) if self.inner is not None else module


def qwen3_5_attention_tp_entries() -> dict[str, ParallelStyle]:
    """The projections of both kinds of layer split by output column, their per-head norms by head."""
    columns = ("wq", "wk", "wv", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    per_head = ("q_norm", "k_norm", "norm")
    return {f"layers.*.attention.{w}": ColwiseParallel() for w in columns} | {
        f"layers.*.attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True) for n in per_head
    }
