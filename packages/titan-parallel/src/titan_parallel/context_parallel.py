"""Context parallelism: shard each sequence across ranks and attend with ring attention."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

from titan_parallel.cpu_ring_attention import cpu_ring_attention
from titan_parallel.errors import ParallelConfigError, UnsupportedDeviceError, check_choice
from titan_parallel.gathered_context_parallel import LOAD_BALANCERS, gathered_context_parallel
from titan_parallel.protocols import HasShardedSequenceAttention
from titan_parallel.sequence_shard import SequenceShard

logger = logging.getLogger(__name__)

ROTATE_METHODS = ("allgather", "alltoall")


@dataclass(frozen=True)
class ContextParallelOptions:
    """How context parallelism shards and attends: torchtitan's `[parallelism] context_parallel_*` settings.

    `rotate_method`: how key/value shards travel ("allgather" or "alltoall"). `load_balancer`: "headtail"
    (each rank holds chunks i and 2*cp-1-i of a causal sequence, so every rank does the same attention
    work), "ptrr" (blocks dealt by their work under the row's mask) or None (one contiguous chunk each).
    Packed documents and ptrr attend over gathered keys (`titan_parallel.gathered_context_parallel`).
    """

    rotate_method: str = "allgather"
    load_balancer: str | None = "headtail"

    def __post_init__(self) -> None:
        check_choice("context_parallel.rotate_method", self.rotate_method, ROTATE_METHODS)
        if self.load_balancer is not None:
            check_choice("context_parallel.load_balancer", self.load_balancer, LOAD_BALANCERS)

    @property
    def load_balance(self) -> bool:
        return self.load_balancer is not None

    def gathers(self, documents: torch.Tensor | None) -> bool:
        """Whether a step over `documents` (None: unpacked causal rows) attends over gathered keys rather
        than through torch's ring: packed documents need their mask, ptrr its per-row dealing."""
        return documents is not None or self.load_balancer == "ptrr"

    def gathered(
        self,
        cp_mesh: DeviceMesh,
        batch: Sequence[torch.Tensor],
        documents: torch.Tensor | None,
        models: Sequence[nn.Module],
    ) -> contextlib.AbstractContextManager[None]:
        """`gathered_context_parallel` over `batch` with this load balancer."""
        return gathered_context_parallel(
            cp_mesh, batch, documents=documents, load_balancer=self.load_balancer, models=models
        )

    def sharding(
        self,
        cp_mesh: DeviceMesh,
        buffers: Sequence[torch.Tensor],
        seq_dims: Sequence[int],
        *,
        no_restore_buffers: set[torch.Tensor] | None = None,
        models: Sequence[nn.Module] = (),
    ) -> contextlib.AbstractContextManager[None]:
        """`context_parallel_ctx` over `buffers` (and `models`) with these settings."""
        return context_parallel_ctx(
            cp_mesh,
            buffers,
            seq_dims,
            no_restore_buffers=no_restore_buffers,
            rotate_method=self.rotate_method,
            load_balance=self.load_balance,
            models=models,
        )


@contextlib.contextmanager
def context_parallel_ctx(
    cp_mesh: DeviceMesh,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    *,
    no_restore_buffers: set[torch.Tensor] | None = None,
    rotate_method: str = "allgather",
    load_balance: bool = True,
    models: Sequence[nn.Module] = (),
) -> Iterator[None]:
    """Run forward and backward with every tensor in `buffers` sharded on its sequence dim.

    Put the batch (inputs, labels) and every position-dependent buffer (rotary tables) in
    `buffers`; they are sharded in place, load-balanced for causal attention (each rank holds
    chunks i and 2*cp-1-i), and restored on exit unless in `no_restore_buffers`. Attention must go
    through `torch.nn.functional.scaled_dot_product_attention` with `is_causal=True`, looked up at
    call time (`F.scaled_dot_product_attention`), since that is where torch routes to ring
    attention. `rotate_method` is how key/value shards travel: "allgather" or "alltoall".
    `load_balance=False` gives each rank one contiguous chunk instead (the last rank then does the
    most causal work).

    Each of `models` (the model parts) that implements `set_sequence_shard`
    (`titan_parallel.protocols.HasShardedSequenceAttention`) computes its attention itself over keys
    and values gathered from the group (`titan_parallel.sequence_shard`): it is handed a `SequenceShard`
    with the global positions of this rank's tokens (the length of `buffers[0]`, the inputs, sharded
    like them) and set back to None on exit. Such a model gathers rather than rotates, so it takes
    `rotate_method` "allgather" only.
    """
    check_choice("context_parallel.rotate_method", rotate_method, ROTATE_METHODS)
    if len(buffers) != len(seq_dims):
        raise ParallelConfigError(
            f"parallelism: context parallel got {len(buffers)} buffers but {len(seq_dims)} sequence dims; "
            "give one sequence dim per buffer"
        )
    _check_divisible(cp_mesh.size() * (2 if load_balance else 1), buffers, seq_dims)
    device = cp_mesh.device_type
    if device not in ("cpu", "cuda"):
        raise UnsupportedDeviceError(
            f"parallelism: context parallel runs on CPU and CUDA, not {device!r}; set cp = 1 on this device"
        )
    sharded_attention = [m for m in models if isinstance(m, HasShardedSequenceAttention)]
    if sharded_attention and rotate_method != "allgather":
        raise ParallelConfigError(
            f"parallelism: {type(sharded_attention[0]).__name__} gathers the whole sequence's keys and values "
            f"for its own attention, so context_parallel rotate_method={rotate_method!r} would not be "
            "honoured; use rotate_method='allgather'"
        )
    buffers, seq_dims = list(buffers), list(seq_dims)
    positions = None
    if sharded_attention:
        positions = torch.arange(buffers[0].shape[seq_dims[0]], device=buffers[0].device)
        buffers.append(positions)
        seq_dims.append(0)
    set_rotate_method(rotate_method)
    with contextlib.ExitStack() as stack:
        balance = _cp_options.enable_load_balance
        _cp_options.enable_load_balance = load_balance
        stack.callback(setattr, _cp_options, "enable_load_balance", balance)
        sharded = context_parallel(
            cp_mesh,
            buffers=buffers,
            buffer_seq_dims=seq_dims,
            no_restore_buffers=set(no_restore_buffers or ())
            | ({positions} if positions is not None else set()),
        )
        sharded.__enter__()
        # Always exit as if cleanly: torch 2.11's context_parallel restores SDPA and the buffers only
        # then, so an exception in the step would leave every later SDPA call patched for ring attention.
        stack.callback(sharded.__exit__, None, None, None)
        if positions is not None:  # sharded in place above: this rank's global positions
            shard = SequenceShard(cp_mesh.get_group(), positions)
            for model in sharded_attention:
                model.set_sequence_shard(shard)
                stack.callback(model.set_sequence_shard, None)
        if device == "cpu":
            # Entered after context_parallel, which resets the handler table on entry.
            stack.enter_context(cpu_ring_attention())
        yield


def _check_divisible(chunks: int, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int]) -> None:
    for i, (buffer, dim) in enumerate(zip(buffers, seq_dims, strict=True)):
        length = buffer.shape[dim]
        if length % chunks:
            raise ParallelConfigError(
                f"parallelism: context parallel buffer {i} has sequence length {length} on dim {dim}, not "
                f"divisible by {chunks}, the number of chunks context parallelism cuts it into (2*cp with "
                f"causal load balancing, cp without); use a seq_len that is a multiple of {chunks}"
            )
