"""Which keys each query may see: causal, or block-causal over packed documents.

A mask is built once per forward and handed to every block: `None` means plain causal (SDPA's and
flash-attn's built-in path), a boolean tensor is an explicit SDPA mask, and a flex-attention
`BlockMask` drives flex attention, and a `VarlenMask` (documents as cumulative lengths over the
flattened batch) drives variable-length attention. Flex attention has a backward only on CUDA, so
elsewhere a training forward falls back to the boolean mask, which gives the same attention.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from titan_models.args import ModelArgs
from titan_models.errors import ModelConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VarlenMask:
    """Packed documents as variable-length kernels take them: the batch flattened to one row of
    `batch * seq_len` tokens, `cu_seqlens[i]` the start of document i (int32, ending with the total),
    and the longest document. A row's start always starts a document: documents never cross rows."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_len: int


class SequenceShard(Protocol):
    """What context parallelism hands a model (structurally: `titan_parallel.SequenceShard`)."""

    positions: torch.Tensor  # the global position of each local token: (seq,), or (batch or 1, seq)
    documents: torch.Tensor | None  # (batch, seq): each local token's packed document, or None

    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...

    def all_positions(self) -> torch.Tensor: ...

    def all_documents(self) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class GatheredMask:
    """Under context parallelism: the mask of this rank's queries over the whole sequence's keys, which
    the attention gathers from every rank (`gather(tensor, dim)`) before it attends."""

    mask: torch.Tensor | BlockMask
    gather: Callable[[torch.Tensor, int], torch.Tensor]


AttentionMask = torch.Tensor | BlockMask | VarlenMask | GatheredMask | None


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-position document index of packed sequences: it goes up by one after each `eos_id`.

    The end-of-text token itself belongs to the document it closes.
    """
    is_eos = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(is_eos, dim=-1) - is_eos


def documents_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """Per-position document index of rows whose positions restart at 0 at each document (chat rows)."""
    return torch.cumsum((positions == 0).to(torch.int32), dim=-1) - 1


def block_causal_bool_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) boolean SDPA mask: earlier-or-same positions of the same document."""
    seq_len = doc_ids.shape[-1]
    positions = torch.arange(seq_len, device=doc_ids.device)
    causal = positions[None, :, None] >= positions[None, None, :]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (causal & same_doc)[:, None]


def varlen_mask(doc_ids: torch.Tensor) -> VarlenMask:
    """The documents of (batch, seq) `doc_ids` as cumulative lengths over the flattened batch."""
    batch, seq_len = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = starts.flatten().nonzero().flatten()
    total = torch.tensor([batch * seq_len], device=doc_ids.device)
    cu_seqlens = torch.cat([first, total]).to(torch.int32)
    return VarlenMask(cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()), seq_len)


def gathered_attention_mask(shard: SequenceShard, batch: int, use_flex: bool) -> GatheredMask:
    """This rank's queries (the positions `shard` dealt it) over the gathered sequence: earlier-or-same
    positions, of the same document where `shard` numbers documents."""
    q_pos, kv_pos = shard.positions, shard.all_positions()
    q_pos, kv_pos = q_pos.expand(batch, -1), kv_pos.expand(batch, -1)
    q_doc, kv_doc = shard.documents, shard.all_documents()
    if use_flex:

        def mask_mod(b, h, q_idx, kv_idx):
            keep = kv_pos[b, kv_idx] <= q_pos[b, q_idx]
            return keep if q_doc is None else keep & (q_doc[b, q_idx] == kv_doc[b, kv_idx])

        mask = create_block_mask(mask_mod, batch, None, q_pos.shape[1], kv_pos.shape[1], device=q_pos.device)
        return GatheredMask(mask, shard.gather)
    keep = kv_pos[:, None, :] <= q_pos[:, :, None]
    if q_doc is not None:
        keep = keep & (q_doc[:, :, None] == kv_doc[:, None, :])
    return GatheredMask(keep[:, None], shard.gather)


def block_causal_block_mask(doc_ids: torch.Tensor) -> BlockMask:
    """The flex-attention form of `block_causal_bool_mask`."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    batch, seq_len = doc_ids.shape
    return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=doc_ids.device)


@functools.lru_cache(maxsize=8)
def causal_block_mask(seq_len: int, device: str) -> BlockMask:
    """Plain causal attention as a flex-attention mask, cached per length and device."""

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    return create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)


def flex_can_run(device: torch.device) -> bool:
    """Whether flex attention can run here now: CUDA always; elsewhere only without autograd."""
    return device.type == "cuda" or not torch.is_grad_enabled()


@functools.lru_cache(maxsize=1)
def _log_flex_fallback(device_type: str) -> None:
    logger.info(
        "flex attention has no backward on %s: training uses SDPA with an explicit mask instead", device_type
    )


def build_attention_mask(args: ModelArgs, doc_ids: torch.Tensor | None, device) -> AttentionMask:
    """The mask for one forward, in the form the configured backend (or its fallback) consumes.

    Plain causal attention gets None: each kernel applies causality itself (flex builds its causal
    mask from the query length it sees, which under sequence parallelism a pipeline stage's input
    does not show).
    """
    device = torch.device(device)
    use_flex = args.attn_backend == "flex" and flex_can_run(device)
    if args.attn_backend == "flex" and not use_flex:
        _log_flex_fallback(device.type)
    if args.attn_mask_type == "causal":
        return None
    return document_mask(args, doc_ids, use_flex)


def document_mask(args: ModelArgs, doc_ids: torch.Tensor | None, use_flex: bool) -> AttentionMask:
    """Block-causal attention over the documents `doc_ids` numbers, in the backend's form."""
    if doc_ids is None:
        raise ModelConfigError(
            "model: attn_mask_type='block_causal' needs document ids (see titan_models.document_ids)"
        )
    if args.attn_backend == "varlen":
        return varlen_mask(doc_ids)
    return block_causal_block_mask(doc_ids) if use_flex else block_causal_bool_mask(doc_ids)
