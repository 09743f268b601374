"""The routed experts: one SwiGLU per expert, weights stacked along a leading expert dimension.

Expert parallelism (titan-parallel) relies on this module's contract, which is model-agnostic:
parameters `w1` (E, hidden, dim), `w2` (E, dim, hidden), `w3` (E, hidden, dim), and
`forward(x, num_tokens_per_expert)` where the rows of `x` (T, dim) are grouped by expert in order
0..E-1, `num_tokens_per_expert` (E,) says how many rows each expert gets, and the result is (T, dim)
in the same row order. Under expert parallelism the weights may be DTensors sharded on dim 0; each
rank computes with its local experts on the rows it was sent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    `torch._grouped_mm`'s backward rejects gradients with zero strides (e.g. from `.sum()`).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm_applies(x: torch.Tensor, hidden_dim: int) -> bool:
    """Whether `torch._grouped_mm` takes these shapes: its operands' rows must be 16-byte aligned.

    On CUDA it runs a fused kernel for bf16 on sm90+, and torch's own per-group loop elsewhere
    (CPU included), so it is correct on every device; the layout is the only hard requirement.
    """
    size = x.element_size()
    return (x.shape[-1] * size) % 16 == 0 and (hidden_dim * size) % 16 == 0


def experts_grouped_mm(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """All experts' SwiGLU in three grouped matmuls over the expert-sorted rows of x."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
    # Rows past the last offset (padding an expert-parallel exchange may add) are left unwritten by the
    # kernel: zero them without a host sync.
    counted = torch.arange(x.shape[0], device=x.device) < offsets[-1]
    return _ContiguousGrad.apply(torch.where(counted.unsqueeze(-1), out, 0.0))


def experts_for_loop(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The same computation expert by expert (one host sync for the counts); the reference path."""
    sizes = counts.tolist()
    used = sum(sizes)
    outs = []
    for e, rows in enumerate(torch.split(x[:used], sizes, dim=0)):
        h = F.silu(rows @ w1[e].to(x.dtype).T) * (rows @ w3[e].to(x.dtype).T)
        outs.append(h @ w2[e].to(x.dtype).T)
    # Rows past the counted ones (padding an expert-parallel exchange may add) produce zeros.
    outs.append(x.new_zeros(x.shape[0] - used, x.shape[1]))
    return torch.cat(outs, dim=0)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU feed-forwards held as three stacked weights (torchtitan's names and shapes)."""

    # Which dim of each weight holds the hidden units, for titan-parallel's tensor-parallel split.
    tp_split_dims = {"w1": 1, "w2": 2, "w3": 1}

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """(T, dim) outputs for expert-grouped rows `x` (T, dim); see the module docstring."""
        # Expert parallelism exchanges a data-dependent number of rows, which DTensor cannot describe:
        # compute on the local experts' plain tensors.
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        # Autocast does not cast `torch._grouped_mm`'s operands: cast them as it casts a matmul's, so the
        # bf16 kernel runs under bf16 autocast (both paths then compute in the same precision).
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if self.use_grouped_mm and grouped_mm_applies(x, self.hidden_dim):
            return experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert)
        return experts_for_loop(w1, w2, w3, x, num_tokens_per_expert)
