"""Builders that map config sections onto each library's own small, typed arguments."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from titan_data import Tokenizer, TokenLoader, build_dataset, build_tokenizer
from titan_models import count_parameters
from titan_parallel import ParallelDims, ParallelOptions, Pipeline, blocks_of
from titan_train.chunked_loss import chunked_cross_entropy
from titan_train.config import JobConfig
from titan_train.config.parallel_sections import COMPILE_COMPONENTS
from titan_train.errors import ConfigError
from titan_train.hf_interop import model_args
from titan_train.lr_schedule import build_lr_scheduler
from titan_train.memory_estimate import ParamCounts
from titan_train.parallelism import parallel_options, split_and_wrap
from titan_train.registry import ModelSpec, cross_entropy_loss
from titan_train.sequence_limit import model_seq_len

logger = logging.getLogger(__name__)

BUNDLED_TOKENIZER = Path(__import__("titan_data").__file__).parent / "assets" / "tokenizer"


def build_parallel_dims(config: JobConfig, world_size: int) -> ParallelDims:
    p = config.parallelism
    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        world_size=world_size,
    )


def build_tokenizer_for(config: JobConfig) -> Tokenizer:
    return build_tokenizer(config.model.hf_assets_path or BUNDLED_TOKENIZER)


@dataclass
class BuiltModel:
    """The model as this rank holds it, with the whole model's sizes (for FLOPs and memory estimates)."""

    args: Any
    parts: list[nn.Module]
    pipeline: Pipeline | None
    options: ParallelOptions
    n_params: int
    n_embedding: int
    counts: ParamCounts


def build_model(
    config: JobConfig,
    spec: ModelSpec,
    tokenizer: Tokenizer,
    dims: ParallelDims,
    device: torch.device,
    seed: int,
    grad_accum_steps: int = 1,
    *,
    n_layers: int | None = None,
    dtype_device: torch.device | None = None,
    materialize: bool = True,
) -> BuiltModel:
    """The model on the meta device, parallelised (or cut into pipeline stages), then materialised on
    `device` and initialised: the initial weights are the same for every layout.

    A memory trace builds it with fewer blocks (`n_layers`) and chooses dtypes as on the GPU it plans
    for (`dtype_device`), and without `materialize` leaves it on the meta device, to be moved onto
    fake tensors under torch's `FakeTensorMode`."""
    overrides = {} if n_layers is None else {"n_layers": n_layers}
    args = model_args(config, max_seq_len=model_seq_len(config), eos_id=tokenizer.eos_id, **overrides)
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"config: the tokenizer has {tokenizer.vocab_size} tokens but {spec.name} {config.model.flavor} has a "
            f"vocabulary of {args.vocab_size}; use a matching model.flavor or model.hf_assets_path"
        )
    with torch.device("meta"):
        model = spec.build(args)
    if config.training.dtype != "float32":
        _cast_parameters(model, _dtype(config.training.dtype))
    n_params = count_parameters(model)
    n_embedding = n_params - count_parameters(model, exclude_embedding=True)
    counts = ParamCounts.of(model, blocks_of(model), n_embedding)
    options = parallel_options(
        config, compute_dtype(config, dtype_device or device) if dims.fsdp_enabled else torch.float32,
        _dtype(config.training.mixed_precision_reduce),
    )  # fmt: skip
    dims.check_model(
        n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.kv_heads, seq_len=config.training.seq_len,
        vocab_size=args.vocab_size, sequence_parallel=options.sequence_parallel,
    )  # fmt: skip
    # Under gradient accumulation each micro-batch's loss counts 1/N of the step's (the pipeline divides).
    wrapped = split_and_wrap(
        model,
        dims,
        options,
        loss_fn=build_loss_fn(config, spec),
        device=device,
        local_batch_size=config.training.local_batch_size,
        accumulation_steps=grad_accum_steps,
    )
    for part in wrapped.parts:
        if materialize:
            part.to_empty(device=device)
            part.init_weights(buffer_device=device, seed=seed)
        part.train()
    return BuiltModel(args, wrapped.parts, wrapped.pipeline, options, n_params, n_embedding, counts)


def build_loss_fn(config: JobConfig, spec: ModelSpec) -> Callable:
    """The model's loss, compiled when `[compile] components` names "loss", else chunked over tokens
    (`training.chunked_loss`, see `chunked_loss`) where it is the plain cross-entropy.

    Compiled, the float32 upcast, log-softmax and gather over the vocabulary fuse into a few kernels
    that never hold the float32 logits: at seq 8192 and a 128K vocabulary, 4 GiB less per sequence
    (measured on an H100 in bench/RESULTS.md).
    """
    c = config.compile
    unknown = sorted(set(c.components) - set(COMPILE_COMPONENTS))
    if unknown:
        raise ConfigError(
            f"config: compile.components {unknown} unknown; choose from {list(COMPILE_COMPONENTS)}"
        )
    if c.enable:
        check_compile_backend(c.backend)
    if c.enable and "loss" in c.components:
        return torch.compile(spec.loss_fn, backend=c.backend)
    if config.training.chunked_loss and spec.loss_fn is cross_entropy_loss:
        return chunked_cross_entropy
    return spec.loss_fn


