"""Training FLOPs per token of gpt-oss: active parameters, and attention scores over each layer's window.

6 per active non-embedding parameter (a token goes through 4 of a layer's experts: see
`titan_models.moe.count_active_parameters`), plus 12 * heads * head_dim * context per layer for QK^T and
scores-V, forward and backward, where context is the sequence for full layers (Titan's and torchtitan's
rule) and at most `sliding_window_size` keys for windowed ones. torchtitan 0.2.2 counts every layer over
the whole sequence; at seq_len 128 or less the two agree.
"""

from __future__ import annotations

from titan_models.gpt_oss.args import GptOssArgs


def gpt_oss_flops_per_token(args: GptOssArgs, active: int, embedding: int, seq_len: int) -> int:
    """Training FLOPs per token from the active parameter count and the embedding's share of it."""
    per_key = 12 * args.n_heads * args.head_dim
    window = min(seq_len, args.sliding_window_size)
    contexts = sum(window if args.uses_sliding_window(i) else seq_len for i in range(args.n_layers))
    return 6 * (active - embedding) + per_key * contexts
