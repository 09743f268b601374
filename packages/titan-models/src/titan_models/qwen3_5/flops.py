"""Training FLOPs per token of Qwen3.5: 6 per active non-embedding parameter (a tied embedding's output
matmul added back), the attention scores of the full-attention layers only (12 * layers * heads * head_dim
* seq_len), and for each linear layer 12 * value_heads * key_dim * value_dim, the state's read and write
(forward and backward), which do not grow with the sequence."""

from __future__ import annotations

from torch import nn

from titan_models.moe.params import count_active_parameters
from titan_models.qwen3_5.args import Qwen3_5Args


def qwen3_5_flops_per_token(args: Qwen3_5Args, model: nn.Module, seq_len: int) -> int:
    """Training FLOPs per token of `model` (meta device is fine) at `seq_len`."""
    active = count_active_parameters(model)
    embedding = active - count_active_parameters(model, exclude_embedding=True)
    dense = 6 * (active - embedding)
    if args.tie_word_embeddings:
        dense += 6 * args.vocab_size * args.dim
    linear = sum(args.is_linear(i) for i in range(args.n_layers))
    full = args.n_layers - linear
    attention = 12 * full * args.n_heads * args.head_dim * seq_len
    state = 12 * linear * args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim
    return dense + attention + state
