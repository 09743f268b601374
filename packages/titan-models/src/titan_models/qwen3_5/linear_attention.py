"""Qwen3.5's Gated DeltaNet layer: projections, a short causal depthwise convolution, the gated delta
rule (`qwen3_5.gated_delta`), then a gated RMSNorm and the output projection.

`in_proj_qkv` (and the convolution's channels) are grouped by query/key head: for each key head its
query, its key, then the values of the value heads it serves (Hugging Face's file lists all queries, then
all keys, then all values: the mapping permutes the rows). A contiguous slice of rows is then a set of
whole head groups, so tensor parallelism splits the layer by head with plain column sharding
(`qwen3_5.tensor_parallel_plan`), and every size below is read from the local tensors.

Documents are `segments` (batch, seq) ids: the convolution does not reach across a change of segment and
the delta-rule state empties at one, so packed documents compute what each computes alone. Generation
keeps, per layer, the last `conv_kernel - 1` convolution inputs and the state (`RecurrentStateCache`)
instead of keys and values per slot.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_models.cached_attention import StateCache
from titan_models.qwen3_5.args import Qwen3_5Args
from titan_models.qwen3_5.gated_delta import chunked_gated_delta, recurrent_gated_delta
from titan_models.qwen3_5.norms import HeadRMSNorm


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor | None, window: int = 0
) -> torch.Tensor:
    """silu of the depthwise causal convolution of `x` (batch, seq, channels) by `weight` (channels, taps),
    each output reading only inputs of its own segment; the first `window` positions are context only
    and are not returned. Inputs before position 0 count as zero."""
    taps = weight.shape[-1]
    seq = x.shape[1]
    out = x * weight[:, taps - 1]
    for lag in range(1, taps):
        earlier = F.pad(x, (0, 0, lag, 0))[:, :seq]
        if segments is not None:
            same = F.pad(segments, (lag, 0), value=-2)[:, :seq] == segments
            earlier = earlier * same[..., None]
        out = out + earlier * weight[:, taps - 1 - lag]
    return F.silu(out[:, window:])


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a parameter tensor parallelism sharded by head (the whole tensor otherwise)."""
    return p.to_local() if isinstance(p, DTensor) else p


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def resets_of(segments: torch.Tensor | None, before: torch.Tensor | None = None) -> torch.Tensor | None:
    """(batch, seq) True where a token's segment differs from the one before it (`before`: the segment of
    the token preceding the first, None: no reset at the first)."""
    if segments is None:
        return None
    first = segments[:, :1] if before is None else before[:, None]
    return segments != torch.cat([first, segments[:, :-1]], dim=1)


