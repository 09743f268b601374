"""What titan-parallel, and a trainer driving a parallel model, need to know about a model, as structural types.

titan-parallel never imports a model class. A model (from titan-models or any other codebase)
describes itself through plain data and torch types; these protocols document that shape. A model
implements only the methods for the parallelisms it is used with: FSDP, DDP, activation
checkpointing and compile need `parallel_blocks`; tensor parallelism needs `tp_plan`; pipeline
parallelism needs `pipeline_units`; context parallelism shards the `sequence_buffers` (and hands
an attention it cannot route through ring attention a `SequenceShard`, `set_sequence_shard`); expert
parallelism splits the experts of the `moe_layers`; LoRA's all-linear leaves out the
`linears_not_adapted`. A model is
built on the meta device, and `init_weights` gives it its values once parallelised (`TrainableModel`:
everything a trainer asks of a model beyond `nn.Module`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_parallel.sequence_shard import SequenceShard


@runtime_checkable
class HasParallelBlocks(Protocol):
    """A model whose repeated blocks can be wrapped one by one (FSDP units, checkpointing, compile)."""

    def parallel_blocks(self) -> dict[str, nn.Module]:
        """The repeated blocks, keyed by their fully-qualified names in the model (e.g. "layers.0")."""
        ...


@runtime_checkable
class HasTensorParallelPlan(Protocol):
    """A model that says how its linear layers split across tensor-parallel ranks."""

    def tp_plan(
        self, *, sequence_parallel: bool = True, loss_parallel: bool = True
    ) -> dict[str, ParallelStyle]:
        """FQN -> style, as `torch.distributed.tensor.parallel.parallelize_module` takes it.

        A "*" in a key stands for any one name segment (e.g. "layers.*.attention.wq"); keys whose
        module is absent (a pipeline stage that dropped it) are skipped. With `sequence_parallel`,
        activations between blocks are sharded on the sequence dimension (dim 1); with
        `loss_parallel`, the output head returns vocabulary-sharded logits as a DTensor, for a loss
        computed under `loss_parallel_ctx`.
        """
        ...


@runtime_checkable
class HasPipelineUnits(Protocol):
    """A model that can be cut into contiguous pipeline stages."""

    def pipeline_units(self) -> list[str]:
        """Top-level FQNs in forward order, e.g. ["tok_embeddings", "layers.0", ..., "norm", "output"].

        A stage keeps a contiguous run of units; the others are deleted from their
        `ModuleDict`/`ModuleList` or set to None, so `forward` must skip a unit that is None or
        absent (a `ModuleDict` keyed "0".."n-1" keeps parameter names stable across layouts).
        """
        ...


@runtime_checkable
class ParallelizableModel(HasParallelBlocks, HasTensorParallelPlan, HasPipelineUnits, Protocol):
    """A model that every parallelism in titan-parallel can be applied to."""


@runtime_checkable
class HasMoELayers(Protocol):
    """A model with mixture-of-experts layers, laid out as torchtitan 0.2.2's `MoE` is.

    Each MoE layer module has:

    - `experts`: a module whose only parameters are `w1` [E, hidden, dim], `w2` [E, dim, hidden]
      and `w3` [E, hidden, dim] (expert e computes `w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))`), or
      other stacked weights [E, ...] it names in `tp_split_dims` (weight name -> the dim of its
      hidden units, split over tp; None for one kept whole, such as an output bias, which the module
      must then add once to the sum of the tp ranks' partial outputs), and
      whose `forward(x: Tensor[T, dim], num_tokens_per_expert: LongTensor[E]) -> Tensor[T, dim]`
      takes the routed rows grouped by expert (the first `num_tokens_per_expert[0]` rows for
      expert 0, and so on) and returns one output row per input row, in the same order. Under
      expert or tensor parallelism the weights are DTensors and `forward` gets this rank's rows
      and local experts only: it must compute with `w.to_local()` where `w` is a DTensor and
      take E from `len(num_tokens_per_expert)`, never from a stored count.
    - `router`: the gate (replicated under tensor parallelism by the model's tp_plan).
    - `shared_experts`: a dense SwiGLU module or None.
    - buffers `expert_bias` [E] (routing bias for auxiliary-loss-free balancing, or None) and
      `tokens_per_expert` [E] (float32, tokens routed to each expert since it was last zeroed,
      counted on this rank; `titan_parallel.sum_tokens_per_expert` sums it over the ranks that
      see different tokens).

    Under tensor parallelism the model's tp_plan covers the MoE layer's input (all-gathered to
    Replicate), its output (declared `Partial` and reduce-scattered), the router and the shared
    experts; titan-parallel splits `experts` itself, so the plan must not name them. A MoE layer
    whose math needs the experts' outputs whole on every tp rank (one that weights them by the
    router's scores after the experts: a partial output would give the router a partial gradient)
    sets `tp_output_whole = True`: the experts' output is then all-reduced over tp, and the tp_plan
    declares the MoE output Replicate and keeps the router and shared experts replicated.
    """

    def moe_layers(self) -> dict[str, nn.Module]:
        """FQN -> MoE layer module (e.g. {"layers.1.moe": ...}); a pipeline stage lists only the ones it holds."""
        ...


@runtime_checkable
class HasHiddenMatrices(Protocol):
    """A model that names its hidden matrices: the weights Muon orthogonalises (`titan_parallel.muon`).

    Hidden matrices are the 2-D weights inside the repeated blocks (attention and feed-forward
    projections) and the stacked expert weights [E, out, in]; not the embedding, the output head,
    norms, biases or MoE routers, which an element-wise optimizer (AdamW) trains.
    """

    def hidden_matrices(self) -> dict[str, int]:
        """Parameter FQN (as `named_parameters()` spells it) -> how many leading dims stack matrices
        (0 for a [out, in] weight, 1 for experts [E, out, in]); a pipeline stage lists only its own."""
        ...


@runtime_checkable
class HasQueryKeyHeads(Protocol):
    """A model whose attention logits are q_h . k_g / sqrt(head_dim) of linear projections, so scaling a
    head's query and key rows scales its logits (QK-clip, `titan_parallel.qk_clip`): no norm or other
    transform after the projections that would undo the scale."""

    def record_max_logits(self, on: bool) -> None:
        """Start (or stop) keeping each attention's largest pre-softmax logit per query head, over the
        forward passes since its `max_logits` was last filled with -inf."""
        ...

    def query_key_heads(self) -> dict[str, tuple[nn.Parameter, nn.Parameter, torch.Tensor]]:
        """Attention FQN -> (query weight [heads * head_dim, dim], key weight [kv_heads * head_dim, dim],
        max_logits [heads], float32, kept while recording)."""
        ...


class LatentQueryKeyHeads(Protocol):
    """One multi-head latent attention (DeepSeek-V2/V3's MLA) as QK-clip scales it: head h's logit is
    softmax_scale * (q_nope_h . k_nope_h + q_pe_h . k_pe), with q_nope_h, q_pe_h rows of the query
    up-projection, k_nope_h rows of the key/value up-projection and k_pe one rotary key every head shares."""

    nope_dim: int
    rope_dim: int
    v_dim: int
    max_logits: torch.Tensor | None
    """[heads] float32, the largest whole logit per head while recording; None otherwise."""

    def query_key_up_projections(self) -> tuple[nn.Parameter, nn.Parameter]:
        """(query weight [heads * (nope_dim + rope_dim), in]: per head nope_dim q_nope rows then rope_dim
        q_pe rows; key/value weight [heads * (nope_dim + v_dim), latent]: per head k_nope rows then v rows)."""
        ...


@runtime_checkable
class HasLatentQueryKeyHeads(Protocol):
    """A model with multi-head latent attention whose head-specific query and key parts are rows of
    linear up-projections (QK-clip for MLA, `titan_parallel.qk_clip.clip_latent_query_key`)."""

    def record_max_logits(self, on: bool) -> None:
        """Start (or stop) keeping each attention's largest pre-softmax logit per query head."""
        ...

    def latent_query_key_heads(self) -> dict[str, LatentQueryKeyHeads]:
        """Attention FQN -> that attention."""
        ...


@runtime_checkable
class HasSequenceBuffers(Protocol):
    """A model holding buffers indexed by sequence position, which context parallelism shards as it
    shards the batch."""

    def sequence_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """Each buffer with its sequence dimension, e.g. `[(rotary_table, 0)]`; `[]` if there are none.

        The buffers themselves, not copies: context parallelism replaces their contents for the step.
        """
        ...


@runtime_checkable
class HasShardedSequenceAttention(Protocol):
    """A model whose attention context parallelism's ring cannot compute (learned sinks, sliding windows):
    it attends over keys and values gathered from the whole group, with masks from global positions."""

    def set_sequence_shard(self, shard: SequenceShard | None) -> None:
        """Attend through `shard` (`titan_parallel.sequence_shard.SequenceShard`: the group, the global
        positions of this rank's tokens, a differentiable gather) until called again with None."""
        ...


@runtime_checkable
class HasGatheredSequenceAttention(Protocol):
    """A model that can attend over a sequence dealt per row (`titan_parallel.gathered_context_parallel`):
    its rotary angles follow the dealt positions and its mask their documents, so context parallelism
    splits packed documents and ptrr's blocks."""

    def set_gathered_sequence(self, shard: SequenceShard | None) -> None:
        """Attend through `shard` (per-row positions (batch or 1, local length), `documents` or None, a
        differentiable gather) until called again with None."""
        ...


@runtime_checkable
class HasPackedDocuments(Protocol):
    """A model whose attention stays within the packed documents it finds in the token ids (block-causal):
    a pipeline stage without the embedding sees hidden states, not ids, and is given the documents."""

    def packed_document_ids(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """(batch, seq) document indices of `tokens`, or None when attention does not follow documents."""
        ...


@runtime_checkable
class HasLinearsNotAdapted(Protocol):
    """A model that names the linear layers LoRA's `all-linear` leaves out (`titan_parallel.lora`).

    They are layers whose low-rank update is no fine-tuning of a hidden map: the output head (as PEFT's
    all-linear leaves it out) and MoE routers. A model that does not say has every linear adapted.
    """

    def linears_not_adapted(self) -> tuple[str, ...]:
        """The last name segments (as `named_modules` spells them, e.g. "output", "gate") of those layers."""
        ...


@runtime_checkable
class HasInitWeights(Protocol):
    """A model that fills its parameters and buffers itself, after `to_empty` moved it off the meta device."""

    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None) -> None:
        """Initialise every parameter in place (sharded ones too) and rebuild buffers on `buffer_device`.

        The values depend on `seed` only, never on the parallel layout.
        """
        ...


@runtime_checkable
class TrainableModel(ParallelizableModel, HasSequenceBuffers, HasInitWeights, Protocol):
    """Everything a trainer asks of a model beyond `nn.Module`'s own API."""
