"""The one call a trainer makes: every enabled parallelism, in the order they compose."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from titan_parallel.ddp import apply_ddp
from titan_parallel.errors import ParallelConfigError
from titan_parallel.expert_parallel import apply_expert_parallel, moe_layers_of
from titan_parallel.float8_tensor_parallel import float8_tp_plan
from titan_parallel.fsdp import apply_experts_fsdp, apply_fsdp, blocks_of
from titan_parallel.options import ParallelOptions
from titan_parallel.parallel_dims import ParallelDims
from titan_parallel.tensor_parallel import apply_tp, loss_parallel_ctx

logger = logging.getLogger(__name__)


def parallelize(model: nn.Module, dims: ParallelDims, options: ParallelOptions | None = None) -> nn.Module:
    """Apply float8 or MX -> TP/SP -> LoRA -> EP -> activation checkpointing -> compile -> FSDP/HSDP or DDP, in place.

    The order matters: float8 swaps linear layers before LoRA adapts them and before they are split (with tensorwise float8, the
    model's plain TP styles become torchao's float8 ones for those layers); LoRA's adapters follow the TP split of the
    layers they sit beside (`titan_parallel.lora`); TP turns parameters into
    DTensors that FSDP then shards along a second mesh dim; expert parallelism (for a model with
    `moe_layers()`) splits the experts after the model's tp_plan prepared the MoE layers around
    them, and with ep > 1 the experts become FSDP units of their own over the expert mesh;
    checkpointing and compile wrap the blocks before FSDP hooks onto them. Call `dims.build_mesh()` first. With pp > 1 use
    `build_pipeline`, which calls this on each stage. Works on a meta-device model; materialise
    and initialise the parameters afterwards.
    """
    options = options or ParallelOptions()
    blocks = blocks_of(model)
    for conversion in (options.float8, options.mx):
        if conversion is not None:
            conversion.convert(model, dims.mesh.device_type)
    tp_mesh = dims.submesh("tp")
    if tp_mesh is not None:
        tp = options.tensor_parallel
        plan = tp.plan(model)
        if options.float8 is not None and options.float8.recipe == "tensorwise":
            plan = float8_tp_plan(model, plan)  # float8 all-gathers for the float8 linears
        apply_tp(model, tp_mesh, plan, async_tp=tp.async_tp, compile_enabled=options.compile.enabled)
    if options.lora is not None:  # after TP: the adapters are placed beside the split weights
        options.lora.convert(model)
    experts = apply_expert_parallel(model, dims)
    expert_units = experts if dims.ep > 1 else {}
    options.activation_checkpoint.apply(model, blocks)
    options.compile.apply(model, blocks, moe_layers=moe_layers_of(model))
    dp = options.data_parallel
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            blocks,
            dims.submesh("fsdp"),
            param_dtype=dp.param_dtype,
            reduce_dtype=dp.reduce_dtype,
            reshard_after_forward=dp.reshard_after_forward,
            cpu_offload=dp.cpu_offload,
            pp_enabled=dims.pp > 1,
            experts=expert_units,
            experts_mesh=dims.submesh("experts_fsdp"),
            experts_gradient_divide_factor=dims.expert_gradient_divide_factor,
        )
        return _logged(model, dims, options)
    if expert_units:
        apply_experts_fsdp(
            expert_units,
            dims.submesh("experts_fsdp"),
            dims.expert_gradient_divide_factor,
            param_dtype=dp.param_dtype,
            reduce_dtype=dp.reduce_dtype,
            reshard_after_forward=dp.reshard_after_forward,
            cpu_offload=dp.cpu_offload,
            pp_enabled=dims.pp > 1,
        )
    if dims.ddp_enabled:
        if dp.cpu_offload:
            raise ParallelConfigError(
                "parallelism: cpu_offload needs sharded parameters (dp_shard > 1 or cp > 1); with pure "
                "replication (DDP) there is no shard to offload"
            )
        apply_ddp(
            model,
            blocks,
            dims.submesh("dp_replicate"),
            param_dtype=dp.param_dtype,
            reduce_dtype=dp.reduce_dtype,
        )
    return _logged(model, dims, options)


def _logged(model: nn.Module, dims: ParallelDims, options: ParallelOptions) -> nn.Module:
    logger.info("parallelized %s: %s", type(model).__name__, describe_layout(dims, options))
    return model


def describe_layout(dims: ParallelDims, options: ParallelOptions) -> str:
    """The degrees above 1 and what is switched on, in one short line (the whole options repr is ~900
    characters, most of it defaults)."""
    degrees = {name: d for name, d in dims.degrees.items() if d > 1}
    degrees |= {name: d for name, d in (("ep", dims.ep), ("etp", dims.etp)) if d > 1}
    dp = options.data_parallel
    on = [
        f"params {str(dp.param_dtype).removeprefix('torch.')}, reduce {str(dp.reduce_dtype).removeprefix('torch.')}"
    ]
    if dims.degrees.get("tp", 1) > 1:
        tp = options.tensor_parallel
        on += [
            name
            for name, flag in (
                ("sequence parallel", tp.sequence_parallel),
                ("loss parallel", tp.loss_parallel),
                ("async TP", tp.async_tp),
            )
            if flag
        ]
    if dims.degrees.get("cp", 1) > 1:
        on.append(f"cp {options.context_parallel.rotate_method}")
    if dims.degrees.get("pp", 1) > 1:
        on.append(f"pp {options.pipeline.schedule}")
    if options.activation_checkpoint.mode != "none":
        on.append(f"activation checkpointing {options.activation_checkpoint.mode}")
    if options.compile.enabled:
        on.append(f"compile ({options.compile.backend})")
    if dp.cpu_offload:
        on.append("cpu offload")
    if options.float8 is not None:
        on.append(f"float8 {options.float8.recipe}" + (" emulated" if options.float8.emulate else ""))
    if options.mx is not None:
        on.append(f"mx {options.mx.recipe}")
    return f"{', '.join(f'{k} {v}' for k, v in degrees.items()) or 'one rank'}; {', '.join(on)}"


@contextlib.contextmanager
def training_context(
    dims: ParallelDims,
    options: ParallelOptions | None = None,
    *,
    cp_buffers: Sequence[torch.Tensor] = (),
    cp_seq_dims: Sequence[int] = (),
    cp_no_restore: Sequence[torch.Tensor] = (),
    cp_models: Sequence[nn.Module] = (),
    cp_batch: Sequence[torch.Tensor] = (),
    cp_documents: torch.Tensor | None = None,
    context_parallel: bool = True,
) -> Iterator[None]:
    """Wrap forward and backward (or `Pipeline.step`) in loss parallelism and context parallelism as enabled.

    With cp > 1, `cp_buffers` must hold the batch (inputs, labels) and each position-dependent
    buffer of every model part, with their sequence dims in `cp_seq_dims`; tensors in
    `cp_no_restore` (typically the batch) are left sharded afterwards. `cp_models` (the model parts)
    lets a model whose attention ring attention cannot compute attend over the gathered sequence
    (`context_parallel_ctx`). With `cp_documents` (batch, seq: each token's packed document) or the ptrr
    load balancer, the (batch, seq, ...) tensors of `cp_batch` are dealt per row instead and the models
    attend over gathered keys (`titan_parallel.gathered_context_parallel`); no model buffer is sharded.
    `context_parallel=False`: loss parallelism only, for a caller that deals its sequences itself.
    """
    options = options or ParallelOptions()
    with contextlib.ExitStack() as stack:
        if dims.tp > 1 and options.tensor_parallel.loss_parallel:
            stack.enter_context(loss_parallel_ctx(True))
        if dims.cp > 1 and context_parallel:
            if not cp_buffers:
                raise ParallelConfigError(
                    f"parallelism: cp({dims.cp}) > 1 but no cp_buffers were given; pass the inputs, labels and "
                    "position buffers so each rank keeps its part of the sequence"
                )
            cp = options.context_parallel
            if cp.gathers(cp_documents):
                stack.enter_context(cp.gathered(dims.submesh("cp"), cp_batch, cp_documents, cp_models))
            else:
                stack.enter_context(
                    cp.sharding(
                        dims.submesh("cp"),
                        cp_buffers,
                        cp_seq_dims,
                        no_restore_buffers=set(cp_no_restore),
                        models=cp_models,
                    )
                )
        yield
