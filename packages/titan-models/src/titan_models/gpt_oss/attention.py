"""gpt-oss attention: biased q/k/v/o projections, grouped-query heads, half-split YaRN rotary, and a
learned sink logit per head that joins each query's softmax denominator without contributing a value.

A head's weights over the keys are exp(s_j) / (exp(sink) + sum_k exp(s_k)), so a query may give less
than its whole attention to the keys. Two kernels compute it:
- flex attention (CUDA): the output of a plain softmax times sigmoid(lse - sink), where lse is the
  scores' log-sum-exp flex returns: that factor is exactly sum_k exp(s_k) / (exp(sink) + sum_k exp(s_k));
- an explicit softmax over the scores with the sink appended as one more column (CPU, or `sdpa`).

Under context parallelism neither goes through torch's ring attention (causal SDPA, no sink, no
window): each rank gathers the group's keys and values (`GptOssMasks.gather_kv`) and runs the same
kernel on its queries against the whole sequence, masked by global positions (`gpt_oss.masks`), so the
sink joins every query's full denominator and the window is exact across shard boundaries.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import BlockMask

from titan_models.attention import attention_tail, flex
from titan_models.cached_attention import HeadsCache
from titan_models.gpt_oss.args import GptOssArgs
from titan_models.gpt_oss.masks import GptOssMasks
from titan_models.half_split_rotary import apply_rotary_half_split


def sink_attention_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """(batch, heads, seq, head_dim) attention with per-head `sinks` (heads,) under a boolean `mask`
    (batch or 1, 1, seq, seq), computed in float32."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def sink_attention_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: BlockMask, scale: float
) -> torch.Tensor:
    """The same attention through flex attention and its log-sum-exp (natural log)."""
    out, lse = flex(q, k, v, mask, scale=scale, return_lse=True)
    keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1)).unsqueeze(-1)
    return (out.float() * keep).to(q.dtype)


class SinkWindowCache(HeadsCache):
    """gpt-oss's KV cache: sinks in the softmax denominator; windowed layers read only their last
    `window` slots.

    A row's real tokens fill consecutive slots, so a window of positions is a window of slots, the
    same for every row of a left-padded batch.
    """

    def first_slot(self, attention, start):
        return 0 if attention.window is None else max(0, start - attention.window + 1)

    def restrict(self, attention, mask, query_pos, key_pos):
        if attention.window is None:
            return mask
        return mask & ((query_pos[:, :, None] - key_pos[:, None, :]) < attention.window)[:, None]

    def project(self, attention, x, freqs_cis, positions):
        xq, xk, xv = attention.project(x, freqs_cis)
        return xq.transpose(1, 2), [xk.transpose(1, 2), xv.transpose(1, 2)]

    def attend(self, attention, q, k, v, mask):
        return sink_attention_eager(q, k, v, attention.local_sinks(), mask, attention.scale)


class GptOssAttention(nn.Module):
    """One layer's attention (torchtitan 0.2.2's names: `wq`, `wk`, `wv`, `wo` with biases, `sinks`)."""

    kv_cache = SinkWindowCache()

    def __init__(self, args: GptOssArgs, layer: int):
        super().__init__()
        self.head_dim = args.head_dim
        self.sliding = args.uses_sliding_window(layer)
        self.window = args.sliding_window_size if self.sliding else None
        self.scale = 1.0 / math.sqrt(args.head_dim)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=True)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=True)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=True)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=True)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))

    def project(
        self, x: torch.Tensor, freqs_cis: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys and the values (batch, seq, heads, head_dim): what the forward attends
        with and what the KV cache keeps."""
        bs, seq_len, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads (and of
        # the sinks, sharded alike by `gpt_oss.tensor_parallel_plan`).
        xq = self.wq(x).view(bs, seq_len, -1, self.head_dim)
        xk = self.wk(x).view(bs, seq_len, -1, self.head_dim)
        xv = self.wv(x).view(bs, seq_len, -1, self.head_dim)
        xq, xk = apply_rotary_half_split(xq, xk, freqs_cis)
        return xq, xk, xv

    def local_sinks(self) -> torch.Tensor:
        """This rank's sinks, one per head it holds."""
        return self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, masks: GptOssMasks) -> torch.Tensor:
        xq, xk, xv = self.project(x, freqs_cis)
        if masks.gather_kv is not None:  # context parallel: every rank's keys, rotated at their positions
            xk, xv = masks.gather_kv(xk, 1), masks.gather_kv(xv, 1)
        mask = masks.sliding if self.sliding else masks.full
        kernel = sink_attention_flex if isinstance(mask, BlockMask) else sink_attention_eager
        return attention_tail(self.wo, xq, xk, xv, kernel, self.local_sinks(), mask, self.scale)
