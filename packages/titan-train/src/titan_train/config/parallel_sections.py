"""Config sections for parallelism and model transforms: [parallelism] [activation_checkpoint] [compile] [quantize].

Names and defaults follow torchtitan's last TOML schema (0.2.x) so its configs load unchanged. The trainer
refuses, with a ConfigError, any value here it does not apply yet (see `titan_train.config.unsupported`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_parallel.mx import MX_RECIPES
from titan_parallel.pipeline_options import PIPELINE_SCHEDULES
from titan_train.config.fields import MAX_LAYERS, MAX_RANKS, MAX_SEQUENCES, MODULE_PATH, opt

COMPILE_COMPONENTS = ("model", "loss")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(
        1,
        "Replicas of the model: DDP alone, HSDP together with data_parallel_shard_degree > 1; 1: off",
        minimum=1,
        maximum=MAX_RANKS,
    )
    data_parallel_shard_degree: int = opt(
        -1,
        "Ranks each replica's weights are sharded over (FSDP); -1: the ranks the other degrees leave",
        minimum=1,
        maximum=MAX_RANKS,
        sentinels=(-1,),
    )
    fsdp_reshard_after_forward: str = opt(
        "default",
        "Free gathered parameters after forward: default (yes, except where pipelining makes it wasteful), "
        "always, never",
        choices=("default", "always", "never"),
    )
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree; 1: off", minimum=1, maximum=MAX_RANKS)
    disable_loss_parallel: bool = opt(False, "Gather the vocabulary-sharded logits before the loss under TP")
    enable_async_tensor_parallel: bool = opt(
        False, "Overlap TP communication with matmuls (needs compile.enable)"
    )
    pipeline_parallel_degree: int = opt(
        1, "Pipeline-parallel degree: physical ranks per pipeline; 1: off", minimum=1, maximum=MAX_RANKS
    )
    module_fqns_per_model_part: list[list[str]] | None = opt(
        None,
        "Explicit pipeline split: one list of module names per model chunk (CLI: 'a,b;c,d')",
        pattern=MODULE_PATH,
    )
    pipeline_parallel_first_stage_less_layers: int = opt(
        1,
        "Layers the first stage gets fewer than the others, for the embedding it also holds",
        minimum=0,
        maximum=MAX_LAYERS,
    )
    pipeline_parallel_last_stage_less_layers: int = opt(
        1,
        "Layers the last stage gets fewer than the others, for the output projection it also holds",
        minimum=0,
        maximum=MAX_LAYERS,
    )
    pipeline_parallel_layers_per_stage: int | None = opt(
        None,
        "Layers per (virtual) stage; None: inferred from the schedule and the degree",
        minimum=1,
        maximum=MAX_LAYERS,
    )
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "Pipeline schedule name as torch.distributed.pipelining spells it",
        choices=PIPELINE_SCHEDULES,
    )
    pipeline_parallel_schedule_csv: str | None = opt(
        "", "CSV file describing a custom pipeline schedule", path="a pipeline schedule CSV file"
    )
    pipeline_parallel_microbatch_size: int = opt(
        1,
        "Sequences per pipeline micro-batch; local_batch_size must be a multiple of it",
        minimum=1,
        maximum=MAX_SEQUENCES,
    )
    pipeline_parallel_expert_parallel_overlap: bool = opt(
        True,
        "DualPipeV: overlap expert- and pipeline-parallel communication (torchtitan's; Titan runs the pairs in turn, said at start)",
    )
    context_parallel_degree: int = opt(
        1, "Context-parallel degree: ranks each sequence is split over; 1: off", minimum=1, maximum=MAX_RANKS
    )
    context_parallel_load_balancer: str | None = opt(
        "headtail",
        "How CP balances attention work over ranks: headtail (rank i holds chunks i and 2cp-1-i), ptrr "
        "(blocks dealt by their work under the rows' document masks), None: one chunk each",
        choices=("headtail", "ptrr"),
    )
    context_parallel_rotate_method: str = opt(
        "allgather", "How CP exchanges key/value shards", choices=("allgather", "alltoall")
    )
    expert_parallel_degree: int = opt(
        1, "Expert-parallel degree (MoE models only); 1: off", minimum=1, maximum=MAX_RANKS
    )
    expert_tensor_parallel_degree: int = opt(
        1, "Tensor-parallel degree inside experts (MoE only); 1: off", minimum=1, maximum=MAX_RANKS
    )
    expert_parallel_comm_backend: str = opt(
        "standard", "Expert all-to-all implementation (MoE only)", choices=("standard", "deepep")
    )


@dataclass
class ActivationCheckpoint:
    mode: str = opt(
        "selective",
        "Recompute activations in backward to save memory",
        choices=("selective", "full", "memory_budget", "none"),
    )
    selective_ac_option: str = opt(
        "2",
        "For mode=selective: an integer N checkpoints every Nth block; 'op' saves chosen ops' outputs",
        pattern=(r"op|[1-9][0-9]*", "'op' or a positive integer"),
    )
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = opt(
        ["moe.router.gate"],
        "Linear modules whose matmul shapes op-level selective AC always recomputes",
        pattern=MODULE_PATH,
    )
    early_stop: bool = opt(False, "Stop recomputing once every needed activation is rematerialised")
    memory_budget: float = opt(
        0.5,
        "For mode=memory_budget: 0.0 recomputes as much as the compiler can, 1.0 as little as it likes",
        minimum=0,
        maximum=1,
    )
    visualize_memory_budget_pareto: bool = opt(
        False, "Write an SVG of runtime against activation memory for every budget under dump_folder"
    )
    preserve_rng_state: bool = opt(
        False, "Restore the RNG state in recomputation (bitwise-equal dropout; slower)"
    )
    determinism_check: str = opt(
        "default", "torch.utils.checkpoint determinism check", choices=("default", "none")
    )
    debug: bool = opt(False, "Collect torch.utils.checkpoint debug information (slower)")


@dataclass
class Compile:
    enable: bool = opt(False, "Apply torch.compile")
    components: list[str] = opt(["model", "loss"], "What to compile", choices=COMPILE_COMPONENTS)
    backend: str = opt(
        "inductor",
        "torch.compile backend (inductor, aot_eager, eager, or one registered with torch)",
        nonempty=True,
    )


@dataclass
class Float8Linear:
    enable_fsdp_float8_all_gather: bool = opt(False, "All-gather FSDP weights in float8 (tensorwise scaling)")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "Compute every weight's float8 scale in one all-reduce after the optimizer step"
    )
    recipe_name: str | None = opt(
        None,
        "torchao float8 recipe; None: tensorwise",
        choices=(None, "tensorwise", "rowwise", "rowwise_with_gw_hp"),
    )
    filter_fqns: list[str] = opt([], "Linear modules (by name) left in high precision", pattern=MODULE_PATH)
    emulate: bool = opt(False, "Emulate float8 matmuls in high precision (tests on hardware without float8)")


@dataclass
class MXLinear:
    mxfp8_dim1_cast_kernel_choice: str = opt(
        "triton", "Kernel for the MX dim-1 cast", choices=("triton", "cuda", "torch")
    )
    recipe_name: str = opt(
        "mxfp8_cublas",
        "torchao MXFP8 recipe; the emulated ones run on any device (MX numerics, high-precision matmuls)",
        choices=MX_RECIPES,
    )
    filter_fqns: list[str] = opt(
        ["output"], "Linear modules (by name) left in high precision", pattern=MODULE_PATH
    )


@dataclass
class QuantizedLinear:
    float8: Float8Linear = field(default_factory=Float8Linear)
    mx: MXLinear = field(default_factory=MXLinear)


@dataclass
class Float8GroupedMM:
    fqns: list[str] = opt(
        [],
        "MoE modules whose grouped matmuls run in float8 (prototype); inert unless its converter is listed "
        "in model.converters, which Titan does not offer",
        pattern=MODULE_PATH,
    )


@dataclass
class MXGroupedMM:
    recipe_name: str = opt("mxfp8", "MX recipe for grouped matmuls", choices=("mxfp8",))
    fqns: list[str] = opt(
        [],
        "MoE modules whose grouped matmuls run in MX formats (prototype); inert unless its converter is "
        "listed in model.converters, which Titan does not offer",
        pattern=MODULE_PATH,
    )


@dataclass
class QuantizedGroupedMM:
    float8: Float8GroupedMM = field(default_factory=Float8GroupedMM)
    mx: MXGroupedMM = field(default_factory=MXGroupedMM)


@dataclass
class Quantize:
    linear: QuantizedLinear = field(default_factory=QuantizedLinear)
    grouped_mm: QuantizedGroupedMM = field(default_factory=QuantizedGroupedMM)
