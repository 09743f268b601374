"""The model a config describes, as this rank holds it: built, parallelised, initialised; and its loss."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_data import Tokenizer
from titan_models import count_parameters
from titan_parallel import ParallelDims, ParallelOptions, Pipeline, blocks_of
from titan_train.config import JobConfig
from titan_train.errors import ConfigError
from titan_train.registry import ModelSpec, cross_entropy_loss
from titan_train.wiring.chunked_loss import chunked_cross_entropy
from titan_train.wiring.hf_interop import model_args
from titan_train.wiring.parallelism import parallel_options, split_and_wrap
from titan_train.wiring.sequence_limit import model_seq_len

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model split into what pipeline stages hold."""

    total: int
    embedding: int
    per_block: int
    n_blocks: int

    @classmethod
    def of(cls, model: nn.Module, blocks: dict[str, nn.Module], embedding: int) -> ParamCounts:
        """Counts read from a (meta-device) model and its repeated blocks."""
        sizes = [sum(p.numel() for p in block.parameters()) for block in blocks.values()]
        total = sum(p.numel() for p in model.parameters())
        return cls(total=total, embedding=embedding, per_block=max(sizes, default=0), n_blocks=len(sizes))


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class BuiltModel:
    """The model as this rank holds it, with the whole model's sizes (for FLOPs and memory estimates).

    `loss_fn` is the configured loss (validation's); `train_loss_fn` the one each micro-batch
    backpropagates, scaled for gradient accumulation (see `micro_batch_loss`), and the pipeline's."""

    args: Any
    parts: list[nn.Module]
    pipeline: Pipeline | None
    options: ParallelOptions
    n_params: int
    n_embedding: int
    counts: ParamCounts
    loss_fn: LossFn
    train_loss_fn: LossFn


def build_model(
    config: JobConfig,
    spec: ModelSpec,
    tokenizer: Tokenizer,
    dims: ParallelDims,
    device: torch.device,
    seed: int,
    grad_accum_steps: int = 1,
    *,
    drill: Callable[[LossFn], LossFn] | None = None,
    n_layers: int | None = None,
    dtype_device: torch.device | None = None,
    materialize: bool = True,
) -> BuiltModel:
    """The model on the meta device, parallelised (or cut into pipeline stages), then materialised on
    `device` and initialised: the initial weights are the same for every layout. `drill` wraps the
    training loss for a `[health] drill = nan` (see `StepGuard.drilled`).

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
        _cast_parameters(model, dtype_of(config.training.dtype))
    n_params = count_parameters(model)
    n_embedding = n_params - count_parameters(model, exclude_embedding=True)
    counts = ParamCounts.of(model, blocks_of(model), n_embedding)
    options = parallel_options(
        config, compute_dtype(config, dtype_device or device) if dims.fsdp_enabled else torch.float32,
        dtype_of(config.training.mixed_precision_reduce),
    )  # fmt: skip
    dims.check_model(
        n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.kv_heads, seq_len=config.training.seq_len,
        vocab_size=args.vocab_size, sequence_parallel=options.sequence_parallel,
    )  # fmt: skip
    loss_fn = build_loss_fn(config, spec)
    train_loss_fn = micro_batch_loss(loss_fn, grad_accum_steps)
    if drill is not None:
        train_loss_fn = drill(train_loss_fn)
    wrapped = split_and_wrap(
        model,
        dims,
        options,
        loss_fn=train_loss_fn,
        eval_loss_fn=loss_fn,
        device=device,
        local_batch_size=config.training.local_batch_size,
    )
    for part in wrapped.parts:
        if materialize:
            part.to_empty(device=device)
            part.init_weights(buffer_device=device, seed=seed)
        part.train()
    return BuiltModel(
        args, wrapped.parts, wrapped.pipeline, options, n_params, n_embedding, counts, loss_fn, train_loss_fn
    )


def micro_batch_loss(loss_fn: LossFn, grad_accum_steps: int) -> LossFn:
    """The loss one of `grad_accum_steps` micro-batches backpropagates: 1/N of `loss_fn`'s, so the step's
    gradients add up to those of the whole batch's mean. The one place training scales its loss, for
    the plain step and the pipeline alike."""

    def scaled(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, labels) / grad_accum_steps

    return scaled


def build_loss_fn(config: JobConfig, spec: ModelSpec) -> Callable:
    """The model's loss, compiled when `[compile] components` names "loss", else chunked over tokens
    (`training.chunked_loss`, see `chunked_loss`) where it is the plain cross-entropy.

    Compiled, the float32 upcast, log-softmax and gather over the vocabulary fuse into a few kernels
    that never hold the float32 logits: at seq 8192 and a 128K vocabulary, 4 GiB less per sequence
    (measured on an H100 in bench/RESULTS.md).
    """
    c = config.compile  # its components were checked against their choices by validate_config
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


def compute_dtype(config: JobConfig, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: mixed_precision_param, except on CPU where bfloat16 kernels are unreliable."""
    if config.training.dtype == "bfloat16":
        return torch.bfloat16
    dtype = dtype_of(config.training.mixed_precision_param)
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
    dtype = dtype_of(config.training.mixed_precision_param)
    return None if dtype == torch.float32 else dtype


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Full low-precision training: parameters (so gradients and optimizer state) in `dtype`; buffers
    such as the rotary table stay float32."""
    cast: dict[int, nn.Parameter] = {}  # tied weights stay tied
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in cast:
                cast[id(param)] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
            setattr(module, name, cast[id(param)])


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
