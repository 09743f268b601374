"""The decoder tensor-parallel plan: which module is split how, as plain torch parallel styles.

Megatron-style: in each block the query/key/value and the SwiGLU input projections are split by
output column (each rank holds whole heads), the attention and feed-forward output projections by
input row, so a block needs one reduction per half. With sequence parallelism the norms and the
residual stream between blocks stay split along the sequence (dimension 1) and are gathered only
where a projection needs the whole sequence. The frame (`decoder_tp_plan`) is every family's; the
attention's own projections differ (`gqa_tp_entries` for Llama, Qwen3 and Llama 4; DeepSeek-V3 has
its latent attention's).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def llama_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """Module FQN ("*" for any block) -> style, for `parallelize_module(model, tp_mesh, plan)`."""
    return (
        decoder_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel) | gqa_tp_entries()
    )


def gqa_tp_entries() -> dict[str, ParallelStyle]:
    """Query, key and value projections split by output column: each rank holds whole heads."""
    return {f"layers.*.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}


def decoder_tp_plan(
    *, sequence_parallel: bool = True, loss_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """Embedding, output, attention output, dense SwiGLUs and norms: what every family splits alike.

    Keys of dense-only modules (`feed_forward.*`) match only the blocks that have one.
    """
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        # Loss parallel keeps the vocab-sharded logits as a DTensor for a sharded cross-entropy.
        "output": ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=residual),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        plan |= {
            "norm": SequenceParallel(),
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.ffn_norm": SequenceParallel(),
            # Attention takes (x, freqs_cis, mask): only x is sequence-split and must be gathered.
            "layers.*.attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "layers.*.feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
        }
    return plan
