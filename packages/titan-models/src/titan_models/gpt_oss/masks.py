"""gpt-oss's two attention patterns per forward: the whole causal context, and a sliding window.

Odd layers see every earlier position (of their document, block-causally), even layers only the
`sliding_window_size` positions ending at the query. Both are built once per forward: boolean
(batch or 1, 1, seq, seq) masks for the explicit-softmax path, flex-attention `BlockMask`s where flex
attention can train (see `titan_models.attention_masks.flex_can_run`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from titan_models.attention_masks import flex_can_run
from titan_models.gpt_oss.args import GptOssArgs


class GptOssMasks(NamedTuple):
    full: torch.Tensor | BlockMask
    sliding: torch.Tensor | BlockMask


def _bool_mask(seq_len: int, window: int | None, doc_ids: torch.Tensor | None, device) -> torch.Tensor:
    pos = torch.arange(seq_len, device=device)
    distance = pos[:, None] - pos[None, :]
    keep = distance >= 0
    if window is not None:
        keep = keep & (distance < window)
    keep = keep[None]
    if doc_ids is not None:
        keep = keep & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return keep[:, None]


def _block_mask(seq_len: int, window: int | None, doc_ids: torch.Tensor | None, device) -> BlockMask:
    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep if doc_ids is None else keep & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    batch = None if doc_ids is None else doc_ids.shape[0]
    return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=device)


def build_gpt_oss_masks(args: GptOssArgs, doc_ids: torch.Tensor | None, seq_len: int, device) -> GptOssMasks:
    """The masks of one forward over `seq_len` positions (`doc_ids` for block-causal attention)."""
    docs = doc_ids if args.attn_mask_type == "block_causal" else None
    device = torch.device(device)
    build = _block_mask if args.attn_backend == "flex" and flex_can_run(device) else _bool_mask
    return GptOssMasks(
        full=build(seq_len, None, docs, device),
        sliding=build(seq_len, args.sliding_window_size, docs, device),
    )
