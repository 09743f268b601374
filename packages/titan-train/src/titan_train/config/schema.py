"""The job configuration: torchtitan's TOML sections and field names (0.2.x), each with a default and help.

Sections for parallelism and model transforms live in `parallel_sections.py`. Titan's own additions are
marked "(Titan)" in their help.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_train.config.converters import CONVERTERS
from titan_train.config.custom_module import import_user_module
from titan_train.config.fault_tolerance_section import FaultTolerance
from titan_train.config.fields import (
    CONFIG_NAME,
    MAX_RANKS,
    MAX_SECONDS,
    MAX_SEQ_LEN,
    MAX_SEQUENCES,
    MAX_STEPS,
    MODULE_NAME,
    SPLIT_NAME,
    opt,
)
from titan_train.config.grpo_section import GRPO
from titan_train.config.health_section import Health
from titan_train.config.lora_section import LoRA
from titan_train.config.muon_section import MuonSettings
from titan_train.config.parallel_sections import ActivationCheckpoint, Compile, Parallelism, Quantize
from titan_train.config.preference_section import Preference
from titan_train.config.sft_section import Sft
from titan_train.model_families import DEFAULT_FAMILY


@dataclass
class Job:
    config_file: str | None = opt(None, "TOML file to read before CLI overrides", path="a TOML file")
    dump_folder: str = opt(
        "./outputs",
        "Folder for checkpoints, TensorBoard events, traces and the resolved config",
        nonempty=True,
    )
    description: str = opt("default job", "Free-text description of the job")
    print_config: bool = opt(False, "Log the resolved configuration at start")
    save_config_file: str | None = opt(
        None, "Also write the resolved configuration to this file, under dump_folder", nonempty=True
    )
    custom_config_module: str = opt(
        "",
        "Importable module whose JobConfig dataclass adds sections or fields to this schema",
        pattern=MODULE_NAME,
        sentinels=("",),
    )


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Record torch profiler traces")
    save_traces_folder: str = opt(
        "profile_traces", "Trace folder, under dump_folder (one iteration_N per trace)", nonempty=True
    )
    profile_freq: int = opt(10, "Write a trace every this many steps", minimum=1, maximum=MAX_STEPS)
    profiler_active: int = opt(1, "Steps each trace records", minimum=1, maximum=MAX_STEPS)
    profiler_warmup: int = opt(
        3, "Steps the profiler warms up before each recorded window", minimum=0, maximum=MAX_STEPS
    )
    enable_memory_snapshot: bool = opt(False, "Dump CUDA allocator snapshots (CUDA only)")
    save_memory_snapshot_folder: str = opt(
        "memory_snapshot", "Snapshot folder, under dump_folder", nonempty=True
    )


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics every this many steps", minimum=1, maximum=MAX_STEPS)
    enable_tensorboard: bool = opt(False, "Write TensorBoard scalars")
    disable_color_printing: bool = opt(
        False,
        "Plain log lines without ANSI colours (plain anyway when stdout is not a terminal, unless FORCE_COLOR)",
    )
    save_tb_folder: str = opt("tb", "TensorBoard folder, under dump_folder", nonempty=True)
    save_for_all_ranks: bool = opt(
        False, "Every rank writes its own TensorBoard/W&B metrics, not only rank 0"
    )
    enable_wandb: bool = opt(False, "Log metrics to Weights & Biases (needs the wandb package)")


@dataclass
class Model:
    name: str = opt(DEFAULT_FAMILY, "Model family, as registered in titan_train.registry", nonempty=True)
    flavor: str = opt(
        "debugmodel",
        "Model shape within the family (debugmodel, 8B, 70B, 405B, ...); from_hf: as the Hugging Face config.json "
        "of the checkpoint to load (or of hf_assets_path) states it",
        nonempty=True,
    )
    hf_assets_path: str = opt(
        "",
        "Folder with the tokenizer (and config/safetensors); empty: the test tokenizer bundled with titan-data",
        path="a folder with tokenizer.model or tokenizer.json",
    )
    converters: list[str] = opt(
        [],
        "Model transforms to apply, in order, e.g. quantize.linear.float8, quantize.linear.mx, lora "
        "(low-rank adapters on a frozen base, see [lora]; after any quantisation)",
        choices=CONVERTERS,
    )
    print_after_conversion: bool = opt(False, "Log the model after the converters ran")
    moe_load_balance_coeff: float | None = opt(
        None,
        "(Titan) Step of the MoE expert-bias balancing per optimizer step; 0: off (the bias stays as "
        "loaded); None: the flavor's (each family's in docs/migrating-from-torchtitan.md, MoE balancing knobs)",
        minimum=0,
        maximum=1.0,
    )
    moe_seq_aux_loss_coeff: float | None = opt(
        None,
        "(Titan) Weight of the sequence-wise MoE balance loss, for a family whose router has one; 0: off; "
        "None: the flavor's",
        minimum=0,
        maximum=1.0,
    )
    num_mtp_layers: int = opt(
        0,
        "(Titan) Multi-token-prediction depths after the last block, for a family built with them (Hugging "
        "Face's num_nextn_predict_layers); 0: none. See docs/mtp.md",
        minimum=0,
        maximum=16,
    )
    mtp_loss_weight: float = opt(
        0.1,
        "(Titan) lambda of the multi-token-prediction loss: loss = main + lambda / D * sum of the D depths' "
        "losses (docs/mtp.md gives the published schedule)",
        minimum=0,
        maximum=10.0,
    )


@dataclass
class Optimizer:
    name: str = opt(
        "AdamW",
        "Optimizer; Muon: Muon for the blocks' matrices ([optimizer.muon]), AdamW for the rest",
        choices=("Adam", "AdamW", "Muon"),
    )
    lr: float = opt(
        8e-4, "Peak learning rate (0 trains nothing: the weights stay as they are)", minimum=0, maximum=1.0
    )
    beta1: float = opt(0.9, "Adam beta1", minimum=0, below=1)
    beta2: float = opt(0.95, "Adam beta2", minimum=0, below=1)
    eps: float = opt(1e-8, "Adam epsilon", above=0, maximum=1.0)
    weight_decay: float = opt(
        0.1, "Decoupled weight decay (AdamW) or L2 penalty (Adam)", minimum=0, maximum=10.0
    )
    implementation: str = opt(
        "fused",
        "Kernel: fused (accelerators; CPU falls back to foreach), foreach, or for-loop",
        choices=("fused", "foreach", "for-loop"),
    )
    early_step_in_backward: bool = opt(
        False, "Step each parameter as soon as its gradient is ready (no clipping)"
    )
    muon: MuonSettings = field(default_factory=MuonSettings)


@dataclass
class LRScheduler:
    warmup_steps: int = opt(
        200, "Steps of linear warmup from near zero to the peak lr", minimum=0, maximum=MAX_STEPS
    )
    total_steps: int | None = opt(
        None, "Steps the schedule spans; None: training.steps", minimum=1, maximum=MAX_STEPS
    )
    decay_ratio: float | None = opt(
        None,
        "Share of steps spent decaying at the end (warmup-stable-decay); None: decay right after warmup",
        minimum=0,
        maximum=1,
    )
    decay_type: str = opt("linear", "Shape of the decay", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = opt(0.0, "Final lr as a fraction of the peak lr", minimum=0, maximum=1)


@dataclass
class DataLoader:
    num_workers: int = opt(
        0,
        "Loader worker processes that tokenise and pack (the batches and the saved position are those of 0)",
        minimum=0,
        maximum=1024,
    )
    persistent_workers: bool = opt(False, "Keep workers between epochs (only with num_workers > 0)")
    pin_memory: bool = opt(False, "Page-lock batches for asynchronous copies to the GPU (no effect on CPU)")
    prefetch_factor: int | None = opt(
        None, "Batches each worker loads ahead (only with num_workers > 0)", minimum=1, maximum=1024
    )
    num_streams: int = opt(
        0,
        "(Titan) document streams the data is dealt into (0: one per data-parallel rank, or as many as the "
        "resumed checkpoint was saved with); keep it fixed to get the same batches at any world size",
        minimum=0,
        maximum=MAX_RANKS,
    )


@dataclass
class Training:
    dataset: str = opt("c4_test", "Dataset name (see titan_data.DATASETS)", nonempty=True)
    dataset_path: str | None = opt(
        None, "Read the dataset from this local path instead of its default", path="a dataset file or folder"
    )
    objective: str = opt(
        "auto",
        "(Titan) What a step trains: auto (preference pairs: preference; prompts: grpo; other data: "
        "next_token), next_token, preference, grpo, or a name a module of experimental.custom_import registers "
        "(titan_train.objectives.registry.register_objective)",
        nonempty=True,
    )
    dataset_split: str = opt(
        "",
        "(Titan) Split to read: of a hub dataset, a save_to_disk DatasetDict, or a folder whose files are named "
        "by split (train-*.parquet, test/...); c4: train or validation; empty: train (or the only split)",
        pattern=SPLIT_NAME,
        sentinels=("",),
    )
    dataset_config: str = opt(
        "",
        "(Titan) Configuration of a hub dataset's rows (chat, preference or prompts read by hub id), as "
        "datasets.load_dataset's name and TRL's dataset_config: GSM8K's main or socratic; empty: its default",
        pattern=CONFIG_NAME,
        sentinels=("",),
    )
    dataset_mixture: list[str] = opt(
        [],
        "(Titan) Several paths of `dataset`, mixed by dataset_weights instead of one dataset_path; each "
        "source's share and rows are logged, and the mixture resumes exactly",
        nonempty=True,
    )
    dataset_weights: list[float] = opt(
        [],
        "(Titan) One weight per dataset_mixture path: its share of the documents (rows), normalised to sum 1; "
        "empty: equal shares",
        above=0,
        maximum=1e9,
    )
    epochs: int = opt(
        0,
        "(Titan) Passes over a finite dataset; the run trains the steps they take (an epoch's logged at "
        "start); 0: train training.steps",
        minimum=1,
        maximum=MAX_STEPS,
        sentinels=(0,),
    )
    local_batch_size: int = opt(
        8, "Sequences per data-parallel rank per micro-batch", minimum=1, maximum=MAX_SEQUENCES
    )
    chunked_loss: bool = opt(
        True,
        "Cross-entropy in chunks of 1024 tokens, never holding the float32 [tokens x vocab] logits at once; "
        "not used where the loss is compiled (compile.components has 'loss') or vocabulary-sharded (TP)",
    )
    global_batch_size: int = opt(
        -1,
        "Sequences per optimizer step over all ranks; above local_batch_size * dp it accumulates gradients; "
        "-1: local_batch_size * dp",
        minimum=1,
        maximum=MAX_SEQUENCES,
        sentinels=(-1,),
    )
    seq_len: int = opt(2048, "Tokens per sequence", minimum=1, maximum=MAX_SEQ_LEN)
    max_norm: float = opt(1.0, "Gradient-norm clipping threshold", above=0, maximum=1e9)
    steps: int = opt(10000, "Optimizer steps to train", minimum=0, maximum=MAX_STEPS)
    enable_cpu_offload: bool = opt(False, "Keep FSDP parameters, gradients and optimizer state in CPU memory")
    dtype: str = opt(
        "float32",
        "Dtype of parameters, gradients and optimizer state (bfloat16: no float32 master copy)",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_param: str = opt(
        "bfloat16",
        "Compute dtype of parameters under FSDP (or autocast on one GPU); CPU runs keep float32",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_reduce: str = opt("float32", "FSDP gradient reduction dtype", choices=("float32",))
    gc_freq: int = opt(
        50,
        "Run Python's garbage collector every this many steps (automatic collection is off)",
        minimum=1,
        maximum=MAX_STEPS,
    )
    gc_debug: bool = opt(False, "Collect garbage every step, to find reference cycles")
    dataloader: DataLoader = field(default_factory=DataLoader)


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints and resume from the newest one in the folder")
    folder: str = opt("checkpoint", "Checkpoint folder, under job.dump_folder", nonempty=True)
    interval: int = opt(
        500, "Save every this many steps (the last step is always saved)", minimum=1, maximum=MAX_STEPS
    )
    keep_latest_k: int = opt(
        10,
        "Keep only the newest k checkpoints; 0 keeps all (1 is safe: saves are atomic)",
        minimum=0,
        maximum=MAX_STEPS,
    )
    load_step: int = opt(
        -1,
        "Resume from this step's checkpoint; -1: the newest complete one",
        minimum=0,
        maximum=MAX_STEPS,
        sentinels=(-1,),
    )
    initial_load_path: str | None = opt(
        None,
        "Checkpoint to start from when the folder holds none (a step folder, or a Hugging Face model folder)",
        path="a checkpoint step folder or a Hugging Face model folder",
        needed_if="checkpoint.enable",
    )
    initial_load_model_only: bool = opt(
        True, "Load only the model from initial_load_path; false: also optimizer, schedule, data and step"
    )
    initial_load_in_hf: bool = opt(
        False, "initial_load_path holds Hugging Face safetensors (empty path: model.hf_assets_path)"
    )
    initial_load_in_hf_quantized: bool = opt(
        False,
        "Those safetensors are float8 with 128x128 block scales, dequantised on load; "
        "found from config.json's quantization_config without it",
    )
    last_save_model_only: bool = opt(
        True, "Also write the model alone (in export_dtype) beside the final, full save: step-N/model_only"
    )
    last_save_in_hf: bool = opt(
        False,
        "Write that export as Hugging Face safetensors with config.json, generation_config.json and the "
        "tokenizer files, in step-N beside the DCP files (needs last_save_model_only)",
    )
    export_dtype: str = opt(
        "auto",
        "Dtype of the model-only export; auto: the dtype of the Hugging Face folder the run started from "
        "(its config.json's), else float32",
        choices=("auto", "float16", "bfloat16", "float32"),
    )
    hf_export_lossy: bool = opt(
        False,
        "(Titan) Export to Hugging Face even a model whose trained state its format cannot hold (an MoE "
        "router's expert bias the family's config has no field for): it then routes some tokens to other "
        "experts; Titan keeps that state "
        "under titan.* keys for its own re-import",
    )
    hf_max_shard_bytes: int = opt(
        5 * 10**9,
        "(Titan) Largest safetensors file of a Hugging Face export, in bytes (transformers' default 5 GB); "
        "each rank writes the files of the tensors it holds",
        minimum=1,
        maximum=10**15,
    )
    async_mode: str = opt(
        "disabled",
        "disabled: training waits for each save; async: waits only for a copy to host memory; "
        "async_with_pinned_mem: the copy runs in the background too (pinned memory on CUDA)",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    exclude_from_loading: list[str] = opt(
        [],
        "States not to restore (comma-separated), e.g. dataloader,lr_scheduler: they start fresh",
        choices=("model", "optimizer", "lr_scheduler", "dataloader", "train_state"),
    )
    enable_first_step_checkpoint: bool = opt(False, "Also save after step 1, to prove saving works early")
    create_seed_checkpoint: bool = opt(
        False, "Write the initial model weights as step-0 and exit (one process, no parallelism)"
    )
    load_only: bool = opt(False, "Restore checkpoints but never save any")


@dataclass
class Comm:
    init_timeout_seconds: int = opt(
        300,
        "Timeout for process-group initialisation and the first collectives",
        minimum=1,
        maximum=MAX_SECONDS,
    )
    train_timeout_seconds: int = opt(
        100, "Timeout for collectives once training runs (NCCL)", minimum=1, maximum=MAX_SECONDS
    )
    trace_buf_size: int = opt(
        20000, "Flight-recorder entries kept per rank; 0: off", minimum=0, maximum=10**8
    )
    save_traces_folder: str = opt(
        "comm_traces", "Flight-recorder dump folder, under dump_folder", nonempty=True
    )
    save_traces_file_prefix: str = opt("rank_", "Flight-recorder dump file prefix")
    mode: str = opt(
        "default",
        "default: real communication; fake_backend: dry run that checks the layout for WORLD_SIZE (or NGPU) "
        "ranks without GPUs; local_tensor: simulate every rank in one process",
        choices=("default", "fake_backend", "local_tensor"),
    )


@dataclass
class MemoryEstimation:
    enable: bool = opt(False, "Log an estimate of memory per rank before training")
    disable_fake_mode: bool = opt(
        False, "Trace the memory estimate's step on real tensors (real memory and compute), not fake ones"
    )


@dataclass
class Experimental:
    custom_import: str = opt(
        "",
        "Module imported before the job is built (e.g. to register a model, flavor or dataset)",
        pattern=MODULE_NAME,
        sentinels=("",),
        check=lambda name: import_user_module("experimental.custom_import", name) if name else None,
    )


@dataclass
class Validation:
    enable: bool = opt(False, "Measure loss and perplexity on a validation set during training")
    dataset: str = opt("c4_validation", "Validation dataset name (see titan_data.DATASETS)", nonempty=True)
    dataset_path: str | None = opt(
        None,
        "Read the validation dataset from this local path",
        path="a dataset file or folder",
        needed_if="validation.enable",
    )
    dataset_split: str = opt(
        "",
        "(Titan) Split of the validation dataset to read (see training.dataset_split); empty: its default",
        pattern=SPLIT_NAME,
        sentinels=("",),
    )
    holdout_share: float = opt(
        0.0,
        "(Titan) Hold out this share of the training rows for validation instead of reading validation.dataset: "
        "rows split by number, never in both, the same on every rank and resume; 0: off",
        above=0,
        below=1,
        sentinels=(0.0,),
    )
    local_batch_size: int = opt(
        8, "Validation sequences per data-parallel rank per batch", minimum=1, maximum=MAX_SEQUENCES
    )
    seq_len: int = opt(
        2048,
        "Validation tokens per sequence; the model's rotary table covers the longer of it and training.seq_len",
        minimum=1,
        maximum=MAX_SEQ_LEN,
    )
    freq: int = opt(10, "Validate every this many steps", minimum=1, maximum=MAX_STEPS)
    steps: int = opt(
        -1,
        "Validation batches per run; -1: the whole set (ranks stop together)",
        minimum=1,
        maximum=MAX_STEPS,
        sentinels=(-1,),
    )
    dataloader: DataLoader = field(default_factory=DataLoader)


@dataclass
class Debug:
    seed: int | None = opt(
        None, "Seed for weight init and any randomness; None: 0", minimum=0, maximum=2**64 - 1
    )
    deterministic: bool = opt(False, "Use deterministic algorithms (slower)")
    deterministic_warn_only: bool = opt(False, "Only warn where an op has no deterministic implementation")
    moe_force_load_balance: bool = opt(False, "Route tokens to experts round-robin (MoE debugging)")


@dataclass
class JobConfig:
    """Every section of a job's TOML file; `titan-train --help` lists each field."""

    job: Job = field(default_factory=Job)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    comm: Comm = field(default_factory=Comm)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    experimental: Experimental = field(default_factory=Experimental)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)
    health: Health = field(default_factory=Health)
    lora: LoRA = field(default_factory=LoRA)
    sft: Sft = field(default_factory=Sft)
    preference: Preference = field(default_factory=Preference)
    grpo: GRPO = field(default_factory=GRPO)
