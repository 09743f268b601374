"""What titan-parallel needs to know about a model, as structural types.

titan-parallel never imports a model class. A model (from titan-models or any other codebase)
describes itself through plain data and torch types; these protocols document that shape. A model
implements only the methods for the parallelisms it is used with: FSDP, DDP, activation
checkpointing and compile need `parallel_blocks`; tensor parallelism needs `tp_plan`; pipeline
parallelism needs `pipeline_units`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle


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