class GatedDeltaNet(nn.Module):
    """One linear-attention token mixer, with Hugging Face's projection names (`in_proj_qkv` in head
    groups, see the module docstring) and Titan's `wo` for the output projection."""

    def __init__(self, args: Qwen3_5Args):
        super().__init__()
        self.key_heads, self.value_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.key_dim, self.value_dim = args.linear_key_head_dim, args.linear_value_head_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.conv_channels = 2 * keys + values
        self.in_proj_qkv = nn.Linear(args.dim, self.conv_channels, bias=False)
        self.in_proj_z = nn.Linear(args.dim, values, bias=False)
        self.in_proj_b = nn.Linear(args.dim, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(args.dim, self.value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_channels, args.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.empty(self.value_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads))
        self.norm = HeadRMSNorm(self.value_dim, eps=args.norm_eps)
        self.wo = nn.Linear(values, args.dim, bias=False)

    kv_cache: StateCache  # set below, once the class exists

    @property
    def conv_window(self) -> int:
        """How many earlier convolution inputs a token reads."""
        return self.conv_weight.shape[-1] - 1

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim); `mask` is the model's `HybridMasks` (its documents)."""
        shard = mask.sequence_shard if mask is not None else None
        if shard is None:
            return self.mix(x, mask.documents if mask is not None else None)[0]
        # Context parallelism: the state must run through the whole sequence in order. Every rank gathers
        # it (its backward sums each rank's gradients back to the sender), runs the layer, keeps its tokens.
        order = torch.argsort(shard.all_positions().to(x.device))
        whole = shard.gather(x, 1)[:, order]
        return self.mix(whole, None)[0][:, shard.positions.to(x.device)]

    def mix(
        self,
        x: torch.Tensor,
        segments: torch.Tensor | None,
        window: torch.Tensor | None = None,
        window_segments: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        recurrent: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's output, the last `conv_window` convolution inputs and the final state.

        `window` (batch, conv_window, channels) and `window_segments` are the inputs before `x` and their
        segments (generation); `state` the delta-rule state after them, which belongs to the last window
        segment. `recurrent` runs the rule token by token instead of by chunks.
        """
        bs, seq, _ = x.shape
        qkv = self.in_proj_qkv(x)
        before = None
        if window is not None:
            qkv = torch.cat([window.to(qkv.dtype), qkv], dim=1)
            segments = torch.cat([window_segments, segments], dim=1)
            before = segments[:, self.conv_window - 1]
        conv = _local(self.conv_weight)
        mixed = causal_conv(qkv, conv, segments, self.conv_window if window is not None else 0)
        if window is not None:
            segments = segments[:, self.conv_window :]
        per_key = self.value_heads // self.key_heads
        groups = mixed.view(bs, seq, -1, 2 * self.key_dim + per_key * self.value_dim)
        q, k, v = groups.split([self.key_dim, self.key_dim, per_key * self.value_dim], dim=-1)
        q = _l2_normalised(q.float()) / math.sqrt(self.key_dim)
        k = _l2_normalised(k.float())
        q, k = q.repeat_interleave(per_key, dim=2), k.repeat_interleave(per_key, dim=2)
        v = v.reshape(bs, seq, -1, self.value_dim)
        beta = self.in_proj_b(x).float().sigmoid()
        a = self.in_proj_a(x).float() + _local(self.dt_bias).float()
        g = -_local(self.A_log).float().exp() * F.softplus(a)
        rule = recurrent_gated_delta if recurrent else chunked_gated_delta
        out, state = rule(q, k, v, g, beta, resets_of(segments, before), state)
        z = self.in_proj_z(x).view(bs, seq, -1, self.value_dim)
        out = (self.norm(out.to(x.dtype)) * F.silu(z.float())).to(x.dtype).reshape(bs, seq, -1)
        return self.wo(out), qkv[:, -self.conv_window :], state


class RecurrentStateCache(StateCache):
    """Per layer: the last convolution inputs (batch, conv_window, channels) and the delta-rule state
    (batch, value_heads, key_dim, value_dim), float32. Left padding is a segment of its own (-1), so a
    padded row computes what it would alone."""

    def buffers(
        self, attention: GatedDeltaNet, batch: int, max_len: int, dtype, device
    ) -> list[torch.Tensor]:
        a = attention
        return [
            torch.zeros(batch, a.conv_window, _local(a.conv_weight).shape[0], dtype=dtype, device=device),
            torch.zeros(batch, a.value_heads, a.key_dim, a.value_dim, dtype=torch.float32, device=device),
        ]

    def step(
        self, attention: GatedDeltaNet, x: torch.Tensor, buffers, segments: torch.Tensor
    ) -> torch.Tensor:
        window, state = buffers
        w = attention.conv_window
        out, new_window, new_state = attention.mix(
            x, segments[:, w:], window, segments[:, :w], state, recurrent=x.shape[1] == 1
        )
        window.copy_(new_window)
        state.copy_(new_state)
        return out

    def context(self, attention: GatedDeltaNet) -> int:
        return attention.conv_window


GatedDeltaNet.kv_cache = RecurrentStateCache()
