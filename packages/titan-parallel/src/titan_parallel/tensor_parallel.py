"""Tensor parallelism (with sequence and loss parallelism) from a model's own plan."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from titan_parallel.errors import ModelDescriptionError, ParallelConfigError, UnsupportedDeviceError
from titan_parallel.protocols import HasTensorParallelPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallelOptions:
    """How tensor parallelism splits a model: torchtitan's `[parallelism]` TP switches.

    `sequence_parallel` shards norms and residuals along the sequence between the split layers;
    `loss_parallel` computes the loss on vocabulary-sharded logits; `async_tp` overlaps TP collectives
    with matmuls (CUDA and compiled blocks only).
    """

    sequence_parallel: bool = True
    loss_parallel: bool = True
    async_tp: bool = False

    def plan(self, model: nn.Module) -> dict[str, ParallelStyle]:
        """The model's own TP plan with these switches."""
        return tp_plan_of(model, sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel)


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: dict[str, ParallelStyle],
    *,
    async_tp: bool = False,
    compile_enabled: bool = False,
) -> nn.Module:
    """Split the modules named in `plan` across `tp_mesh`.

    Keys may hold "*" for one name segment; keys whose module is missing (dropped by a pipeline
    stage) are skipped, so one plan serves every stage. `async_tp` overlaps the TP collectives with
    matmuls through inductor's micro-pipelining, which needs CUDA and compiled blocks.
    """
    resolved = resolve_plan(model, plan)
    if not resolved:
        raise ParallelConfigError(
            f"parallelism: none of the tp_plan keys {sorted(plan)} names a module of {type(model).__name__}; "
            "give fully-qualified names as in model.named_modules()"
        )
    if async_tp:
        _enable_async_tp(tp_mesh, compile_enabled)
    shared = _shared_parameters(model)
    parallelize_module(model, tp_mesh, resolved)
    _retie(shared)
    logger.info("tensor parallel over %d ranks: %d modules split", tp_mesh.size(), len(resolved))
    return model


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Parameters that several modules hold (a tied embedding and output head), as (module, name) lists."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def _retie(shared: list[list[tuple[nn.Module, str]]]) -> None:
    """Make each shared parameter one parameter again after `parallelize_module`, which gives every module
    its own DTensor copy. The holders must split it alike (a tied embedding and output head both shard the
    vocabulary: Shard(0) of the same matrix), or a rank would hold different pieces under one name."""
    for (first, first_name), *others in shared:
        kept = getattr(first, first_name)
        for module, name in others:
            copy = getattr(module, name)
            if copy is kept:
                continue
            if not (
                isinstance(copy, DTensor)
                and isinstance(kept, DTensor)
                and (copy.device_mesh, copy.placements) == (kept.device_mesh, kept.placements)
            ):
                raise ParallelConfigError(
                    f"parallelism: a parameter shared by {type(first).__name__}.{first_name} and "
                    f"{type(module).__name__}.{name} is split differently by their tensor-parallel styles; "
                    "give both modules styles that shard it alike, or untie it"
                )
            module.register_parameter(name, kept)


def tp_plan_of(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan a model declares through `tp_plan()`, with a clear error if it has none."""
    if not isinstance(model, HasTensorParallelPlan):
        raise ModelDescriptionError(
            f"{type(model).__name__} has no tensor-parallel plan: give it a tp_plan(*, sequence_parallel, "
            "loss_parallel) method returning {fully-qualified name: ParallelStyle}"
        )
    return model.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def resolve_plan(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Expand "*" keys to the module names that exist, and drop keys naming no module."""
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        pattern = key.split(".")
        for name in names:
            parts = name.split(".")
            if len(parts) == len(pattern) and all(p in ("*", q) for p, q in zip(pattern, parts, strict=True)):
                resolved[name] = style
    return resolved


@contextlib.contextmanager
def loss_parallel_ctx(enabled: bool) -> Iterator[None]:
    """Run forward and backward of a loss on vocabulary-sharded logits without gathering them.

    Inside, `torch.nn.functional.cross_entropy` on a DTensor sharded on its last dim computes the
    softmax with collectives; the backward must run inside too.
    """
    with loss_parallel() if enabled else contextlib.nullcontext():
        yield


def _enable_async_tp(tp_mesh: DeviceMesh, compile_enabled: bool) -> None:
    if tp_mesh.device_type != "cuda" or not compile_enabled:
        raise UnsupportedDeviceError(
            f"parallelism: async_tp needs CUDA and compiled blocks (device {tp_mesh.device_type!r}, "
            f"compile={compile_enabled}); it fuses TP collectives into matmuls with symmetric memory. "
            "Set async_tp=False, or run on CUDA with compile=True"
        )
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
