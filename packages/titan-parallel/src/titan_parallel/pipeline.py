"""Pipeline parallelism: stages on each rank, a schedule over microbatches, and the real loss."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _PipelineScheduleRuntime,
    get_schedule_class,
)
from torch.distributed.tensor import DTensor

from titan_parallel.errors import ParallelConfigError
from titan_parallel.fsdp import blocks_of
from titan_parallel.options import ParallelOptions
from titan_parallel.parallel_dims import ParallelDims
from titan_parallel.parallelize import parallelize
from titan_parallel.pipeline_options import PipelineOptions
from titan_parallel.pipeline_split import pipeline_units_of, split_units, stage_module

logger = logging.getLogger(__name__)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _MetadataInference:
    """Whether this rank's stages are inside the schedule's metadata inference (shared by its stages)."""

    running: bool = False


@dataclass
class Pipeline:
    """The stages this rank runs and the schedule that drives them.

    `model_parts` are the stage modules (for the optimizer, checkpointing, weight init and
    gradient clipping); `step` runs forward and backward over all microbatches, `evaluate` forward only.
    """

    schedule: object
    stages: list[PipelineStage]
    model_parts: list[nn.Module]
    pp_mesh: DeviceMesh
    last_stage_rank: int  # rank within pp_mesh that owns the last stage
    # The loss of training ("train") and of evaluation ("eval"); the schedule runs "now" (see build_pipeline).
    loss_fns: dict[str, LossFn]
    inference: _MetadataInference = field(default_factory=_MetadataInference)

    @property
    def inferring_metadata(self) -> bool:
        """Whether the schedule is running its first step's metadata inference: a forward and a loss on
        stand-in tensors (torch >= 2.15) whose values a loss function must not keep as the step's."""
        return self.inference.running

    @property
    def n_microbatches(self) -> int:
        """Microbatches per `step`: the schedule divides each one's loss by this many."""
        return self.schedule._n_microbatches

    @property
    def has_first_stage(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last_stage(self) -> bool:
        return any(s.is_last for s in self.stages)

    def step(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        *,
        loss: LossFn | None = None,
        **stage_inputs: torch.Tensor,
    ) -> torch.Tensor:
        """Forward and backward of one batch; returns its mean loss on every pipeline rank.

        `stage_inputs` (batch-first tensors, such as the document ids a block-causal mask needs) go to
        every stage's forward as keyword arguments, split into microbatches like `inputs`: a stage
        without the first one's inputs cannot derive them from the hidden state it receives.

        The loss is the mean of the last stage's microbatch losses, broadcast from that stage's rank,
        so what a trainer logs on any rank is the real loss. Run it inside `loss_parallel_ctx` /
        `context_parallel_ctx` when those are enabled, as for a non-pipelined step.

        `loss(logits, labels)`, if given, replaces the built training loss for this call: a loss whose
        target is more than token labels (any batch-first tensor, cut into microbatches as `inputs`;
        each microbatch's loss is still divided by the microbatch count).
        """
        return self._run(
            self.schedule.step,
            inputs,
            labels,
            loss or self.loss_fns["train"],
            return_outputs=False,
            **stage_inputs,
        )

    @torch.no_grad()
    def evaluate(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        *,
        loss: LossFn | None = None,
        **stage_inputs: torch.Tensor,
    ) -> torch.Tensor:
        """The mean loss of one batch through the schedule's forward-only path, on every pipeline rank.

        Computed with `build_pipeline`'s `eval_loss_fn` (or `loss`, as in `step`): the loss of this batch,
        as one process computes it.
        """
        for part in self.model_parts:
            part.eval()
        try:
            return self._run(
                self.schedule.eval, inputs, labels, loss or self.loss_fns["eval"], **stage_inputs
            )
        finally:
            for part in self.model_parts:
                part.train()

    def _run(
        self, run, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn, **kwargs
    ) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        self.loss_fns["now"] = loss_fn
        run(*args, target=target, losses=losses, **kwargs)
        if self.has_last_stage:
            parts = [x.full_tensor() if isinstance(x, DTensor) else x for x in losses]
            # Each microbatch loss is already divided by the microbatch count (see build_pipeline).
            loss = torch.stack([x.detach().float() for x in parts]).sum()
        else:
            loss = torch.empty((), device=inputs.device)
        dist.broadcast(loss, group=self.pp_mesh.get_group(), group_src=self.last_stage_rank)
        return loss


class _PipelineStage(PipelineStage):
    """A `PipelineStage` whose start-up handshake leaves out sends to its own rank, and which says when
    the schedule's metadata inference runs (`Pipeline.inferring_metadata`).

    torch 2.11's multi-stage schedules first exchange a dummy tensor with each neighbouring stage's
    rank. In a V (ZBVZeroBubble, DualPipeV) two neighbouring stages sit on one rank, and gloo cannot send to
    itself ("Pair is not connected"); the schedule passes those stages' tensors in memory anyway.
    Later torches have no such handshake and never call this.
    """

    inference = _MetadataInference()  # replaced by the pipeline's own in build_pipeline

    def _pre_metadata_inference_backup(self) -> None:
        super()._pre_metadata_inference_backup()
        self.inference.running = True

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        self.inference.running = False

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]


