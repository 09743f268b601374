"""QK-clip (Kimi K2's MuonClip): after an optimizer step, shrink the query and key rows of every
attention head whose largest pre-softmax logit in that step exceeded `tau`.

For head h with S_h = max over the step's batch of q_h . k_h / sqrt(head_dim) and S_h > tau, Kimi K2
(arXiv 2507.20534, section 2.1) sets gamma_h = tau / S_h and multiplies the head's query rows and key
rows each by sqrt(gamma_h), so that its logits scale by gamma_h and the largest one, on that batch,
becomes tau. Heads at or under tau are left alone.

Multi-head latent attention (`clip_latent_query_key`): head h's logit is the sum of a head-specific part
q_C . k_C (q_nope, k_nope) and a rotary part q_R . k_R whose key k_R every head shares. K2 scales q_C and
k_C each by sqrt(gamma_h) and q_R by gamma_h, leaving k_R alone: both parts, so the whole logit, scale by
gamma_h, and no other head's logits move.

With grouped-query attention a key head serves several query heads, so one key scale cannot give each
its own gamma. Here the key head g scales by sqrt(min gamma over its query heads) and each query head h
by gamma_h / sqrt(that minimum): every head's logits still scale by exactly its gamma_h, heads at or
under tau keep theirs, and with one key head per query head it is K2's rule.

The peaks are taken over every rank that saw other tokens (`group`, data and context parallel ranks);
heads must be whole on each rank (no tensor parallelism), which the caller checks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from titan_parallel.protocols import HasLatentQueryKeyHeads, HasQueryKeyHeads


def clip_query_key(
    model: HasQueryKeyHeads, tau: float, group: dist.ProcessGroup | None = None
) -> list[tuple[str, int, float]]:
    """Apply QK-clip to every attention of `model` from the logits recorded since the last call, then
    restart the recording. Returns (attention FQN, head, its largest logit) for each head clipped."""
    heads = model.query_key_heads()
    if not heads:
        return []
    peaks = _peaks_over_ranks([logits for _, _, logits in heads.values()], group)
    clipped = []
    offset = 0
    for name, (wq, wk, logits) in heads.items():
        n = logits.numel()
        peak = peaks[offset : offset + n]
        offset += n
        logits.fill_(-torch.inf)
        over = peak > tau
        if not bool(over.any()):
            continue
        gamma = torch.where(over, tau / peak, torch.ones_like(peak))
        head_dim = wq.shape[0] // n
        kv_heads = wk.shape[0] // head_dim
        key_gamma = gamma.view(kv_heads, -1).amin(dim=1)
        query_scale = gamma / key_gamma.repeat_interleave(n // kv_heads).sqrt()
        _scale_rows(wq, query_scale.repeat_interleave(head_dim))
        _scale_rows(wk, key_gamma.sqrt().repeat_interleave(head_dim))
        clipped += [(name, int(h), float(peak[h])) for h in over.nonzero().flatten()]
    return clipped


def clip_latent_query_key(
    model: HasLatentQueryKeyHeads, tau: float, group: dist.ProcessGroup | None = None
) -> list[tuple[str, int, float]]:
    """QK-clip for multi-head latent attention: per head above tau, q_nope's and k_nope's rows scale by
    sqrt(gamma), q_pe's rows by gamma, the shared rotary key not at all; then the record restarts.
    Returns (attention FQN, head, its largest logit) for each head clipped."""
    heads = model.latent_query_key_heads()
    if not heads:
        return []
    peaks = _peaks_over_ranks([attention.max_logits for attention in heads.values()], group)
    clipped = []
    offset = 0
    for name, attention in heads.items():
        n = attention.max_logits.numel()
        peak = peaks[offset : offset + n]
        offset += n
        attention.max_logits.fill_(-torch.inf)
        over = peak > tau
        if not bool(over.any()):
            continue
        gamma = torch.where(over, tau / peak, torch.ones_like(peak))[:, None]
        half = gamma.sqrt()
        query, key_value = attention.query_key_up_projections()
        nope, rope, v = attention.nope_dim, attention.rope_dim, attention.v_dim
        _scale_rows(query, torch.cat([half.expand(n, nope), gamma.expand(n, rope)], dim=1).flatten())
        _scale_rows(
            key_value, torch.cat([half.expand(n, nope), torch.ones_like(gamma).expand(n, v)], dim=1).flatten()
        )
        clipped += [(name, int(h), float(peak[h])) for h in over.nonzero().flatten()]
    return clipped


def _peaks_over_ranks(records: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """The recorded peaks, concatenated, as the largest over `group`'s ranks."""
    peaks = torch.cat([logits.float() for logits in records])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
    return peaks


@torch.no_grad()
def _scale_rows(weight: torch.Tensor, scale: torch.Tensor) -> None:
    """weight[r, :] *= scale[r], for a plain tensor or a DTensor of any layout (the scale is whole on
    every rank, so each takes its own part of it without communication)."""
    factor = scale.to(weight.dtype)[:, None].expand(weight.shape).contiguous()
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        whole = DTensor.from_local(factor.to(weight.device), mesh, [Replicate()] * mesh.ndim, run_check=False)
        weight.mul_(whole.redistribute(mesh, weight.placements))
    else:
        weight.mul_(factor.to(weight.device))
