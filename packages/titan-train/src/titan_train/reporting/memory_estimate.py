"""Memory per rank of a config, from traced training steps: peak allocated, expected peak reserved, breakdown.

Each distinct rank of the layout (the first, second and last pipeline stage; every rank of a stage holds
the same shard shapes) runs one training step on fake tensors (see `traced_memory`; a pipeline rank in
a process of its own, running three micro-batches of each stage and replaying the others). Blocks are
identical, so a deep stage is traced with a few blocks and with a few more, and each phase's peak is
extended to the real depth (`titan_parallel.memory_trace.scale_to_blocks`). The CUDA caching allocator
is replayed on the traced allocations for the reserved bytes a training log reports as memory.
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from titan_parallel.allocator_model import AllocatorPeaks, replay
from titan_parallel.memory_trace import TraceResult, scale_to_blocks
from titan_parallel.pipeline import stages_per_rank
from titan_train.plan import RunPlan, resolve
from titan_train.reporting.traced_memory import trace_rank
from titan_train.wiring.loss import build_loss_fn

GIB = 2**30
logger = logging.getLogger(__name__)


@dataclass
class RankMemory:
    """One traced rank: its peak live bytes, where it happens, what it holds then, and the allocator's view."""

    rank: int
    pp_rank: int
    allocated: int  # peak of the allocator's block sizes (torch.cuda.max_memory_allocated)
    reserved: int  # expected torch.cuda.max_memory_reserved with expandable segments
    reserved_fixed_segments: int  # the same without expandable segments
    where: str
    breakdown: dict[str, int]


@dataclass
class MemoryEstimate:
    """The traced ranks of a layout; `worst` is the one a job must fit."""

    ranks: list[RankMemory]
    blocks_per_stage: int
    traced_blocks: tuple[int, ...]
    fake: bool
    expandable_segments: bool
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: self.expected_reserved(r))

    def expected_reserved(self, r: RankMemory) -> int:
        return r.reserved if self.expandable_segments else r.reserved_fixed_segments

    def rows(self) -> list[tuple[str, int]]:
        """The worst rank's breakdown at its peak, then its peak allocated and expected reserved."""
        w = self.worst
        rows = [(name, size) for name, size in w.breakdown.items() if size]
        rows += [
            ("peak allocated", w.allocated),
            ("expected peak reserved, expandable segments", w.reserved),
            ("expected peak reserved, fixed segments", w.reserved_fixed_segments),
        ]
        return rows