def stages_per_rank(options: PipelineOptions, pp: int, n_layers: int) -> int:
    """How many stages each rank runs: 1 for single-stage schedules, 2 for the others, unless the split
    settings say otherwise.

    With `layers_per_stage`, the stage count is the model's layers plus the embedding and output
    weights (`first/last_stage_less_layers`) divided by it, rounded up, as torchtitan counts it.
    """
    single = options.single_stage
    if options.split_points:
        total = len(options.split_points) + 1
        what = "split points + 1"
    elif options.layers_per_stage is not None:
        effective = n_layers + options.first_stage_less_layers + options.last_stage_less_layers
        total = math.ceil(effective / options.layers_per_stage)
        what = f"ceil(({n_layers} layers + embedding + output = {effective}) / pipeline.layers_per_stage)"
    else:
        return 1 if single else 2
    if total % pp:
        raise ParallelConfigError(
            f"parallelism: {total} pipeline stages ({what}) cannot be spread evenly over pp({pp}) ranks; "
            "choose a split whose number of stages is a multiple of pp"
        )
    per_rank = total // pp
    if single and per_rank != 1:
        raise ParallelConfigError(
            f"parallelism: schedule {options.schedule} runs one stage per rank, but the split gives {per_rank}; "
            "use Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV, or fewer stages"
        )
    if not single and per_rank < 2:
        raise ParallelConfigError(
            f"parallelism: schedule {options.schedule} runs several stages per rank, but the split gives "
            f"{per_rank}; use 1F1B or GPipe, or more stages (a smaller pipeline.layers_per_stage)"
        )
    if options.v_shape and per_rank != 2:
        raise ParallelConfigError(
            f"parallelism: schedule {options.schedule} runs exactly 2 stages per rank (a V), but the split "
            f"gives {per_rank}; choose a split with 2 * pp stages"
        )
    return per_rank


def pipeline_stages(
    units: list[str], blocks: list[str], pp: int, options: PipelineOptions
) -> list[list[str]]:
    """The units of every stage (pp * stages per rank, in stage order) as `build_pipeline` cuts them.

    Raises ParallelConfigError for a split the schedule cannot run, so a dry run can check a layout
    without building it.
    """
    per_rank = stages_per_rank(options, pp, len(blocks))
    return split_units(
        units,
        blocks,
        pp * per_rank,
        first_stage_less_layers=options.first_stage_less_layers,
        last_stage_less_layers=options.last_stage_less_layers,
        split_points=options.split_points,
    )


def stage_ids_of_rank(rank: int, pp: int, per_rank: int, v_shape: bool) -> list[int]:
    """Which stages a pipeline rank holds: looped (r, r+pp, ...) or V-shaped (r, 2pp-1-r)."""
    if v_shape:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(per_rank)]


