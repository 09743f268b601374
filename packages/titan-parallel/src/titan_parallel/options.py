"""The plain settings `parallelize` and `build_pipeline` take, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_parallel.errors import ParallelConfigError

RESHARD_POLICIES = ("default", "always", "never")
AC_MODES = ("none", "full", "selective")
FLOAT8_RECIPES = ("tensorwise", "rowwise")
# MXFP8 recipes: torchtitan 0.2.2's names, then torchao 0.18's (titan_parallel.mx says what each does).
MX_RECIPES = (
    "mxfp8_cublas",
    "mxfp8_cublas_rceil",
    "mxfp8_rceil",
    "mxfp8_rceil_wgrad_with_hp",
    "mxfp8_emulated",
    "mxfp8_emulated_rceil",
)
MX_DIM1_CAST_KERNELS = ("triton", "cuda", "torch")
ROTATE_METHODS = ("allgather", "alltoall")
PIPELINE_SCHEDULES = (
    "1F1B",
    "GPipe",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
    "PipelineScheduleMulti",  # a multi-stage schedule read from pp_schedule_csv
)
SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class ParallelOptions:
    """Everything about a layout other than its degrees (those are `ParallelDims`).

    Field names follow torchtitan's `[parallelism]`, `[activation_checkpoint]`, `[compile]` and
    `[quantize]` settings so a trainer maps a config onto them one to one.
    """

    # Data parallel (FSDP2 / HSDP / DDP)
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: str = "default"  # "default": reshard unless pipelining; "always"; "never"
    cpu_offload: bool = False
    # Tensor parallel
    sequence_parallel: bool = True
    loss_parallel: bool = True
    async_tp: bool = False
    # Activation checkpointing: "selective" with ac_selective="op" keeps every other matmul output; an
    # integer N checkpoints every N-th block fully.
    ac_mode: str = "none"
    ac_selective: str | int = "op"
    # torch.utils.checkpoint's own switches, passed through as named there.
    ac_preserve_rng_state: bool = False
    ac_determinism_check: str = "default"
    ac_early_stop: bool = False
    ac_debug: bool = False
    # Per-op mode: linear layers (by name, matched inside each block) whose matmuls are recomputed, not kept.
    ac_force_recompute_mm_fqns: tuple[str, ...] = ()
    # torch.compile of each block, with this backend
    compile: bool = False
    compile_backend: str = "inductor"
    # float8 training through torchao
    float8: str | None = None  # None, "tensorwise" or "rowwise"
    float8_fsdp_all_gather: bool = False
    float8_skip_fqns: tuple[str, ...] = ("output",)
    float8_emulate: bool = (
        False  # matmuls in high precision: float8 numerics where float8 kernels are missing
    )
    # MXFP8 training through torchao (CUDA SM100+, or an emulated recipe anywhere)
    mx: str | None = None  # None or one of MX_RECIPES
    mx_dim1_cast_kernel: str = "triton"
    mx_skip_fqns: tuple[str, ...] = ("output",)
    # Pipeline parallel
    pp_schedule: str = "1F1B"
    pp_microbatch_size: int = 1
    pp_layers_per_stage: int | None = None
    pp_split_points: tuple[str, ...] = ()
    # The embedding and the output head count as this many layers when stages are cut (torchtitan's
    # pipeline_parallel_first/last_stage_less_layers): the first and last stages get fewer blocks.
    pp_first_stage_less_layers: int = 1
    pp_last_stage_less_layers: int = 1
    pp_schedule_csv: str | None = None  # a schedule of F/I/W/B actions per rank, one CSV row per rank
    # Context parallel
    cp_rotate_method: str = "allgather"
    cp_load_balance: bool = True  # each rank holds chunks i and 2*cp-1-i of a causal sequence

    def __post_init__(self) -> None:
        _choose("reshard_after_forward", self.reshard_after_forward, RESHARD_POLICIES)
        _choose("ac_mode", self.ac_mode, AC_MODES)
        _choose("cp_rotate_method", self.cp_rotate_method, ROTATE_METHODS)
        _choose("pp_schedule", self.pp_schedule, PIPELINE_SCHEDULES)
        if self.float8 is not None:
            _choose("float8", self.float8, FLOAT8_RECIPES)
        if self.float8_fsdp_all_gather and self.float8 != "tensorwise":
            raise ParallelConfigError(
                f"parallelism: float8_fsdp_all_gather needs float8='tensorwise' (got {self.float8!r}); "
                "torchao all-gathers float8 weights only with one scale per tensor"
            )
        if self.mx is not None:
            _choose("mx", self.mx, MX_RECIPES)
            if self.float8 is not None:
                raise ParallelConfigError(
                    f"parallelism: float8={self.float8!r} and mx={self.mx!r} both convert the linear layers; "
                    "choose one"
                )
        _choose("mx_dim1_cast_kernel", self.mx_dim1_cast_kernel, MX_DIM1_CAST_KERNELS)
        if self.ac_mode == "selective":
            every = self.ac_selective
            if isinstance(every, str) and every != "op":
                if not every.isdigit():
                    raise ParallelConfigError(
                        f"parallelism: ac_selective must be 'op' or a positive integer, got {every!r}"
                    )
                every = int(every)
            if isinstance(every, int) and every < 1:
                raise ParallelConfigError(f"parallelism: ac_selective must be >= 1, got {every}")
        if self.pp_microbatch_size < 1:
            raise ParallelConfigError(
                f"parallelism: pp_microbatch_size must be >= 1, got {self.pp_microbatch_size}"
            )
        if self.pp_schedule == "PipelineScheduleMulti" and not self.pp_schedule_csv:
            raise ParallelConfigError(
                "parallelism: pp_schedule='PipelineScheduleMulti' runs the actions of a CSV file; give "
                "pp_schedule_csv, or name a built-in schedule such as Interleaved1F1B"
            )
        if min(self.pp_first_stage_less_layers, self.pp_last_stage_less_layers) < 0:
            raise ParallelConfigError(
                "parallelism: pp_first_stage_less_layers and pp_last_stage_less_layers must be >= 0, got "
                f"{self.pp_first_stage_less_layers} and {self.pp_last_stage_less_layers}"
            )
        if self.pp_layers_per_stage is not None and self.pp_split_points:
            raise ParallelConfigError(
                "parallelism: give pp_layers_per_stage or pp_split_points, not both; they both decide "
                "where stages begin"
            )

    @property
    def selective_every(self) -> int | None:
        """N for "checkpoint every N-th block", or None for per-op selective checkpointing."""
        return None if self.ac_selective == "op" else int(self.ac_selective)


def _choose(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ParallelConfigError(f"parallelism: {name}={value!r} is unknown; choose one of {list(allowed)}")
