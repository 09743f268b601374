"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention with low-rank query and key/value latents."""

from __future__ import annotations

import torch
from torch import nn

from titan_models.attention import attend, attention_tail, fold_max_logits
from titan_models.attention_masks import AttentionMask
from titan_models.cached_attention import HeadsCache
from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.rope import apply_rotary


class LatentCache(HeadsCache):
    """MLA's KV cache: the normalised latent `kv_norm(c_kv)` (batch, slot, kv_lora_rank) and the
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


class MultiHeadLatentAttention(nn.Module):
    """Keys and values are expanded per head from one shared latent of rank `kv_lora_rank`; the rotated
    part of the key (`qk_rope_head_dim`) is computed once and shared by every head.

    Parameter names are torchtitan 0.2.2's: `wq` (or `wq_a`, `q_norm`, `wq_b`), `wkv_a`, `kv_norm`,
    `wkv_b`, `wo`. Rows of `wq`/`wq_b` are head by head, each `qk_nope_head_dim` rows of q_nope then
    `qk_rope_head_dim` of q_pe; rows of `wkv_b` head by head, k_nope then v; the last `qk_rope_head_dim`
    rows of `wkv_a` are the shared rotary key. QK-clip reads that layout (`query_key_up_projections`).
    """

    kv_cache = LatentCache()

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.backend = args.attn_backend
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
        )
        self.n_heads = args.n_heads
        qk_dim = args.qk_head_dim
        latent_eps = args.norm_eps if args.latent_norm_eps is None else args.latent_norm_eps
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(self.q_lora_rank, eps=latent_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, args.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=latent_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        # A hook point with no parameters: tensor parallelism sums the shared rotary key's gradient here.
        self.shared_rope_key = nn.Identity()
        # The kernels scale scores by 1/sqrt(qk_dim); folding the ratio into q gives YaRN's scale instead.
        self.q_factor = args.softmax_scale * qk_dim**0.5
        # Largest pre-softmax logit per query head since last filled with -inf, while recording (QK-clip).
        self.max_logits: torch.Tensor | None = None

    def project(
        self, x: torch.Tensor, freqs_cis: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (batch, seq, heads, qk_head_dim), already scaled; the normalised key/value latent
        (batch, seq, kv_lora_rank); the rotated key part every head shares (batch, seq, 1, rope_dim).

        The latent and the shared key part are all that keys and values are made of (`expand`): a KV
        cache keeps these two and not the per-head keys and values.
        """
        bs, seq_len, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = q.view(bs, seq_len, -1, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = apply_rotary(q_pe, self.shared_rope_key(k_pe).unsqueeze(2), freqs_cis)
        q = torch.cat([q_nope, q_pe], dim=-1) * self.q_factor
        return q, self.kv_norm(kv), k_pe

    def expand(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys (batch, seq, heads, qk_head_dim) and values (batch, seq, heads, v_head_dim)."""
        bs, seq_len, _ = latent.shape
        kv = self.wkv_b(latent).view(bs, seq_len, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return k, v

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        q, latent, k_pe = self.project(x, freqs_cis)
        k, v = self.expand(latent, k_pe)
        if self.max_logits is not None and torch.is_grad_enabled():  # training passes, not validation
            # q carries the softmax scale times sqrt(qk_dim), which the kernels divide out again.
            fold_max_logits(self.max_logits, q, k, mask, q.shape[-1] ** -0.5)
        return attention_tail(self.wo, q, k, v, attend, self.backend, mask)

    def record_max_logits(self, on: bool) -> None:
        """Keep (or stop keeping) the largest logit per query head, the whole of
        softmax_scale * (q_nope.k_nope + q_pe.k_pe), in `max_logits`."""
        device = self.wkv_b.weight.device
        self.max_logits = torch.full((self.n_heads,), -torch.inf, device=device) if on else None

    def query_key_up_projections(self) -> tuple[nn.Parameter, nn.Parameter]:
        """The weights whose rows make each head's query (`wq`, or `wq_b` after the query latent's norm:
        q_nope rows then q_pe rows per head) and its own key part (`wkv_b`: k_nope rows then v rows per
        head). The shared rotary key (`wkv_a`'s last rows) is in neither."""
        query = self.wq if self.q_lora_rank == 0 else self.wq_b
        return query.weight, self.wkv_b.weight
