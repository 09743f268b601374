"""The dtypes a run computes and keeps its parameters in, and the autocast around forward passes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from titan_parallel import ParallelDims
from titan_train.config.schema import JobConfig

logger = logging.getLogger(__name__)


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


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
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
