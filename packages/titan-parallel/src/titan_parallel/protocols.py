"""What titan-parallel needs to know about a model, as a structural type.

titan-parallel never imports a model class. A model (from titan-models or any other codebase)
describes itself through plain data and torch types; these protocols document that shape.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class HasParallelBlocks(Protocol):
    """A model whose repeated blocks can be wrapped one by one (FSDP units, checkpointing, compile)."""

    def parallel_blocks(self) -> dict[str, nn.Module]:
        """The repeated blocks, keyed by their fully-qualified names in the model."""
        ...
