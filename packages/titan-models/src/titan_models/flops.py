"""Parameter counts and training FLOPs per token, for throughput and MFU."""

from __future__ import annotations

from torch import nn

from titan_models.args import ModelArgs


def count_parameters(model: nn.Module, *, exclude_embedding: bool = False) -> int:
    """Number of parameters (works on the meta device); optionally without the token embedding.

    A matrix shared between the embedding and the output projection is counted once, and is
    what `exclude_embedding` leaves out.
    """
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding and getattr(model, "tok_embeddings", None) is not None:
        total -= model.tok_embeddings.weight.numel()
    return total


def flops_per_token(args: ModelArgs, num_params: int, num_embedding_params: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 per non-embedding parameter plus the attention scores.

    The attention term, 12 * layers * heads * head_dim * seq_len, counts the QK^T and score-V
    matmuls (forward and backward) that the 6N rule leaves out. An embedding lookup costs no
    matmul, but a tied embedding also serves as the output projection, whose matmul is added back.
    """
    dense = 6 * (num_params - num_embedding_params)
    if args.tie_word_embeddings:
        dense += 6 * args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return dense + attention
