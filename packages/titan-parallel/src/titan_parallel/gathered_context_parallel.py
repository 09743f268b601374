"""Context parallelism over packed documents, and ptrr's balance: every rank attends over gathered keys.

torch's ring attention (`context_parallel_ctx`) computes plain causal SDPA. Packed documents (block-causal
pretraining, chat rows, preference pairs) need each query's document, and ptrr deals each row's blocks
differently, which torch's buffer sharding cannot apply to a batch-less buffer such as the rotary table
(it deals those by row 0). So here every sequence-shaped tensor of the batch is dealt to the ranks by
one index per row (torch's head-tail or ptrr load balancer, or none), no model buffer is sharded, and
each model part is handed a `SequenceShard`: the global positions of its tokens (its rotary angles
follow them), their documents and a differentiable gather. The model attends over the gathered keys
and values with the mask those give (`titan_models.attention_masks.gathered_attention_mask`): the
same K/V traffic as the "allgather" rotate method, and exact for any mask built from positions.

ptrr (processing-time round robin) cuts the sequence into blocks, weighs each block by the keys its
queries attend to under the row's document mask, and deals the blocks so that each rank's total work
is as even as the snake order makes it; head-tail gives rank i chunks i and 2*cp-1-i, which balances
one causal sequence but not documents of mixed lengths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import create_block_mask

from titan_parallel.errors import ParallelConfigError, UnsupportedDeviceError, check_choice
from titan_parallel.protocols import HasGatheredSequenceAttention
from titan_parallel.sequence_shard import SequenceShard

LOAD_BALANCERS = ("headtail", "ptrr")
_PTRR_BLOCK = 128  # flex attention's block size, ptrr's unit of work


def ptrr_block_size(seq_len: int, cp: int) -> int | None:
    """ptrr's block: flex attention's 128 where `cp` blocks of it tile `seq_len`, else the largest power of
    two that does (None: `seq_len` is not a multiple of `cp`)."""
    block = _PTRR_BLOCK
    while block >= 1:
        if seq_len % (block * cp) == 0:
            return block
        block //= 2
    return None


def dealing_order(
    batch: int, seq_len: int, cp: int, balancer: str | None, documents: torch.Tensor | None, device
) -> torch.Tensor:
    """(1 or batch, seq_len) global positions in the order they are dealt: rank r takes the r-th of `cp`
    equal contiguous chunks of it. `documents` (batch, seq_len) shapes ptrr's blocks' work (None: causal)."""
    if balancer is not None:
        check_choice("context_parallel.load_balancer", balancer, LOAD_BALANCERS)
    chunks = cp * 2 if balancer == "headtail" else cp
    block = ptrr_block_size(seq_len, cp) if balancer == "ptrr" else 1
    if seq_len % chunks or block is None:
        raise ParallelConfigError(
            f"parallelism: context parallel over a sequence of {seq_len} positions with load balancer "
            f"{balancer!r} cuts it into {chunks} equal chunks; use a seq_len that is a multiple of {chunks}"
        )
    if balancer is None:
        return torch.arange(seq_len, device=device)[None]
    head_tail, ptrr = _torch_balancers()
    if balancer == "headtail":
        return head_tail(seq_len, cp, device)._generate_indices().to(device)
    mask = _block_causal_block_mask(documents, batch, seq_len, block, device)
    return ptrr(mask, cp)._generate_indices().to(device)


def _block_causal_block_mask(documents: torch.Tensor | None, batch: int, seq_len: int, block: int, device):
    if documents is None:

        def mask_mod(b, h, q, kv):
            return kv <= q

        return create_block_mask(mask_mod, 1, 1, seq_len, seq_len, device=device, BLOCK_SIZE=block)

    def document_mask_mod(b, h, q, kv):
        return (kv <= q) & (documents[b, q] == documents[b, kv])

    return create_block_mask(document_mask_mod, batch, 1, seq_len, seq_len, device=device, BLOCK_SIZE=block)


def _torch_balancers() -> tuple[type, type]:
    """torch's head-tail and ptrr load balancer classes (private API), or a clear error naming the torch."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _HeadTailLoadBalancer,
            _PTRRLoadBalancer,
        )
    except ImportError as e:
        raise UnsupportedDeviceError(
            f"parallelism: context parallel load balancing needs torch's load balancers, missing here ({e}); "
            f"this torch is {torch.__version__}, titan-parallel is tested on 2.11 and 2.15"
        ) from e
    return _HeadTailLoadBalancer, _PTRRLoadBalancer


def _deal(tensor: torch.Tensor, order: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's part of (batch, seq, ...) `tensor` reordered by `order` (1 or batch, seq)."""
    index = order.expand(tensor.shape[0], -1)
    index = index.reshape(*index.shape, *([1] * (tensor.ndim - 2))).expand(tensor.shape)
    return tensor.gather(1, index).chunk(cp, dim=1)[rank].contiguous()


@contextlib.contextmanager
def gathered_context_parallel(
    cp_mesh: DeviceMesh,
    batch: Sequence[torch.Tensor],
    *,
    documents: torch.Tensor | None,
    load_balancer: str | None,
    models: Sequence[nn.Module],
) -> Iterator[None]:
    """Deal the (batch, seq, ...) tensors of `batch` to the ranks of `cp_mesh` in place (inputs, labels,
    positions: they stay dealt) and let each of `models` attend over the gathered sequence while open.

    `documents` (batch, seq) numbers each token's packed document (None: one causal sequence per row);
    `load_balancer` is "headtail", "ptrr" or None. Every model must answer `set_gathered_sequence`
    (`titan_parallel.protocols.HasGatheredSequenceAttention`).
    """
    refusing = [type(m).__name__ for m in models if not isinstance(m, HasGatheredSequenceAttention)]
    if refusing:
        raise ParallelConfigError(
            f"parallelism: {refusing[0]} cannot attend over a gathered sequence (set_gathered_sequence), which "
            "context parallelism over packed documents or with the ptrr load balancer needs; set "
            "context_parallel_load_balancer = 'headtail' on unpacked data, or context_parallel_degree = 1"
        )
    first = batch[0]
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    order = dealing_order(first.shape[0], first.shape[1], cp, load_balancer, documents, first.device)
    positions = order.chunk(cp, dim=1)[rank].contiguous()  # (1 or batch, local length)
    local_documents = None if documents is None else _deal(documents, order, cp, rank)
    # Dealt from the whole rows first, then each tensor takes its part's storage: rows of one batch can be
    # views of one buffer (inputs and positions side by side), which writing in place would overwrite.
    parts = [_deal(tensor, order, cp, rank) for tensor in batch]
    for tensor, part in zip(batch, parts, strict=True):
        tensor.set_(part)
    shard = SequenceShard(cp_mesh.get_group(), positions, local_documents)
    with contextlib.ExitStack() as stack:
        for model in models:
            model.set_gathered_sequence(shard)
            stack.callback(model.set_gathered_sequence, None)
        yield
