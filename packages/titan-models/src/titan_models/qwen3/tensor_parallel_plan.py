"""Tensor-parallel plan entries Qwen3 adds to the shared decoder plan: its per-head QK norms.

Per-head query/key norms see only the heads of their rank: marked as split on the head dimension
(dim 2), their replicated weights get gradients summed over the ranks, as torchtitan does.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel


def qk_norm_tp_entries() -> dict[str, ParallelStyle]:
    """The per-head norms of queries and keys, whose inputs are split by head."""
    return {
        f"layers.*.attention.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
        for norm in ("q_norm", "k_norm")
    }
