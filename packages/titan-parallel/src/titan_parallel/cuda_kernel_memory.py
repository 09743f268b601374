"""What CUDA kernels hold, for a memory trace that runs on fake CPU tensors.

A memory estimate traces the step on the CPU, but some ops keep different tensors for backward there
than on a GPU. `rms_norm` is one: on CUDA it is one fused kernel that saves its input and the
reciprocal RMS (float32, one value per row); on the CPU it decomposes into element-wise ops and also
saves the normalised input, one more activation-sized tensor per norm, which on an H200 made the
estimate of Llama 3.2 1B with no activation checkpointing 2 GiB (5%) too high (bench/RESULTS.md).
`use_cuda_kernel_memory` makes such ops of a model allocate and save what the CUDA kernel does; their
values are not computed, so it is for fake tensors only.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn


class _FusedRMSNorm(torch.autograd.Function):
    """The memory of CUDA's fused rms_norm: forward allocates the output and a float32 reciprocal RMS
    per row, and saves the input and that RMS; backward allocates the input's and the weight's grads."""

    @staticmethod
    def forward(ctx, x, weight, n_dims):
        stats = x[(..., *[slice(0, 1)] * n_dims)]
        rstd = torch.empty_like(stats, dtype=torch.float32)
        dtype = torch.promote_types(x.dtype, weight.dtype) if weight is not None else x.dtype
        out = torch.empty_like(x, dtype=dtype)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, _, weight = ctx.saved_tensors
        grad_weight = torch.empty_like(weight) if weight is not None else None
        return torch.empty_like(x), grad_weight, None


def use_cuda_kernel_memory(model: nn.Module) -> None:
    """Make the ops of `model` whose CUDA kernels save less than their CPU composites allocate and save
    as those kernels would. The model is then a memory model only: its outputs hold no values.

    Done on the modules (not by a torch function mode) so that activation checkpointing's recompute,
    which runs outside any mode, repeats the same ops.
    """
    for module in model.modules():
        if isinstance(module, nn.RMSNorm):
            module.forward = partial(_rms_norm_memory, module)


def _rms_norm_memory(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return _FusedRMSNorm.apply(x, norm.weight, len(norm.normalized_shape))
