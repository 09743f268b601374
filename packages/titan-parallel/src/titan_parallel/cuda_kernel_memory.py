"""What CUDA kernels hold, for a memory trace that runs on fake CPU tensors.

A memory estimate traces the step on the CPU, but some ops keep different tensors for backward there
than on a GPU. `rms_norm` is one: on CUDA it is one fused kernel that saves its input and the
reciprocal RMS (float32, one value per row); on the CPU it decomposes into element-wise ops and also
saves the normalised input, one more activation-sized tensor per norm, which on an H200 made the
estimate of Llama 3.2 1B with no activation checkpointing 2 GiB (5%) too high (bench/RESULTS.md).
`use_cuda_kernel_memory` makes such ops of a model allocate and save what the CUDA kernel does; their
values are not computed, so it is for fake tensors only.

Attention is the other. Where the query/key head dim differs from the value's (DeepSeek's latent
attention, 192 against 128) the CPU has no fused SDPA and its math path saves each head's score
matrix, while CUDA's kernels (memory-efficient SDPA, compiled flex attention for a block-causal
mask) save only the output and a logsumexp per row. On an H200 that made a 4-block DeepSeek-V2-Lite
estimate 1.5x the measured peak. `cuda_attention_memory` routes such SDPA calls to the kernel's
memory while a trace runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F
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


class _EfficientAttention(torch.autograd.Function):
    """The memory of CUDA's memory-efficient SDPA: forward allocates the output and a float32 logsumexp
    per query row (padded to 32) and saves q, k, v, the output and the logsumexp; backward allocates
    q's, k's and v's grads."""

    @staticmethod
    def forward(ctx, q, k, v):
        *lead, rows, _ = q.shape
        lse = q.new_empty((*lead, -(-rows // 32) * 32), dtype=torch.float32)
        out = q.new_empty((*lead, rows, v.shape[-1]))
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def cuda_attention_memory() -> Iterator[None]:
    """While open, SDPA calls with a value head dim other than the query's allocate and save what
    CUDA's fused kernels do; others are left to the CPU's flash kernel, which already saves what
    CUDA's does (the output and a logsumexp). Fake tensors only: no value is computed.

    A swap of the function rather than a torch function mode, so that activation checkpointing's
    recompute in the backward, which runs outside any mode, repeats the same ops.
    """
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.shape[-1] == v.shape[-1] or dropout_p or enable_gqa:
            return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        device = q.device.type
        if torch.is_autocast_enabled(device):  # autocast casts SDPA's inputs; the Function is not cast
            q, k, v = (t.to(torch.get_autocast_dtype(device)) for t in (q, k, v))
        return _EfficientAttention.apply(q, k, v)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


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
