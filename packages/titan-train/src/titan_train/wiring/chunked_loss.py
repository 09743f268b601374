"""Cross-entropy over a large vocabulary in chunks of tokens: never the float32 [tokens x vocab] at once.

The plain loss upcasts the logits to float32 and keeps its log-softmax for backward: at seq 8192 and a
128K vocabulary that is two 4 GiB tensors per sequence besides the bf16 logits. This one keeps only the
logits and a float32 log-sum-exp per token; forward and backward each upcast one chunk at a time. The
arithmetic per token is the plain loss's, so loss and gradients agree to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_data import IGNORE_INDEX

CHUNK_TOKENS = 1024


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        keep = labels != IGNORE_INDEX
        targets = torch.where(keep, labels, 0)
        lse = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for s in range(0, labels.numel(), chunk):
            x = logits[s : s + chunk].float()
            lse[s : s + chunk] = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, targets[s : s + chunk, None]).squeeze(1)
            total += ((lse[s : s + chunk] - picked) * keep[s : s + chunk]).sum()
        count = keep.sum()
        ctx.save_for_backward(logits, targets, keep, lse, count)
        ctx.chunk = chunk
        return total / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, keep, lse, count = ctx.saved_tensors
        out = torch.empty_like(logits)
        # No trained label (a row whose trained turn was truncated away): every gradient is 0, as
        # F.cross_entropy's, not 0 * (1/0) = NaN.
        scale = grad / count.clamp_min(1)
        for s in range(0, targets.numel(), ctx.chunk):
            p = torch.exp(logits[s : s + ctx.chunk].float() - lse[s : s + ctx.chunk, None])
            p.scatter_add_(1, targets[s : s + ctx.chunk, None], -torch.ones_like(p[:, :1]))
            p *= (keep[s : s + ctx.chunk, None] * scale).float()
            out[s : s + ctx.chunk] = p.to(logits.dtype)
        return out, None, None


def chunked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, chunk: int = CHUNK_TOKENS
) -> torch.Tensor:
    """Mean next-token cross-entropy in float32, as `F.cross_entropy(logits.float(), labels)`, chunk by chunk.

    Vocabulary-sharded logits (a DTensor under loss parallelism) take the plain path: each rank holds
    1/tp of the vocabulary already, and the sharded loss needs DTensor's own kernels.
    """
    if isinstance(logits, DTensor):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
    return _ChunkedCrossEntropy.apply(logits.flatten(0, 1), labels.flatten(0, 1), chunk)
