"""An analytic estimate of memory per rank: parameters, gradients, optimizer state, activations.

It is what a dry run prints for a layout that cannot be tried here (a 405B model on 512 GPUs), so it
works from shapes and degrees alone. Activations count the tensors a Llama block keeps for backward
(see `saved_elements_per_token`); the estimate ignores allocator fragmentation, communication buffers
and the CUDA context, so treat it as a lower bound within a few GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

_ADAM_STATES = 2  # exp_avg and exp_avg_sq, in the parameter dtype
_LOGIT_BYTES = 4 + 4  # the float32 copy of the logits the loss reads, and its gradient


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model split into what pipeline stages hold."""

    total: int
    embedding: int
    per_block: int
    n_blocks: int

    @property
    def head(self) -> int:
        """Final norm and output projection (held by the last pipeline stage)."""
        return self.total - self.embedding - self.per_block * self.n_blocks

    @classmethod
    def of(cls, model: nn.Module, blocks: dict[str, nn.Module], embedding: int) -> ParamCounts:
        """Counts read from a (meta-device) model and its repeated blocks."""
        sizes = [sum(p.numel() for p in block.parameters()) for block in blocks.values()]
        total = sum(p.numel() for p in model.parameters())
        return cls(total=total, embedding=embedding, per_block=max(sizes, default=0), n_blocks=len(sizes))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, for the most loaded rank (the first pipeline stage, or the last with its logits)."""

    parameters: int
    gradients: int
    optimizer_state: int
    gathered_parameters: int
    activations: int

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_state
            + self.gathered_parameters
            + self.activations
        )

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("parameters (sharded)", self.parameters),
            ("gradients (sharded)", self.gradients),
            ("optimizer state (Adam)", self.optimizer_state),
            ("gathered parameters (FSDP, transient)", self.gathered_parameters),
            ("activations", self.activations),
            ("total", self.total),
        ]


def saved_elements_per_token(
    dim: int, kv_dim: int, ffn_dim: int, mode: str, option: str, budget: float
) -> float:
    """Elements a Llama block saves for backward per token, under activation checkpointing `mode`.

    Without checkpointing a block keeps: its input and the attention norm's output (2 dim), q/k/v
    (dim + 2 kv_dim), rotated q/k (dim + kv_dim), the attention output (dim), the FFN input and norm
    output (2 dim), and w1/w3 outputs, the SiLU and the product (4 ffn_dim). `full` keeps only the
    block input; `selective` N checkpoints every Nth block; `op` keeps the block input, q/k/v, the
    attention output and half of the FFN matmul outputs.
    """
    everything = 7 * dim + 3 * kv_dim + 4 * ffn_dim
    if mode == "none":
        return everything
    if mode == "full":
        return dim
    if mode == "memory_budget":
        return dim + budget * (everything - dim)
    if option == "op":
        return dim + (dim + 2 * kv_dim) + dim + ffn_dim
    every = int(option)
    return (1 - 1 / every) * everything + dim / every


def estimate_memory_per_rank(
    config: Any, args: Any, degrees: dict[str, int], counts: ParamCounts
) -> MemoryEstimate:
    """Memory per rank for `config` (a JobConfig) training a model of `args` over `degrees`."""
    t, p, ac = config.training, config.parallelism, config.activation_checkpoint
    pp, tp, cp = degrees["pp"], degrees["tp"], degrees["cp"]
    fsdp = degrees["dp_shard"] * cp
    param_bytes = 2 if t.dtype == "bfloat16" else 4
    compute_bytes = 2 if "bfloat16" in (t.dtype, t.mixed_precision_param) else 4

    layers = math.ceil(counts.n_blocks / pp)
    first_stage = layers * counts.per_block + counts.embedding + (counts.head if pp == 1 else 0)
    last_stage = layers * counts.per_block + counts.head + (counts.embedding if pp == 1 else 0)
    stage_params = max(first_stage, last_stage)
    sharded = stage_params / (tp * fsdp)

    gathered = 0.0
    if fsdp > 1:
        # Two blocks unsharded at a time (one computing, one prefetched) plus the root, which stays gathered.
        root = counts.embedding + counts.head if pp == 1 else max(counts.embedding, counts.head)
        gathered = (2 * counts.per_block + root) / tp * compute_bytes

    micro = p.pipeline_parallel_microbatch_size if pp > 1 else t.local_batch_size
    tokens = micro * t.seq_len / cp
    kv_dim = args.kv_heads * args.head_dim
    saved = saved_elements_per_token(
        args.dim, kv_dim, args.ffn_hidden_dim, ac.mode, ac.selective_ac_option, ac.memory_budget
    )
    # Recomputing a checkpointed block briefly holds all of its activations again.
    recompute = 7 * args.dim + 3 * kv_dim + 4 * args.ffn_hidden_dim if ac.mode != "none" else 0
    per_token_blocks = (layers * saved + recompute) * compute_bytes / tp
    vocab = args.vocab_size / (tp if tp > 1 and not p.disable_loss_parallel else 1)
    per_token_logits = vocab * (compute_bytes + _LOGIT_BYTES)
    if pp == 1:
        activations = tokens * (per_token_blocks + per_token_logits)
    else:
        n_micro = max(t.local_batch_size // micro, 1)
        in_flight = n_micro if p.pipeline_parallel_schedule == "GPipe" else min(pp, n_micro)
        activations = max(
            tokens * per_token_blocks * in_flight, tokens * (per_token_blocks + per_token_logits)
        )

    return MemoryEstimate(
        parameters=round(sharded * param_bytes),
        gradients=round(sharded * param_bytes),
        optimizer_state=round(sharded * param_bytes * _ADAM_STATES),
        gathered_parameters=round(gathered),
        activations=round(activations),
    )
