"""DeepSeek-V3's tensor-parallel entries for its multi-head latent attention.

Each rank holds whole heads: the per-head projections (`wq` or `wq_b`, `wkv_b`) are split by output
column (`wo` by input row, in the shared `titan_models.tensor_parallel_plan.decoder_tp_plan`). The
low-rank latents (`wq_a`, `q_norm`, `wkv_a`, `kv_norm`) are small and feed every head, so each rank
computes them in full (`ReplicatedParams`). Their gradients arrive whole through the column-split
projections, except the shared rotary key, which each rank uses for its own heads only:
`SumGradients` on `attention.shared_rope_key` adds those partial gradients over the ranks.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

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
