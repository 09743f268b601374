"""Training FLOPs per token of a DeepSeek-V3 model, from its active parameters, for throughput and MFU."""

from __future__ import annotations

from titan_models.deepseek_v3.args import DeepSeekV3Args


def deepseek_flops_per_token(
    args: DeepSeekV3Args, num_active_params: int, num_embedding_params: int, seq_len: int
) -> int:
    """6 per active non-embedding parameter (`titan_models.moe.count_active_parameters`) plus attention.

    The attention term, 6 * layers * heads * (qk_head_dim + v_head_dim) * seq_len, counts the QK^T and
    score-V matmuls forward and backward, which the 6N rule leaves out (torchtitan 0.2.2's formula).
    """
    dense = 6 * (num_active_params - num_embedding_params)
    attention = 6 * args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    return dense + attention
