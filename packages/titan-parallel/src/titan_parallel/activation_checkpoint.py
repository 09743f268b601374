"""Activation checkpointing of blocks: none, full, every N-th block, or per op keeping every other matmul output."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the all-to-all ops named below)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titan_parallel.errors import ParallelConfigError, check_choice

logger = logging.getLogger(__name__)

AC_MODES = ("none", "full", "selective", "memory_budget")

aten = torch.ops.aten

# Outputs worth keeping under per-op checkpointing: the matmuls and attention kernels that dominate
# recompute cost (flex attention is a higher-order op, seen by the policy as one), the TP reduce-scatters
# and expert-parallel all-to-alls (the autograd op and the plain one it runs, plus the token counts' one)
# so that recompute never repeats a collective, and the whole-tensor maxima float8 scales come from: a
# scalar each, where recomputing one reads the whole input again (torchtitan keeps them too).
_KEEP_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch._higher_order_ops.flex_attention,
    aten.max.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
}


@dataclass(frozen=True)
class ActivationCheckpointing:
    """Which block activations are recomputed in backward: torchtitan's `[activation_checkpoint]` section.

    `mode` "selective" with `selective="op"` keeps every other matmul output per op; an integer N (or
    its string form, as the config writes it) checkpoints every N-th block fully. `preserve_rng_state`,
    `determinism_check`, `early_stop` and `debug` are torch.utils.checkpoint's own switches, passed
    through as named there. `force_recompute_mm_fqns` (per-op mode): linear layers, named as inside a
    block, whose matmul outputs are recomputed rather than kept.

    `mode` "memory_budget" wraps no block: torch.compile's min-cut partitioner chooses what the compiled
    graphs save, keeping about `memory_budget` of the activations that saving everything would (0: recompute
    all it can, 1: recompute nothing it need not), while `compiler_settings()` is held over the run; with
    `pareto_dir` it also writes the runtime-against-memory curve of every budget there as SVG files.
    """

    mode: str = "none"
    selective: str | int = "op"
    preserve_rng_state: bool = False
    determinism_check: str = "default"
    early_stop: bool = False
    debug: bool = False
    force_recompute_mm_fqns: tuple[str, ...] = ()
    memory_budget: float = 1.0
    pareto_dir: str | None = None

    def __post_init__(self) -> None:
        check_choice("activation_checkpoint.mode", self.mode, AC_MODES)
        if not 0.0 <= self.memory_budget <= 1.0:
            raise ParallelConfigError(
                f"parallelism: activation_checkpoint.memory_budget must be in [0, 1], got {self.memory_budget}"
            )
        if self.mode != "selective":
            return
        every = self.selective
        if isinstance(every, str) and every != "op":
            if not every.isdigit():
                raise ParallelConfigError(
                    "parallelism: activation_checkpoint.selective must be 'op' or a positive integer, "
                    f"got {every!r}"
                )
            every = int(every)
        if isinstance(every, int) and every < 1:
            raise ParallelConfigError(
                f"parallelism: activation_checkpoint.selective must be >= 1, got {every}"
            )

    @property
    def selective_every(self) -> int | None:
        """N for "checkpoint every N-th block", or None for per-op selective checkpointing."""
        return None if self.selective == "op" else int(self.selective)

    def compiler_settings(self) -> contextlib.AbstractContextManager:
        """The partitioner settings the compiled graphs must be built under (mode "memory_budget"; nothing
        otherwise): hold it from the first forward until the run ends (graphs compile lazily)."""
        if self.mode != "memory_budget":
            return contextlib.nullcontext()
        import torch._functorch.config as functorch_config

        settings: dict[str, Any] = {"activation_memory_budget": self.memory_budget}
        if self.pareto_dir is not None:
            os.makedirs(self.pareto_dir, exist_ok=True)
            settings |= {"visualize_memory_budget_pareto": True, "memory_budget_pareto_dir": self.pareto_dir}
        logger.info("activation memory budget %.2f for torch.compile's partitioner", self.memory_budget)
        return functorch_config.patch(settings)

    def apply(self, model: nn.Module, blocks: dict[str, nn.Module]) -> nn.Module:
        """Checkpoint `blocks` of `model` in place as these settings say (after TP, before compile and FSDP)."""
        return apply_ac(
            model,
            blocks,
            mode=self.mode,
            selective=self.selective,
            force_recompute_mm_fqns=self.force_recompute_mm_fqns,
            checkpoint_kwargs={
                "preserve_rng_state": self.preserve_rng_state,
                "determinism_check": self.determinism_check,
                "early_stop": self.early_stop,
                "debug": self.debug,
            },
        )


def apply_ac(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    *,
    mode: str = "full",
    selective: str | int = "op",
    force_recompute_mm_fqns: tuple[str, ...] = (),
    checkpoint_kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """Recompute block activations in backward instead of storing them.

    `mode`: "none", "full" (keep only each block's inputs), or "selective": with `selective="op"`
    every block keeps attention outputs and every other matmul output (torchtitan's rule) and recomputes
    the rest; with an integer N, every N-th block is checkpointed fully and the others keep everything.
    `force_recompute_mm_fqns` (per-op mode): linear layers, named as inside a block (a name matches
    any module whose name contains it), whose matmul outputs are recomputed rather than kept; found
    by their weight shapes, as the policy sees only ops. `checkpoint_kwargs` go to
    `torch.utils.checkpoint.checkpoint` as they are (preserve_rng_state, determinism_check,
    early_stop, debug).

    The block's `forward` is wrapped in place rather than the block in a wrapper module, so
    parameter names (and so checkpoints) stay the same with and without checkpointing.
    """
    if mode not in AC_MODES:
        raise ParallelConfigError(f"parallelism: ac mode {mode!r} is unknown; choose one of {list(AC_MODES)}")
    if mode in ("none", "memory_budget"):  # memory_budget: the compiler's partitioner decides instead
        return model
    if mode == "full":
        chosen, context_fn = list(blocks.values()), None
    elif selective == "op":
        shapes = _recompute_shapes(blocks, force_recompute_mm_fqns)
        chosen, context_fn = list(blocks.values()), functools.partial(_per_op_contexts, shapes)
    else:
        every = int(selective)
        if every < 1:
            raise ParallelConfigError(
                f"parallelism: selective activation checkpointing every {every} blocks; use N >= 1"
            )
        chosen, context_fn = [b for i, b in enumerate(blocks.values()) if i % every == 0], None
    for block in chosen:
        block.forward = CheckpointedForward(block.forward, context_fn, dict(checkpoint_kwargs or {}))
    logger.info(
        "activation checkpointing %s (%s): %d of %d blocks", mode, selective, len(chosen), len(blocks)
    )
    return model


class CheckpointedForward:
    """A block's forward run under non-reentrant checkpointing, with the settings it was given.

    Replaces `block.forward` in place, so parameter names (and so checkpoints) stay the same with and
    without checkpointing. Non-reentrant: works with keyword inputs, DTensors, FSDP hooks and compile.
    """

    def __init__(self, forward: Callable, context_fn: Callable | None, kwargs: dict[str, Any]):
        self.forward, self.kwargs = forward, kwargs
        if context_fn is not None:
            self.kwargs["context_fn"] = context_fn
        functools.update_wrapper(self, forward)

    def __call__(self, *args, **inputs):
        return checkpoint(self.forward, *args, use_reentrant=False, **self.kwargs, **inputs)


def _recompute_shapes(blocks: dict[str, nn.Module], fqns: tuple[str, ...]) -> set[torch.Size]:
    """The (in, out) shapes of the weights of the linear layers named in `fqns`, as `mm` sees them."""
    shapes = set()
    for block in blocks.values():
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear) and any(fqn in name for fqn in fqns):
                shapes.add(torch.Size(module.weight.shape[::-1]))
    if fqns:
        logger.info(
            "per-op activation checkpointing recomputes matmuls of shape %s (%s)", sorted(shapes), fqns
        )
    return shapes


def _per_op_contexts(recompute_shapes: set[torch.Size]):
    """Per-op checkpointing for one block call: keep attention and reduce-scatter outputs and every other
    matmul's (the 1st, 3rd, ...; torchtitan's rule, so the same config holds the same memory), recompute
    the rest. Matmuls named for recomputation are recomputed and not counted. The count restarts with each
    call; forward and recompute count separately, and see the same matmuls in the same order."""
    counts = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is aten.mm.default:
            if args[1].shape in recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _KEEP_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    forward, recompute = create_selective_checkpoint_contexts(policy)
    if _tracing():  # compile tags the graph's ops instead of indexing them, and wants the modes as they are
        return forward, recompute
    return _with_hook_ops_uncounted(forward), _with_hook_ops_uncounted(recompute)


def _tracing() -> bool:
    """Whether the block is being traced by compile (AOTAutograd's proxy mode, as torch's checkpoint checks)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


# Namespaces of the ops FSDP's hooks run (profiler marks, all-gather copy-in/out, c10d collectives); not
# `_c10d_functional`, whose all-to-alls the policy keeps.
_HOOK_OP_NAMESPACES = frozenset({"profiler", "fsdp", "c10d"})


@contextlib.contextmanager
def _with_hook_ops_uncounted(sac_mode: TorchDispatchMode):
    """`sac_mode`, with the ops of FSDP hooks that fire inside the block run past it.

    torch's selective checkpointing indexes every op of the forward and looks each up again, by op and
    index, in the recompute. An expert-parallel experts module is an FSDP unit of its own inside the
    block, and its hooks run a different op sequence in the recompute: there it finds no forward root
    and claims it (one more `FSDP::root_pre_forward` profiler mark), and it finds its weights already
    all-gathered by the backward prefetch (no all-gather ops). Those ops hold no activation, so they
    bypass the checkpoint's bookkeeping and the indices of the ops that do stay aligned.
    """
    with sac_mode, _HookOpsPastCheckpoint():
        yield


class _HookOpsPastCheckpoint(TorchDispatchMode):
    """Entered right above a selective-checkpoint mode: FSDP hook ops skip it, all others go to it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) in _HOOK_OP_NAMESPACES:
            with _pop_mode_temporarily():  # the checkpoint's mode, right below this one
                return func(*args, **kwargs)
        return func(*args, **kwargs)
