"""What each family's attention keeps in a KV cache and how it attends over it.

`titan_models.kv_cache` runs one cached attention for every family: project the new tokens, write
what the family caches, read the keys and values back, mask, attend, `wo`. The projections are the
attention module's own (`project`, the function its training forward calls); a family's hook
names only what differs:
- Llama, Qwen3: keys and values per key/value head (Qwen3's QK norm is inside its `project`);
- Llama 4: rope layers attend within their chunk of positions, the no-rope layers' temperature
  scale follows each row's own positions;
- gpt-oss: the sink joins the softmax denominator, even layers see only the last `window`
  positions (older slots are not even read);
- DeepSeek-V3 (MLA): the compressed latent, see `LatentCache`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.deepseek_v3.attention import MultiHeadLatentAttention
from titan_models.gpt_oss.attention import GptOssAttention, sink_attention_eager
from titan_models.llama4.model import Llama4Attention


class HeadsCache:
    """Keys and values per key/value head, (batch, kv_heads, slot, head_dim) each: Llama and Qwen3."""

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


class ChunkedHeadsCache(HeadsCache):
    """Llama 4: a rope layer with `attn_chunk_size` sees only keys of its query's chunk of positions."""

    def restrict(self, attention, mask, query_pos, key_pos):
        if attention.chunk is None:
            return mask
        same = (query_pos[:, :, None] // attention.chunk) == (key_pos[:, None, :] // attention.chunk)
        return mask & same[:, None]


class SinkWindowCache(HeadsCache):
    """gpt-oss: sinks in the softmax denominator; windowed layers read only their last `window` slots.

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


class LatentCache(HeadsCache):
    """DeepSeek-V3's MLA: the normalised latent `kv_norm(c_kv)` (batch, slot, kv_lora_rank) and the
    rotated shared key part `k_pe` (batch, slot, rope_dim), expanded to per-head keys and values by
    the layer's own `wkv_b` at every step.

    Why not per-head keys and values: MLA exists to make this cache small. Every head's key and value
    is a linear function (`wkv_b`) of one latent, and the rotated key part is one vector shared by all
    heads, so a slot holds kv_lora_rank + rope_dim numbers (576 in DeepSeek-V3) instead of
    heads * (qk_head_dim + v_head_dim) (128 * 320 = 40960): 71 times less memory, for one `wkv_b`
    matmul over the cached slots a step. `k_pe` is cached after its rotation, at its own position.
    """

    def shapes(self, attention):
        return [(attention.kv_lora_rank,), (attention.rope_dim,)]

    def project(self, attention, x, freqs_cis, positions):
        q, latent, k_pe = attention.project(x, freqs_cis)
        return q.transpose(1, 2), [latent, k_pe.squeeze(2)]

    def keys_values(self, attention, cached):
        k, v = attention.expand(cached[0], cached[1].unsqueeze(2))
        return k.transpose(1, 2), v.transpose(1, 2)


_HOOKS: list[tuple[type, HeadsCache]] = [
    (MultiHeadLatentAttention, LatentCache()),
    (GptOssAttention, SinkWindowCache()),
    (Llama4Attention, ChunkedHeadsCache()),
]


def cache_hook(attention: nn.Module) -> HeadsCache:
    """The hook of `attention`'s family (Llama's and Qwen3's `Attention` subclasses: `HeadsCache`)."""
    for cls, hook in _HOOKS:
        if isinstance(attention, cls):
            return hook
    return HeadsCache()
