"""Map the config's parallelism sections onto titan-parallel, and split or wrap the model with them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from titan_parallel import (
    ActivationCheckpointing,
    Compile,
    ContextParallelOptions,
    DataParallelOptions,
    Float8Training,
    MXTraining,
    ParallelDims,
    ParallelOptions,
    Pipeline,
    PipelineOptions,
    TensorParallelOptions,
    build_pipeline,
    parallelize,
)
from titan_train.config import JobConfig
from titan_train.config.converters import FLOAT8_CONVERTERS, MX_CONVERTERS
from titan_train.wiring.lora import lora_options

logger = logging.getLogger(__name__)


def parallel_options(
    config: JobConfig, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> ParallelOptions:
    """The layout settings other than the degrees: each config section onto its titan-parallel group."""
    p, ac = config.parallelism, config.activation_checkpoint
    float8, mx = linear_conversions(config)
    if p.pipeline_parallel_schedule == "DualPipeV" and p.pipeline_parallel_expert_parallel_overlap:
        # torchtitan runs each paired forward and backward in two threads so that one's expert all-to-all
        # overlaps the other's compute; Titan runs them one after the other: the same numbers, no overlap.
        logger.warning(
            "parallelism.pipeline_parallel_expert_parallel_overlap = true: Titan runs DualPipeV's paired "
            "forward and backward one after the other (the same results, without the overlap)"
        )
    return ParallelOptions(
        data_parallel=DataParallelOptions(
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=p.fsdp_reshard_after_forward,
            cpu_offload=config.training.enable_cpu_offload,
        ),
        tensor_parallel=TensorParallelOptions(
            sequence_parallel=True,
            loss_parallel=not p.disable_loss_parallel,
            async_tp=p.enable_async_tensor_parallel,
        ),
        activation_checkpoint=ActivationCheckpointing(
            mode=ac.mode,
            selective=ac.selective_ac_option,
            preserve_rng_state=ac.preserve_rng_state,
            determinism_check=ac.determinism_check,
            early_stop=ac.early_stop,
            debug=ac.debug,
            force_recompute_mm_fqns=tuple(ac.per_op_sac_force_recompute_mm_shapes_by_fqns),
            memory_budget=ac.memory_budget if ac.mode == "memory_budget" else 1.0,
            pareto_dir=(
                str(Path(config.job.dump_folder) / "memory_budget_pareto")
                if ac.mode == "memory_budget" and ac.visualize_memory_budget_pareto
                else None
            ),
        ),
        compile=Compile(
            enabled=config.compile.enable and "model" in config.compile.components,
            backend=config.compile.backend,
        ),
        float8=float8,
        mx=mx,
        lora=lora_options(config),
        pipeline=PipelineOptions(
            schedule=p.pipeline_parallel_schedule,
            microbatch_size=p.pipeline_parallel_microbatch_size,
            layers_per_stage=p.pipeline_parallel_layers_per_stage,
            split_points=tuple(part[0] for part in (p.module_fqns_per_model_part or [])[1:] if part),
            first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
            last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
            schedule_csv=p.pipeline_parallel_schedule_csv or None,
        ),
        context_parallel=ContextParallelOptions(
            rotate_method=p.context_parallel_rotate_method,
            load_balancer=p.context_parallel_load_balancer,
        ),
    )


def linear_conversions(config: JobConfig) -> tuple[Float8Training | None, MXTraining | None]:
    """`[model] converters` with `[quantize.linear.float8]` or `[quantize.linear.mx]` (at most one, checked at
    start in config/model_rules.py)."""
    converters = config.model.converters
    float8 = mx = None
    if any(c in FLOAT8_CONVERTERS for c in converters):
        f = config.quantize.linear.float8
        float8 = Float8Training(
            recipe=f.recipe_name or "tensorwise",
            fsdp_all_gather=f.enable_fsdp_float8_all_gather,
            skip_fqns=tuple(dict.fromkeys(["output", *f.filter_fqns])),
            emulate=f.emulate,
        )
    if any(c in MX_CONVERTERS for c in converters):
        m = config.quantize.linear.mx
        mx = MXTraining(
            recipe=m.recipe_name,
            dim1_cast_kernel=m.mxfp8_dim1_cast_kernel_choice,
            skip_fqns=tuple(m.filter_fqns),
        )
    return float8, mx


@dataclass
class ModelParts:
    """What this rank trains: the model parts it holds and, under pipeline parallelism, the schedule."""

    parts: list[nn.Module]
    pipeline: Pipeline | None


def split_and_wrap(
    model: nn.Module,
    dims: ParallelDims,
    options: ParallelOptions,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    eval_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    local_batch_size: int,
) -> ModelParts:
    """Apply every enabled parallelism to a meta-device model; pipeline stages when pp > 1, training on
    `loss_fn` and evaluating with `eval_loss_fn`."""
    if dims.pp > 1:
        pipeline = build_pipeline(
            model,
            dims,
            options,
            loss_fn=loss_fn,
            eval_loss_fn=eval_loss_fn,
            device=device,
            local_batch_size=local_batch_size,
        )
        return ModelParts(pipeline.model_parts, pipeline)
    return ModelParts([parallelize(model, dims, options)], None)


def build_parallel_dims(config: JobConfig, world_size: int) -> ParallelDims:
    p = config.parallelism
    # Without expert parallelism the experts are split over tp whatever etp says, as in torchtitan 0.2.2,
    # whose own 17Bx16E MoE config sets etp = tp = 8 with ep = 1: that is the etp = 1 layout.
    etp = p.expert_tensor_parallel_degree
    if p.expert_parallel_degree == 1 and etp == p.tensor_parallel_degree:
        etp = 1
    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=etp,
        world_size=world_size,
    )