def build_pipeline(
    model: nn.Module,
    dims: ParallelDims,
    options: ParallelOptions,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    local_batch_size: int,
    eval_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    parallelize_fn: Callable[[nn.Module], nn.Module] | None = None,
) -> Pipeline:
    """Cut `model` into stages, keep this rank's, parallelize each, and build the schedule.

    Each stage module goes through `parallelize(part, dims, options)` unless `parallelize_fn` is given.

    `model` is best built on the meta device (stages are deep copies); materialise and initialise
    `Pipeline.model_parts` afterwards. `loss_fn(logits, labels)` is the loss `step` trains on, a mean
    over tokens (a trainer that accumulates gradients passes it already scaled); `evaluate` uses
    `eval_loss_fn` (default: `loss_fn`). Each microbatch of `options.pipeline.microbatch_size` sequences
    gets its own loss, divided by the number of microbatches, so the gradients add up to those of the
    full-batch mean. The loss is divided, not the gradients afterwards (torch's `scale_grads`): that
    rescales every gradient the parameters hold, which under gradient accumulation includes earlier
    micro-batches' share.
    """
    pp_mesh = dims.submesh("pp")
    if pp_mesh is None:
        raise ParallelConfigError("parallelism: build_pipeline needs pp > 1; use parallelize() for pp = 1")
    pp, rank = dims.pp, pp_mesh.get_local_rank()
    units = pipeline_units_of(model)
    blocks = list(blocks_of(model))
    settings = options.pipeline
    stage_units = pipeline_stages(units, blocks, pp, settings)
    num_stages = len(stage_units)
    per_rank = num_stages // pp
    n_microbatches = settings.microbatches(local_batch_size)
    v_shape = settings.v_shape
    stages, parts, inference = [], [], _MetadataInference()
    for stage_id in stage_ids_of_rank(rank, pp, per_rank, v_shape):
        part = stage_module(model, stage_units[stage_id], units)
        part = parallelize_fn(part) if parallelize_fn is not None else parallelize(part, dims, options)
        parts.append(part)
        stages.append(_PipelineStage(part, stage_id, num_stages, device, group=pp_mesh.get_group()))
        stages[-1].inference = inference
        logger.info("pipeline rank %d holds stage %d: %s", rank, stage_id, stage_units[stage_id])
    loss_fns = {"train": loss_fn, "eval": eval_loss_fn or loss_fn, "now": loss_fn}

    def microbatch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fns["now"](logits, labels) / n_microbatches

    schedule = _schedule(settings, stages, n_microbatches, microbatch_loss, num_stages, local_batch_size)
    last_rank = next(r for r in range(pp) if num_stages - 1 in stage_ids_of_rank(r, pp, per_rank, v_shape))
    return Pipeline(schedule, stages, parts, pp_mesh, last_rank, loss_fns, inference)


def _schedule(
    options: PipelineOptions,
    stages: list[PipelineStage],
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    num_stages: int,
    local_batch_size: int,
) -> object:
    """The named schedule, or with `schedule_csv` torch's runtime schedule running that file's actions."""
    csv = options.schedule_csv
    if csv and not Path(csv).is_file():
        raise ParallelConfigError(
            f"parallelism: pipeline schedule CSV {csv} is not a file; give an existing path"
        )
    schedule_class = _PipelineScheduleRuntime if csv else get_schedule_class(options.schedule)
    kwargs = {"n_microbatches": n_microbatches, "loss_fn": loss_fn, "scale_grads": False}
    what = f"{csv if csv else options.schedule} with {num_stages} stages and {n_microbatches} microbatches"
    try:
        if issubclass(schedule_class, PipelineScheduleSingle):
            schedule = schedule_class(stages[0], **kwargs)
        else:
            schedule = schedule_class(stages, **kwargs)
        if csv:
            schedule._load_csv(csv)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise ParallelConfigError(
            f"parallelism: schedule {what} (local batch {local_batch_size} / microbatch "
            f"{options.microbatch_size}) is refused by torch: {str(e).splitlines()[0]}"
        ) from e
    return schedule