def check_compile_backend(backend: str) -> None:
    """Refuse a `compile.backend` torch does not know before the first step, not at the first compile.

    Checked when the run is built, after `experimental.custom_import`, which may register a backend.
    """
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(
            f"config: compile.backend = {backend!r} is not a torch.compile backend; choose one of {', '.join(known)} "
            "or register yours (torch._dynamo.register_backend) in an experimental.custom_import module"
        )


def build_optimizer(config: JobConfig, model: nn.Module | list[nn.Parameter]) -> torch.optim.Optimizer:
    """The configured optimizer over a model part's parameters (or a list of them)."""
    o = config.optimizer
    cls = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}[o.name]
    impl = o.implementation
    kwargs = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
    kwargs["fused"] = impl == "fused"  # CUDA and CPU both have fused Adam kernels
    kwargs["foreach"] = impl == "foreach"
    params = list(model.parameters()) if isinstance(model, nn.Module) else model
    if impl == "fused":
        _check_fused_kernel(o.name, {p.device.type for p in params})
    return cls(params, **kwargs)


def _check_fused_kernel(name: str, device_types: set[str]) -> None:
    """Refuse `implementation = "fused"` where torch has no fused kernel, rather than let the first
    step fail or fall back to another implementation without a word."""
    supported = _get_fused_kernels_supported_devices()
    missing = sorted(device_types - set(supported))
    if missing:
        raise ConfigError(
            f"config: optimizer.implementation = 'fused': torch has no fused {name} kernel on {', '.join(missing)} "
            f"(it has one on {', '.join(supported)}); set optimizer.implementation = 'foreach' or 'for-loop'"
        )


def build_lr_schedule(config: JobConfig, optimizer: torch.optim.Optimizer):
    s = config.lr_scheduler
    return build_lr_scheduler(
        optimizer,
        total_steps=s.total_steps or config.training.steps,
        warmup_steps=s.warmup_steps,
        decay_ratio=s.decay_ratio,
        decay_type=s.decay_type,
        min_lr_factor=s.min_lr_factor,
    )


def build_loader(config: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int) -> TokenLoader:
    return _token_loader(config.training, tokenizer, dp_rank, dp_degree, infinite=True)


def build_validation_loader(
    config: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int
) -> TokenLoader:
    """One pass over the validation set (not looping), dealt over data-parallel ranks like training data."""
    return _token_loader(config.validation, tokenizer, dp_rank, dp_degree, infinite=False)


def _token_loader(
    section, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, *, infinite: bool
) -> TokenLoader:
    """A loader for `[training]` or `[validation]`: both name dataset, path, seq_len, batch size and streams."""
    dataset = build_dataset(
        section.dataset,
        section.dataset_path,
        tokenizer,
        section.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_degree,
        num_streams=section.dataloader.num_streams,
        infinite=infinite,
    )
    d = section.dataloader
    return TokenLoader(
        dataset, batch_size=section.local_batch_size, num_workers=d.num_workers,
        pin_memory=d.pin_memory and _pinning_applies(section), persistent_workers=d.persistent_workers,
        prefetch_factor=d.prefetch_factor,
    )  # fmt: skip


def _pinning_applies(section) -> bool:
    """Pinned (page-locked) batches speed up copies to an accelerator; without one, batches already sit in
    the memory the CPU trains from, so there is nothing to pin: said once, at start."""
    if torch.accelerator.is_available():
        return True
    logger.warning(
        "%s.dataloader.pin_memory: no accelerator here, so batches stay in ordinary host memory, which the "
        "CPU reads directly (pinning only speeds up copies to a GPU)",
        "validation" if hasattr(section, "freq") else "training",
    )
    return False


def compute_dtype(config: JobConfig, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: mixed_precision_param, except on CPU where bfloat16 kernels are unreliable."""
    if config.training.dtype == "bfloat16":
        return torch.bfloat16
    dtype = _dtype(config.training.mixed_precision_param)
    if device.type == "cpu" and dtype != torch.float32:
        logger.warning(
            "training.mixed_precision_param=%s is kept as float32 on CPU",
            config.training.mixed_precision_param,
        )
        return torch.float32
    return dtype


def forward_context(
    config: JobConfig, dims: ParallelDims, device: torch.device
) -> Callable[[], AbstractContextManager]:
    """Mixed precision without FSDP (one GPU): autocast around forward; FSDP casts parameters itself."""
    dtype = autocast_dtype(config, dims, device)
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def autocast_dtype(config: JobConfig, dims: ParallelDims, device: torch.device) -> torch.dtype | None:
    """The dtype forward passes autocast to on `device`, or None where they do not autocast."""
    if dims.fsdp_enabled or config.training.dtype != "float32" or device.type == "cpu":
        return None
    dtype = _dtype(config.training.mixed_precision_param)
    return None if dtype == torch.float32 else dtype


def gradient_accumulation_steps(config: JobConfig, dp_degree: int) -> int:
    t = config.training
    per_step = t.local_batch_size * dp_degree
    if t.global_batch_size < 0:
        return 1
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"config: training.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"local_batch_size ({t.local_batch_size}) * data-parallel degree ({dp_degree}) = {per_step}"
        )
    return t.global_batch_size // per_step


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Full low-precision training: parameters (so gradients and optimizer state) in `dtype`; buffers
    such as the rotary table stay float32."""
    cast: dict[int, nn.Parameter] = {}  # tied weights stay tied
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in cast:
                cast[id(param)] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
            setattr(module, name, cast[id(param)])


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
