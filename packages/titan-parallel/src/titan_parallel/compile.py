"""torch.compile applied block by block."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from titan_parallel.errors import ParallelConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Compile:
    """torch.compile of each block: torchtitan's `[compile]` section as it applies to the model."""

    enabled: bool = False
    backend: str = "inductor"

    def __post_init__(self) -> None:
        if not self.backend:
            raise ParallelConfigError("parallelism: compile.backend is empty; name a torch.compile backend")

    def apply(
        self,
        model: nn.Module,
        blocks: dict[str, nn.Module],
        *,
        moe_layers: dict[str, nn.Module] | None = None,
    ) -> nn.Module:
        """Compile `blocks` in place when enabled (after TP and checkpointing, before FSDP); see `apply_compile`."""
        if not self.enabled:
            return model
        return apply_compile(model, blocks, backend=self.backend, moe_layers=moe_layers)


def apply_compile(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    *,
    backend: str = "inductor",
    fullgraph: bool = True,
    moe_layers: dict[str, nn.Module] | None = None,
) -> nn.Module:
    """Compile each block in place (after TP and checkpointing, before FSDP).

    Per block rather than the whole model: the blocks share one code object, so dynamo compiles it
    once and reuses it, and FSDP's per-block hooks stay outside the graphs. `nn.Module.compile`
    keeps parameter names unchanged (no `_orig_mod.` prefix), so checkpoints do not depend on it.

    A block holding one of `moe_layers` is not compiled whole: routing sizes depend on the data, and
    expert parallelism's all-to-all and the experts' own FSDP hooks run inside. Its largest
    submodules without an MoE layer are compiled instead, and inside an MoE layer every child but
    `experts` (the router and the shared experts); the MoE layer's own sorting runs eagerly.
    """
    layers = (moe_layers or {}).values()
    opaque, experts = {id(m) for m in layers}, {id(layer.experts) for layer in layers}
    for block in blocks.values():
        if any(id(m) in opaque for m in block.modules()):
            _compile_around(block, opaque, experts, backend, fullgraph)
        else:
            block.compile(backend=backend, fullgraph=fullgraph)
    logger.info("compiled %d blocks with %s", len(blocks), backend)
    return model


def _compile_around(
    module: nn.Module, opaque: set[int], experts: set[int], backend: str, fullgraph: bool
) -> None:
    """Compile the children of `module` that hold no MoE layer; look inside those that do; skip experts."""
    for child in module.children():
        if id(child) in experts:
            continue
        if any(id(m) in opaque for m in child.modules()):
            _compile_around(child, opaque, experts, backend, fullgraph)
        else:
            child.compile(backend=backend, fullgraph=fullgraph)
