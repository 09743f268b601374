"""DeepSeek-V3's tensor-parallel entries for its multi-head latent attention.

Each rank holds whole heads: the per-head projections (`wq` or `wq_b`, `wkv_b`) are split by output
column (`wo` by input row, in the shared `titan_models.tensor_parallel_plan.decoder_tp_plan`). The
low-rank latents (`wq_a`, `q_norm`, `wkv_a`, `kv_norm`) are small and feed every head, so each rank
computes them in full (`ReplicatedParams`). Their gradients arrive whole through the column-split
projections, except the shared rotary key, which each rank uses for its own heads only:
`SumGradients` on `attention.shared_rope_key` adds those partial gradients over the ranks.

The multi-token-prediction depths (`mtp_tp_entries`) split their decoder block as the model's blocks
are split, and their norms as the model's final norm. The projection `eh_proj` (2d -> d) is split by
output column over the whole sequence and hands its output back split along the sequence, the layout
of the residual stream the depth's block takes; the shared output head is the model's own `output`
(vocabulary-sharded logits under loss parallelism, which the training forward concatenates along the
sequence, a dimension none of them is split on).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from titan_models.parallel_styles import ReplicatedParams, SumGradients


def mla_tp_entries(*, low_rank_q: bool) -> dict[str, ParallelStyle]:
    """Module FQN ("*" for any block) -> style for the latent attention's projections."""
    entries: dict[str, ParallelStyle] = {
        "layers.*.attention.wkv_a": ReplicatedParams(),
        "layers.*.attention.kv_norm": ReplicatedParams(),
        "layers.*.attention.wkv_b": ColwiseParallel(),
        "layers.*.attention.shared_rope_key": SumGradients(),
    }
    if low_rank_q:
        entries |= {
            "layers.*.attention.wq_a": ReplicatedParams(),
            "layers.*.attention.q_norm": ReplicatedParams(),
            "layers.*.attention.wq_b": ColwiseParallel(),
        }
    else:
        entries["layers.*.attention.wq"] = ColwiseParallel()
    return entries


def mtp_tp_entries(plan: dict[str, ParallelStyle], *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The MTP depths' entries, given the model's `plan`: each depth's block takes the blocks' entries
    ("layers.*.x" as "mtp.layers.*.block.x"); its norms and projection are split around it."""
    block = "layers.*."
    entries = {
        f"mtp.layers.*.block.{key[len(block) :]}": s for key, s in plan.items() if key.startswith(block)
    }
    residual = Shard(1) if sequence_parallel else Replicate()
    entries["mtp.layers.*.eh_proj"] = ColwiseParallel(input_layouts=residual, output_layouts=residual)
    if sequence_parallel:
        entries |= {f"mtp.layers.*.{norm}": SequenceParallel() for norm in ("enorm", "hnorm", "norm")}
    return entries
