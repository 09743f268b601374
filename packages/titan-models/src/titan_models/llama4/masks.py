"""Llama 4's two attention patterns per forward: global for no-rope layers, chunked for rope layers.

Rope layers of an iRoPE model attend only within fixed chunks of `attn_chunk_size` positions (and,
block-causally, within their document); no-rope layers see the whole causal (or block-causal)
context. Both are built once per forward in the form the attention backend consumes (see
`titan_models.attention_masks`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import create_block_mask

from titan_models.attention_masks import AttentionMask, build_attention_mask, flex_can_run
from titan_models.llama4.args import Llama4Args


class Llama4Masks(NamedTuple):
    rope: AttentionMask
    nope: AttentionMask


def _chunked_bool_mask(seq_len: int, chunk: int, doc_ids: torch.Tensor | None, device) -> torch.Tensor:
    pos = torch.arange(seq_len, device=device)
    keep = (pos[:, None] >= pos[None, :]) & (pos[:, None] // chunk == pos[None, :] // chunk)
    keep = keep[None]
    if doc_ids is not None:
        keep = keep & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return keep[:, None]


def _chunked_block_mask(seq_len: int, chunk: int, doc_ids: torch.Tensor | None, device):
    def mask_mod(b, h, q_idx, kv_idx):
        keep = (kv_idx <= q_idx) & (q_idx // chunk == kv_idx // chunk)
        return keep if doc_ids is None else keep & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    batch = None if doc_ids is None else doc_ids.shape[0]
    return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=device)


def build_llama4_masks(args: Llama4Args, doc_ids: torch.Tensor | None, seq_len: int, device) -> Llama4Masks:
    """The masks of one forward over `seq_len` positions (`doc_ids` for block-causal attention)."""
    full = build_attention_mask(args, doc_ids, device)
    chunk = args.attn_chunk_size
    if chunk is None or seq_len <= chunk:
        return Llama4Masks(rope=full, nope=full)
    docs = doc_ids if args.attn_mask_type == "block_causal" else None
    if args.attn_backend == "flex" and flex_can_run(torch.device(device)):
        return Llama4Masks(rope=_chunked_block_mask(seq_len, chunk, docs, device), nope=full)
    return Llama4Masks(rope=_chunked_bool_mask(seq_len, chunk, docs, device), nope=full)
