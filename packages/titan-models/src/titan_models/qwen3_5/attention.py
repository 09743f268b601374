"""Qwen3.5's full-attention layers: grouped-query attention whose queries carry an output gate, per-head
zero-centred norms of queries and keys, and rotary embeddings on the first `rotary_dim` dimensions.

`wq` gives, per head, the query then its gate (Hugging Face's `q_proj` layout, so no permutation either
way); the attention's output is scaled by sigmoid(gate) before `wo`. Rotation is half-split over the
rotated part only, the rest of each head passes through.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.attention import attend, output_projection
from titan_models.cached_attention import HeadsCache
from titan_models.half_split_rotary import apply_rotary_half_split
from titan_models.qwen3_5.args import Qwen3_5Args
from titan_models.qwen3_5.norms import ZeroCentredRMSNorm


def apply_partial_rotary(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-split rotation of the first `rotary_dim` dimensions of (batch, seq, heads, head_dim) heads."""
    q_rot, k_rot = apply_rotary_half_split(xq[..., :rotary_dim], xk[..., :rotary_dim], freqs_cis)
    return torch.cat([q_rot, xq[..., rotary_dim:]], -1), torch.cat([k_rot, xk[..., rotary_dim:]], -1)


class GatedAttention(nn.Module):
    """Self-attention with an output gate per query dimension, QK norms and partial rotary embeddings."""

    def __init__(self, args: Qwen3_5Args):
        super().__init__()
        self.backend = args.attn_backend
        self.head_dim, self.rotary_dim = args.head_dim, args.rotary_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim * 2, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, eps=args.norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, eps=args.norm_eps)

    kv_cache: HeadsCache

    def project(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries, keys, values (batch, seq, heads, head_dim) and the gate logits (batch, seq,
        heads, head_dim)."""
        bs, seq, _ = x.shape
        xq, gate = self.wq(x).view(bs, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        xk = self.wk(x).view(bs, seq, -1, self.head_dim)
        xv = self.wv(x).view(bs, seq, -1, self.head_dim)
        xq, xk = apply_partial_rotary(self.q_norm(xq), self.k_norm(xk), freqs_cis, self.rotary_dim)
        return xq, xk, xv, gate

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim); `mask` is the model's `HybridMasks`."""
        xq, xk, xv, gate = self.project(x, freqs_cis)
        out = attend(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), self.backend, mask.attention)
        return output_projection(self.wo, out * gate.transpose(1, 2).sigmoid())


class GatedHeadsCache(HeadsCache):
    """Keys and values per head as Llama's; the gate rides behind each query (batch, heads, new,
    2 * head_dim) and scales the attention's output before `wo`."""

    def project(self, attention, x, freqs_cis, positions):
        xq, xk, xv, gate = attention.project(x, freqs_cis, positions)
        return torch.cat([xq, gate], -1).transpose(1, 2), [xk.transpose(1, 2), xv.transpose(1, 2)]

    def attend(self, attention, q, k, v, mask):
        q, gate = q.chunk(2, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return out * gate.sigmoid()


GatedAttention.kv_cache = GatedHeadsCache()
