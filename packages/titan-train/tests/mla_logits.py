"""MLA's attention logits written out from whole weights, for the QK-clip tests (test_qk_clip_mla.py and its
FSDP worker): DeepSeek-V2's formulas (arXiv 2405.04434, section 2.1.2), none of Titan's attention code
(`tiny_mla` builds the model they clip).

For head h at query i and key j: logit = scale * (q_nope_h,i . k_nope_h,j + rot(q_pe_h,i) . rot(k_pe_j)), with
q = wq x (or wq_b rms(wq_a x)), [c_kv; k_pe] = wkv_a x, k_nope from wkv_b rms(c_kv), k_pe shared by every head,
rotation by the complex rotary table on consecutive pairs, and the softmax scale of DeepSeek's YaRN:
(nope + rope)^-1/2 * (0.1 * mscale * ln(rope_factor) + 1)^2.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor

from titan_models.deepseek_v3 import DeepSeekV3Model, deepseek_v3_args
from titan_models.moe import MoEArgs

PLANTED_HEAD = 1


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x (batch, seq, ..., rope) turned by table (seq, rope / 2) of unit complex numbers, pair by pair."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    shape = [1, x.shape[1]] + [1] * (x.dim() - 3) + [x.shape[-1] // 2]
    return torch.view_as_real(pairs * table[: x.shape[1]].view(shape)).flatten(-2)


def softmax_scale(args) -> float:
    """DeepSeek's scale with YaRN's factor (the tests build their flavors with yarn=True)."""
    m = 0.1 * args.mscale * math.log(args.rope_factor) + 1.0
    return (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5 * m * m


def mla_logits(weights: dict[str, torch.Tensor], x: torch.Tensor, table: torch.Tensor, args) -> torch.Tensor:
    """(batch, heads, seq, seq) causal pre-softmax logits of one MLA; `weights` by parameter name
    (`wq.weight` or `wq_a.weight`, `q_norm.weight`, `wq_b.weight`; `wkv_a.weight`, `kv_norm.weight`,
    `wkv_b.weight`), whole tensors; masked positions are -inf."""
    nope, rope, v = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    eps = args.norm_eps if args.latent_norm_eps is None else args.latent_norm_eps
    b, s, _ = x.shape
    if "wq.weight" in weights:
        q = x @ weights["wq.weight"].T
    else:
        q = _rms(x @ weights["wq_a.weight"].T, weights["q_norm.weight"], eps) @ weights["wq_b.weight"].T
    q = q.view(b, s, args.n_heads, nope + rope)
    latent, k_pe = (x @ weights["wkv_a.weight"].T).split([args.kv_lora_rank, rope], dim=-1)
    kv = (_rms(latent, weights["kv_norm.weight"], eps) @ weights["wkv_b.weight"].T).view(
        b, s, args.n_heads, nope + v
    )
    scores = torch.einsum("bqhd,bkhd->bhqk", q[..., :nope], kv[..., :nope])
    scores = scores + torch.einsum("bqhd,bkd->bhqk", _rotate(q[..., nope:], table), _rotate(k_pe, table))
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return (scores * softmax_scale(args)).masked_fill(~causal, -torch.inf)


def peak_logits(
    weights: dict[str, torch.Tensor], xs: list[torch.Tensor], table: torch.Tensor, args
) -> torch.Tensor:
    """[heads]: each head's largest logit over the batches `xs` (the inputs to the attention)."""
    return torch.stack([mla_logits(weights, x, table, args).amax(dim=(0, 2, 3)) for x in xs]).amax(dim=0)


def whole_weights(attention: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of an attention's parameters by name, whole (gathered from their shards under FSDP)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in attention.named_parameters()
    }


def tiny_mla(q_lora_rank: int) -> DeepSeekV3Model:
    """A 2-layer deepseek_v3 (dense block, then MoE) with YaRN on, random latent norms, and query head 1
    of block 0 planted 30x larger (its q_nope and q_pe rows)."""
    args = replace(
        deepseek_v3_args("debugmodel"),
        dim=64,
        inter_dim=128,
        moe_inter_dim=32,
        n_layers=2,
        n_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        vocab_size=256,
        max_seq_len=32,
        original_seq_len=16,
        yarn=True,
        moe_args=MoEArgs(num_experts=4, num_shared_experts=1, top_k=2),
    )
    model = DeepSeekV3Model(args)
    model.init_weights(seed=0)
    generator = torch.Generator().manual_seed(1)
    qk = args.qk_head_dim
    with torch.no_grad():
        for block in model.layers.values():
            for norm in block.attention.modules():
                if isinstance(norm, torch.nn.RMSNorm):  # q_norm (with a query latent), kv_norm
                    norm.weight.copy_(torch.rand(norm.weight.shape, generator=generator) + 0.5)
        query, _ = model.layers["0"].attention.query_key_up_projections()
        query[PLANTED_HEAD * qk : (PLANTED_HEAD + 1) * qk] *= 30.0
    return model
