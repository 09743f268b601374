"""torch.compile applied block by block."""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)


def apply_compile(
    model: nn.Module, blocks: dict[str, nn.Module], *, backend: str = "inductor", fullgraph: bool = True
) -> nn.Module:
    """Compile each block in place (after TP and checkpointing, before FSDP).

    Per block rather than the whole model: the blocks share one code object, so dynamo compiles it
    once and reuses it, and FSDP's per-block hooks stay outside the graphs. `nn.Module.compile`
    keeps parameter names unchanged (no `_orig_mod.` prefix), so checkpoints do not depend on it.
    """
    for block in blocks.values():
        block.compile(backend=backend, fullgraph=fullgraph)
    logger.info("compiled %d blocks with %s", len(blocks), backend)
    return model
