"""Pipeline settings: the schedule, its microbatches and where stages are cut, checked when built.

Apart from `pipeline.py` because they are part of `ParallelOptions`, which `parallelize` (imported
by `pipeline.py`) reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_parallel.errors import ParallelConfigError, check_choice

PIPELINE_SCHEDULES = (
    "1F1B",
    "GPipe",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
    "PipelineScheduleMulti",  # a multi-stage schedule read from PipelineOptions.schedule_csv
)
SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class PipelineOptions:
    """torchtitan's `[parallelism] pipeline_parallel_*` settings (the degree is `ParallelDims.pp`).

    `layers_per_stage` or `split_points` (not both) decide where stages begin; without either, each
    rank runs one stage (single-stage schedules) or two. The embedding and the output head count as
    `first_stage_less_layers` and `last_stage_less_layers` layers when stages are cut, so the first and
    last stages get fewer blocks. `schedule_csv`: a schedule of F/I/W/B actions per rank, one CSV row
    per rank, run with `schedule="PipelineScheduleMulti"`.
    """

    schedule: str = "1F1B"
    microbatch_size: int = 1
    layers_per_stage: int | None = None
    split_points: tuple[str, ...] = ()
    first_stage_less_layers: int = 1
    last_stage_less_layers: int = 1
    schedule_csv: str | None = None

    def __post_init__(self) -> None:
        check_choice("pipeline.schedule", self.schedule, PIPELINE_SCHEDULES)
        if self.microbatch_size < 1:
            raise ParallelConfigError(
                f"parallelism: pipeline.microbatch_size must be >= 1, got {self.microbatch_size}"
            )
        if self.schedule == "PipelineScheduleMulti" and not self.schedule_csv:
            raise ParallelConfigError(
                "parallelism: pipeline.schedule='PipelineScheduleMulti' runs the actions of a CSV file; give "
                "pipeline.schedule_csv, or name a built-in schedule such as Interleaved1F1B"
            )
        if min(self.first_stage_less_layers, self.last_stage_less_layers) < 0:
            raise ParallelConfigError(
                "parallelism: pipeline.first_stage_less_layers and pipeline.last_stage_less_layers must be "
                f">= 0, got {self.first_stage_less_layers} and {self.last_stage_less_layers}"
            )
        if self.layers_per_stage is not None and self.split_points:
            raise ParallelConfigError(
                "parallelism: give pipeline.layers_per_stage or pipeline.split_points, not both; they both "
                "decide where stages begin"
            )

    def microbatches(self, local_batch_size: int) -> int:
        """Microbatches a schedule cuts each rank's batch of `local_batch_size` rows into."""
        if local_batch_size % self.microbatch_size:
            raise ParallelConfigError(
                f"parallelism: local batch size ({local_batch_size}) is not divisible by pipeline.microbatch_size "
                f"({self.microbatch_size}); choose a microbatch size that divides it"
            )
        return local_batch_size // self.microbatch_size

    @property
    def single_stage(self) -> bool:
        """Whether the schedule runs exactly one stage per rank."""
        return self.schedule in SINGLE_STAGE_SCHEDULES

    @property
    def v_shape(self) -> bool:
        """Whether the schedule places a rank's two stages in a V (r and 2pp-1-r) rather than looped."""
        return self.schedule in V_SCHEDULES
