"""The job configuration: torchtitan's TOML sections and field names, each with a default and help."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_train.config.fields import opt


@dataclass
class Job:
    config_file: str | None = opt(None, "TOML file to read before CLI overrides")
    dump_folder: str = opt("./outputs", "Folder for checkpoints, TensorBoard events, traces and the resolved config")
    description: str = opt("default job", "Free-text description of the job")
    print_config: bool = opt(False, "Log the resolved configuration at start")
    custom_config_module: str = opt("", "Python module whose JobConfig subclass extends the schema")


@dataclass
class Model:
    name: str = opt("llama3", "Model family, as registered in titan_train.registry")
    flavor: str = opt("debugmodel", "Model shape within the family (debugmodel, 8B, ...)")
    hf_assets_path: str = opt(
        "", "Folder with the tokenizer (and config/safetensors); empty: the bundled test tokenizer"
    )


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer", choices=("Adam", "AdamW"))
    lr: float = opt(8e-4, "Peak learning rate")
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    weight_decay: float = opt(0.1, "Decoupled weight decay (AdamW) or L2 penalty (Adam)")
    implementation: str = opt(
        "fused", "Kernel: fused or foreach (fused falls back to foreach on CPU)", choices=("fused", "foreach", "for-loop")
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "Steps of linear warmup from near zero to the peak lr")
    decay_ratio: float | None = opt(
        None, "Share of steps spent decaying at the end (warmup-stable-decay); None: decay right after warmup"
    )
    decay_type: str = opt("linear", "Shape of the decay", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = opt(0.0, "Final lr as a fraction of the peak lr")


@dataclass
class DataLoader:
    num_streams: int = opt(
        0,
        "Document streams the data is dealt into (0: one per data-parallel rank). Keep it fixed to get "
        "the same batches at any world size",
    )


@dataclass
class Training:
    dataset: str = opt("c4_test", "Dataset name (see titan_data.DATASETS)")
    dataset_path: str | None = opt(None, "Read the dataset from this local path instead of its default")
    local_batch_size: int = opt(8, "Sequences per data-parallel rank per micro-step")
    global_batch_size: int = opt(-1, "Sequences per optimizer step across ranks; -1: local_batch_size * dp")
    seq_len: int = opt(2048, "Tokens per sequence")
    max_norm: float = opt(1.0, "Gradient-norm clipping threshold")
    steps: int = opt(10000, "Optimizer steps to train")
    mixed_precision_param: str = opt(
        "bfloat16", "FSDP parameter dtype in compute (CPU runs keep float32)", choices=("bfloat16", "float32")
    )
    mixed_precision_reduce: str = opt("float32", "FSDP gradient reduction dtype", choices=("float32",))
    dataloader: DataLoader = field(default_factory=DataLoader)


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "Replicas of the model (HSDP/DDP)")
    data_parallel_shard_degree: int = opt(-1, "Ranks a replica is sharded over (FSDP); -1: the rest of the world")
    fsdp_reshard_after_forward: str = opt(
        "default", "Free gathered parameters after forward", choices=("default", "always", "never")
    )
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree")
    context_parallel_degree: int = opt(1, "Context-parallel degree")
    pipeline_parallel_degree: int = opt(1, "Pipeline-parallel degree")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints and resume from the newest one")
    folder: str = opt("checkpoint", "Checkpoint folder, under job.dump_folder")
    interval: int = opt(500, "Save every this many steps")
    keep_latest_k: int = opt(10, "Keep only the newest k checkpoints; 0 keeps all")


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics every this many steps")
    enable_tensorboard: bool = opt(False, "Write TensorBoard scalars")
    save_tb_folder: str = opt("tb", "TensorBoard folder, under job.dump_folder")
    disable_color_printing: bool = opt(False, "Plain log lines without ANSI colours")


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "Timeout for process-group initialisation and the first collectives")
    train_timeout_seconds: int = opt(100, "Timeout for collectives once training runs")


@dataclass
class Debug:
    seed: int | None = opt(None, "Seed for weight init and any randomness; None: 0")
    deterministic: bool = opt(False, "Use deterministic algorithms (slower)")


@dataclass
class JobConfig:
    """Every section of a job's TOML file; `titan-train --help` lists each field."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)
