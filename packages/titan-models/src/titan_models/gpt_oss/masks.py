"""gpt-oss's two attention patterns per forward: the whole causal context, and a sliding window.

Odd layers see every earlier position (of their document, block-causally), even layers only the
`sliding_window_size` positions ending at the query. Both are built once per forward: boolean
(batch or 1, 1, seq, seq) masks for the explicit-softmax path, flex-attention `BlockMask`s where flex
attention can train (see `titan_models.attention_masks.flex_can_run`).

Under context parallelism (a `sequence_shard` from the trainer: this rank's global positions and a
gather over the group) each rank's queries are a load-balanced slice of the sequence at known global
positions, and its attention sees every rank's keys, gathered: the masks are then (queries here) x
(whole sequence), built from those global positions, and `gather_kv` gathers the keys and values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from titan_models.attention_masks import SequenceShard, flex_can_run
from titan_models.errors import ModelConfigError
from titan_models.gpt_oss.args import GptOssArgs


class GptOssMasks(NamedTuple):
    full: torch.Tensor | BlockMask
    sliding: torch.Tensor | BlockMask
    # Under context parallelism: (tensor, seq dim) -> every rank's slices, the keys the masks' columns index.
    gather_kv: Callable[[torch.Tensor, int], torch.Tensor] | None = None


def _bool_mask(
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    window: int | None,
    doc_ids: torch.Tensor | None,
    *,
    square: bool,  # (the block mask's; a boolean mask reads the positions either way)
) -> torch.Tensor:
    distance = q_pos[:, None] - kv_pos[None, :]
    keep = distance >= 0
    if window is not None:
        keep = keep & (distance < window)
    keep = keep[None]
    if doc_ids is not None:
        keep = keep & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return keep[:, None]


def _block_mask(
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    window: int | None,
    doc_ids: torch.Tensor | None,
    *,
    square: bool,
) -> BlockMask:
    def mask_mod(b, h, q_idx, kv_idx):
        # One process: the indices are the positions (no lookup in the compiled kernel).
        q, kv = (q_idx, kv_idx) if square else (q_pos[q_idx], kv_pos[kv_idx])
        keep = kv <= q
        if window is not None:
            keep = keep & (q - kv < window)
        return keep if doc_ids is None else keep & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    batch = None if doc_ids is None else doc_ids.shape[0]
    return create_block_mask(mask_mod, batch, None, len(q_pos), len(kv_pos), device=q_pos.device)


def build_gpt_oss_masks(
    args: GptOssArgs,
    doc_ids: torch.Tensor | None,
    seq_len: int,
    device,
    sequence_shard: SequenceShard | None = None,
) -> GptOssMasks:
    """The masks of one forward over `seq_len` positions (`doc_ids` for block-causal attention), or, with
    a `sequence_shard`, over this rank's `seq_len` positions against the gathered whole sequence."""
    docs = doc_ids if args.attn_mask_type == "block_causal" else None
    device = torch.device(device)
    build = _block_mask if args.attn_backend == "flex" and flex_can_run(device) else _bool_mask
    if sequence_shard is None:
        q_pos = kv_pos = torch.arange(seq_len, device=device)
        gather_kv = None
    else:
        if docs is not None:  # refused at start (GptOssArgs.context_parallel_refusal)
            raise ModelConfigError(
                "model: gpt-oss block-causal attention cannot be split by context parallelism"
            )
        q_pos, kv_pos = sequence_shard.positions.to(device), sequence_shard.all_positions().to(device)
        gather_kv = sequence_shard.gather
    return GptOssMasks(
        full=build(q_pos, kv_pos, None, docs, square=gather_kv is None),
        sliding=build(q_pos, kv_pos, args.sliding_window_size, docs, square=gather_kv is None),
        gather_kv=gather_kv,
    )
