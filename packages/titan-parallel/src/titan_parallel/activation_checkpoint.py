"""Activation checkpointing of blocks: none, full, every N-th block, or per op keeping matmul outputs."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titan_parallel.errors import ParallelConfigError
from titan_parallel.options import AC_MODES

logger = logging.getLogger(__name__)

aten = torch.ops.aten

# Outputs worth keeping under per-op checkpointing: the matmuls and attention kernels that dominate
# recompute cost, and TP reduce-scatters so that recompute never repeats a collective.
_KEEP_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def apply_ac(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    *,
    mode: str = "full",
    selective: str | int = "op",
) -> nn.Module:
    """Recompute block activations in backward instead of storing them.

    `mode`: "none", "full" (keep only each block's inputs), or "selective": with `selective="op"`
    every block keeps matmul and attention outputs and recomputes the cheap element-wise ops; with an
    integer N, every N-th block is checkpointed fully and the others keep everything.

    The block's `forward` is wrapped in place rather than the block in a wrapper module, so
    parameter names (and so checkpoints) stay the same with and without checkpointing.
    """
    if mode not in AC_MODES:
        raise ParallelConfigError(f"parallelism: ac mode {mode!r} is unknown; choose one of {list(AC_MODES)}")
    if mode == "none":
        return model
    if mode == "full":
        chosen, context_fn = list(blocks.values()), None
    elif selective == "op":
        chosen, context_fn = list(blocks.values()), _keep_matmuls_context
    else:
        every = int(selective)
        if every < 1:
            raise ParallelConfigError(
                f"parallelism: selective activation checkpointing every {every} blocks; use N >= 1"
            )
        chosen, context_fn = [b for i, b in enumerate(blocks.values()) if i % every == 0], None
    for block in chosen:
        _checkpoint_forward(block, context_fn)
    logger.info(
        "activation checkpointing %s (%s): %d of %d blocks", mode, selective, len(chosen), len(blocks)
    )
    return model


def _checkpoint_forward(block: nn.Module, context_fn: Callable | None) -> None:
    forward = block.forward
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}

    @functools.wraps(forward)
    def checkpointed(*args, **inputs):
        # Non-reentrant: works with keyword inputs, DTensors, FSDP hooks and torch.compile.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs, **inputs)

    block.forward = checkpointed


def _keep_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_matmuls_context():
    return create_selective_checkpoint_contexts(_keep_matmuls_policy)
