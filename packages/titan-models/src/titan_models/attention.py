"""Grouped-query self-attention and its attention backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.args import ModelArgs
from titan_models.rope import apply_rotary

ATTENTION_BACKENDS = ("sdpa",)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand (batch, seq, kv_heads, head_dim) to n_rep times the heads, for GQA."""
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and grouped-query heads."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.attn_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"model: attn_backend '{args.attn_backend}' is unknown; choose one of {ATTENTION_BACKENDS}"
            )
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seq_len, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        xq = self.wq(x).view(bs, seq_len, -1, self.head_dim)
        xk = self.wk(x).view(bs, seq_len, -1, self.head_dim)
        xv = self.wv(x).view(bs, seq_len, -1, self.head_dim)
        xq, xk = apply_rotary(xq, xk, freqs_cis)
        n_rep = xq.shape[2] // xk.shape[2]
        xk, xv = _repeat_kv(xk, n_rep), _repeat_kv(xv, n_rep)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))
