"""This rank's part of a context-parallel sequence, for attention that torch's ring attention cannot compute.

Context parallelism routes `F.scaled_dot_product_attention(..., is_causal=True)` to ring attention. An
attention outside that (gpt-oss's learned sinks and sliding window) computes itself instead, over keys
and values gathered from every rank of the group: a model that implements `set_sequence_shard`
(`titan_parallel.protocols.HasShardedSequenceAttention`) is handed a `SequenceShard` for the step.

Why a gather rather than a ring: with the positions of every gathered key known, any mask a model
builds from global positions (causal, windowed, a sink in the softmax denominator) is exact, and the
gather's backward (a reduce-scatter, summing each rank's gradient for the keys it sent) is torch's
differentiable functional collective. Each rank then holds the keys and values of the whole sequence
and scores of (its queries) x (the whole sequence): 1/cp of one process's score memory, the same K/V
traffic as torch's "allgather" rotate method (hence the only method it accepts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import all_gather_tensor_autograd


@dataclass(frozen=True)
class SequenceShard:
    """The context-parallel group and the global positions of this rank's tokens.

    `positions` (long, this rank's sequence length) is sharded by the same call that shards the batch,
    so it holds whatever positions the load balancer dealt this rank (chunks i and 2*cp-1-i, one
    contiguous chunk, or ptrr's blocks), never a formula that could drift from it. Dealt per row
    (`titan_parallel.gathered_context_parallel`) it is (batch or 1, local length), and `documents`
    (batch, local length) numbers the packed document of each token (None: one causal sequence).
    """

    group: ProcessGroup
    positions: torch.Tensor
    documents: torch.Tensor | None = None

    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `tensor` concatenated along `dim` in rank order, differentiable (gradients summed
        back to the rank that sent each slice)."""
        return all_gather_tensor_autograd(tensor.contiguous(), gather_dim=dim, group=self.group)

    def all_positions(self) -> torch.Tensor:
        """The global position of each element of `gather(t, dim)` along `dim`."""
        return self.gather(self.positions, self.positions.ndim - 1)

    def all_documents(self) -> torch.Tensor | None:
        """The document of each element of `gather(t, dim)` along `dim` (batch, whole length), or None."""
        return None if self.documents is None else self.gather(self.documents, 1)
