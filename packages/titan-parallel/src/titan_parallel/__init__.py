"""Model-agnostic parallelisms: the device mesh and the transforms that apply each parallelism."""

from titan_parallel.errors import ParallelConfigError
from titan_parallel.fsdp import apply_fsdp, blocks_of
from titan_parallel.grad_norm import clip_grad_norm_
from titan_parallel.parallel_dims import ParallelDims
from titan_parallel.protocols import HasParallelBlocks

__all__ = [
    "HasParallelBlocks",
    "ParallelConfigError",
    "ParallelDims",
    "apply_fsdp",
    "blocks_of",
    "clip_grad_norm_",
]
