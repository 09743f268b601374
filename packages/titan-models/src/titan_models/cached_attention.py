"""What an attention keeps in a KV cache and how it attends over it: the hook each attention class brings.

`titan_models.kv_cache` runs one cached attention for every family: project the new tokens, write
what the attention caches, read the keys and values back, mask, attend, `wo`. The projections are the
attention module's own (`project`, the function its training forward calls). An attention class names
its hook in a class attribute, `kv_cache` (`CachedAttention`), so the cache imports no family; a hook
says only what differs from `HeadsCache`:
- Llama, Qwen3 (and any attention whose `project` gives per-head queries, keys and values): `HeadsCache`;
- Llama 4: rope layers attend within their chunk of positions, the no-rope layers' temperature
  scale follows each row's own positions (`titan_models.llama4.model.ChunkedHeadsCache`);
- gpt-oss: the sink joins the softmax denominator, even layers see only the last `window`
  positions (`titan_models.gpt_oss.attention.SinkWindowCache`);
- DeepSeek-V3 (MLA): the compressed latent (`titan_models.deepseek_v3.attention.LatentCache`).

A recurrent layer (Qwen3.5's Gated DeltaNet) keeps no keys per slot: its hook is a `StateCache`, fixed-size
buffers its own `step` reads and updates (`titan_models.qwen3_5.linear_attention.RecurrentStateCache`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn


class HeadsCache:
    """Keys and values per key/value head, (batch, kv_heads, slot, head_dim) each: Llama and Qwen3."""

    def buffers(
        self, attention: nn.Module, batch: int, max_len: int, dtype: torch.dtype, device
    ) -> list[torch.Tensor]:
        """The zeroed buffers of one layer: `shapes` with `max_len` slots second to last."""
        return [
            torch.zeros(batch, *shape[:-1], max_len, shape[-1], dtype=dtype, device=device)
            for shape in self.shapes(attention)
        ]

    def shapes(self, attention: nn.Module) -> list[tuple[int, ...]]:
        """The shape of each cached tensor, the slot dimension left out (it goes second to last)."""
        heads = attention.wk.out_features // attention.head_dim
        return [(heads, attention.head_dim)] * 2

    def project(
        self, attention: nn.Module, x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Queries (batch, heads, new, dim) and the tensors to cache for the new tokens."""
        xq, xk, xv = attention.project(x, freqs_cis, positions)
        return xq.transpose(1, 2), [xk.transpose(1, 2), xv.transpose(1, 2)]

    def keys_values(self, attention: nn.Module, cached: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(batch, heads, slots, dim) keys and values from the cached slots."""
        return cached[0], cached[1]

    def first_slot(self, attention: nn.Module, start: int) -> int:
        """The oldest slot any of the new queries (from slot `start`) can see."""
        return 0

    def restrict(
        self, attention: nn.Module, mask: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor
    ) -> torch.Tensor:
        """The family's own limit on the causal mask (batch, 1, new, slots), by position."""
        return mask

    def attend(
        self, attention: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class StateCache:
    """The hook of a recurrent layer: buffers of a fixed size, whatever the length, and the step that
    reads and updates them for the new tokens."""

    def buffers(
        self, attention: nn.Module, batch: int, max_len: int, dtype: torch.dtype, device
    ) -> list[torch.Tensor]:
        raise NotImplementedError

    def context(self, attention: nn.Module) -> int:
        """How many slots before the new tokens `step` is given the segments of."""
        raise NotImplementedError

    def step(
        self, attention: nn.Module, x: torch.Tensor, buffers: list[torch.Tensor], segments: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output for the new tokens `x` (batch, new, dim). `segments` (batch, context + new):
        each slot's document id, -1 for left padding and for slots before the first."""
        raise NotImplementedError


@runtime_checkable
class CachedAttention(Protocol):
    """An attention module the KV cache can run: it names its hook (an instance shared by the class)."""

    kv_cache: HeadsCache | StateCache


def cache_hook(attention: nn.Module) -> HeadsCache | StateCache:
    """The hook `attention` brings (see `CachedAttention`)."""
    return attention.kv_cache