def expandable_segments_from_env() -> bool:
    """Whether the allocator will run with expandable segments: the launch scripts set it unless the user did."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF"))
    if conf is None:
        return True
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _period(config: Any) -> int:
    ac = config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option.isdigit():
        return int(ac.selective_ac_option)
    return 1


# Stacks up to this many blocks per stage are traced whole: a trace costs seconds, and the allocator's
# slack (reserved over allocated) does not grow linearly with depth, so scaling it would be a guess.
FULL_TRACE_BLOCKS = 48


def _depths(blocks: int, period: int) -> tuple[int, ...]:
    """Two traced depths that differ by the period, match `blocks` modulo it, and have a middle block;
    or the whole stack where it is small enough to trace."""
    if blocks <= FULL_TRACE_BLOCKS:
        return (blocks,)
    first = blocks % period or period
    while first < 3:
        first += period
    if first + period >= blocks:
        return (blocks,)
    return (first, first + period)


def _where(label: tuple, blocks: int) -> str:
    if len(label) == 3:
        phase, part, place = label
        index = {"first": 0, "last": blocks - 1, "middle": blocks - 2}.get(place, place)
        stage = f" of model part {part}" if part else ""
        return f"{phase} of block {index}{stage}"
    return " ".join(map(str, label))


def estimate_memory(plan: RunPlan, *, fake: bool = True, capacity: int | None = None) -> MemoryEstimate:
    """Trace `plan` on its world size (in this process, on fake process groups) and size each rank, in
    the dtypes of the plan's device."""
    start = time.perf_counter()
    notes = []
    config, world_size, dims = plan.config, plan.world_size, plan.dims
    if config.compile.enable:
        # Dynamo cannot trace under an outer fake mode; eager saves at least what inductor saves.
        eager = replace(config, compile=replace(config.compile, enable=False))
        plan = replace(
            plan,
            config=eager,
            options=replace(plan.options, compile=replace(plan.options.compile, enabled=False)),
            loss_fn=build_loss_fn(eager, plan.family),
        )
        notes.append(
            "compile is traced as eager (an upper bound: inductor fuses element-wise ops and saves less)"
        )
        if config.activation_checkpoint.mode == "memory_budget":
            notes.append(
                f"activation_checkpoint.memory_budget {config.activation_checkpoint.memory_budget} is applied "
                "by the compiler's partitioner, so it is traced without checkpointing: an upper bound (mode "
                "'full' traces the lower one)"
            )
    n_layers = plan.model_args.n_layers
    p = config.parallelism
    per_rank = 1
    if dims.pp > 1:
        per_rank = stages_per_rank(plan.options.pipeline, dims.pp, n_layers)
    stages = dims.pp * per_rank
    blocks = math.ceil(n_layers / stages)
    fixed_split = p.module_fqns_per_model_part or p.pipeline_parallel_layers_per_stage
    depths = (blocks,) if fixed_split else _depths(blocks, _period(config))
    pp_ranks = sorted({0, min(1, dims.pp - 1), dims.pp - 1})
    # Traced whole, the model keeps its own depth: its stages may differ by a block (405B's 126 layers
    # are 7 or 8 blocks on each of 16 stages), which `blocks * stages` layers would change.
    layer_counts = [None] if depths == (blocks,) else [d * stages for d in depths]
    jobs = [(plan, pp_rank * (world_size // dims.pp), fake, n) for pp_rank in pp_ranks for n in layer_counts]
    if dims.pp == 1:
        traced = [_trace(*job, capacity) for job in jobs]
    else:
        with _trace_processes(len(jobs)) as pool:
            traced = list(pool.map(_trace, *zip(*jobs, strict=True), [capacity] * len(jobs)))
    per_rank = [traced[i : i + len(depths)] for i in range(0, len(traced), len(depths))]
    ranks = [
        _rank_memory(pp_rank * (world_size // dims.pp), pp_rank, traces, depths, blocks)
        for pp_rank, traces in zip(pp_ranks, per_rank, strict=True)
    ]
    return MemoryEstimate(
        ranks=ranks,
        blocks_per_stage=blocks,
        traced_blocks=depths,
        fake=fake,
        expandable_segments=expandable_segments_from_env(),
        seconds=time.perf_counter() - start,
        notes=notes,
    )


def _trace_processes(jobs: int) -> ProcessPoolExecutor:
    """Processes for pipeline traces, one per trace (after a pipeline of one fake world, DTensor's caches
    hold meshes whose process groups another world lacks), forked from a server that imported torch and
    Titan once: a fresh interpreter per trace would import them again, seconds each."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    # One more process than cores: three traces on two cores end together, not one after two.
    return ProcessPoolExecutor(
        min(jobs, (os.cpu_count() or 1) + 1), mp_context=context, max_tasks_per_child=1
    )


def _trace(plan, rank, fake, n_layers, capacity) -> _Traced:
    """One rank's trace and the caching allocator replayed on it, in the process that traced it."""
    t = trace_rank(plan, rank, fake=fake, n_layers=n_layers)
    fixed = replay(t.sizes, t.streams, capacity=capacity)
    expandable = replay(t.sizes, t.streams, expandable_segments=True, capacity=capacity)
    return _Traced(replace(t, sizes=[], streams={}), fixed, expandable)


@dataclass
class _Traced:
    """A rank's trace and the allocator's peaks on it; its allocation sequence stays where it was traced."""

    result: TraceResult
    fixed: AllocatorPeaks
    expandable: AllocatorPeaks


def _rank_memory(
    rank: int, pp_rank: int, traced: list[_Traced], depths: tuple[int, ...], blocks: int
) -> RankMemory:
    traces = [t.result for t in traced]
    peaks = [(t.fixed, t.expandable) for t in traced]
    if len(traces) == 1:
        result, (fixed, expandable) = traces[0], peaks[0]
        allocated, reserved, reserved_fixed = expandable.allocated, expandable.reserved, fixed.reserved
    else:
        # Each phase's peak grows linearly with depth, but at its own rate: the step's peak is the
        # largest scaled phase, which at a small traced depth may be another phase than at full depth.
        result = scale_to_blocks(traces[0], traces[1], depths[0], depths[1], blocks)

        # The allocator's slack (reserved over allocated) is the deeper trace's: it grows with depth,
        # but not along a line (seen on 3B: 0.7, 0.9, 1.8 and 2.9 GiB at 3, 4, 8 and 28 blocks), so
        # for a scaled stack the expected reserved leans low.
        fixed, expandable = peaks[1]
        allocated = result.peak + (expandable.allocated - traces[1].peak)  # block rounding
        reserved = allocated + expandable.reserved - expandable.allocated
        reserved_fixed = allocated + fixed.reserved - fixed.allocated
    return RankMemory(
        rank=rank,
        pp_rank=pp_rank,
        allocated=allocated,
        reserved=reserved,
        reserved_fixed_segments=reserved_fixed,
        where=_where(result.label, blocks),
        breakdown=result.breakdown,
    )


def log_estimate_in_child(plan: RunPlan) -> None:
    """`[memory_estimation] enable`: trace this job's memory per rank in a child process and log it.

    A child, because the trace needs a fake process group of its own beside this run's real one. With
    `disable_fake_mode` it traces on real tensors, which takes one rank's memory on this host. The
    child resolves the config again (a spawned process starts without the run's registrations and
    compiled loss, which the config's experimental.custom_import brings back).
    """
    args = (plan.config, plan.world_size, plan.device_type)
    child = multiprocessing.get_context("spawn").Process(target=_log_estimate, args=args)
    child.start()
    child.join()


def _log_estimate(config: Any, world_size: int, device_type: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if config.experimental.custom_import:
        importlib.import_module(config.experimental.custom_import)
    fake = not config.memory_estimation.disable_fake_mode
    estimate = estimate_memory(resolve(config, world_size, device_type), fake=fake)
    how = "fake" if fake else "real"
    for r in estimate.ranks:
        logger.info(
            "memory estimate (traced on %s tensors), rank %d: peak allocated %.2f GiB at %s, expected peak reserved %.2f GiB",
            how,
            r.rank,
            r.allocated / GIB,
            r.where,
            estimate.expected_reserved(r) / GIB,
        )
    for name, size in estimate.rows():
        logger.info("memory estimate per rank: %-46s %8.2f GiB", name, size / GIB)
