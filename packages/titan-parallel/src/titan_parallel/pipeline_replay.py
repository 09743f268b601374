"""A pipeline step traced without running every micro-batch: the middle ones are replayed.

A stage does the same work for every micro-batch: its forward, its loss (on the last stage) and its
backward allocate and free the same sizes in the same order. So a traced step runs micro-batches 0, 1
and the last of each stage, captures what micro-batch 1's forward, loss and backward allocated
(`MemoryTrace.capture`) and, for the others, emits those allocations again (`MemoryTrace.replay`),
handing the schedule tensors shaped like the ones the stage hands on (its output, its loss, its input
gradients). The schedule itself runs as in a full trace (its order, sends, receives and their
buffers, FSDP's first and last backward). The replayed trace allocates what the full one does, in the
same order, and frees the same storages between the same allocations (titan-train's
`test_pipeline_replay` compares them), for a fraction of the time: a 405B stage of 16 micro-batches
runs 3.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from titan_parallel.memory_trace import MemoryTrace

# Schedules that run each stage's micro-batches in order, forward and backward, the backward in one
# piece (zero-bubble ones split it into input and weight gradients; LoopedBFS runs backward in reverse).
_IN_ORDER = (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)
_CAPTURED = 1  # micro-batch 0 is the first (FSDP gathers, gradients appear), the last reduces them


class ReplayError(RuntimeError):
    """A micro-batch already replayed cannot be finished: the step must be traced running them all."""


def can_replay(schedule: Any, stages: list) -> bool:
    """Whether `schedule` has micro-batches to replay (one between micro-batch 1 and the last, at least)."""
    n = getattr(schedule, "_n_microbatches", 0)
    return isinstance(schedule, _IN_ORDER) and n > _CAPTURED + 2 and all(s.dw_builder is None for s in stages)


@contextmanager
def replaying_microbatches(trace: MemoryTrace, schedule: Any, stages: list) -> Iterator[None]:
    """Inside, `schedule` runs micro-batches 0, 1 and the last of each of `stages` and replays the others."""
    replays = [
        _StageReplay(trace, stage, range(_CAPTURED + 1, schedule._n_microbatches - 1)) for stage in stages
    ]
    last = next((r for r in replays if r.stage.is_last), None)
    if last is not None:
        schedule._compute_loss = functools.partial(last.run, "loss", schedule._compute_loss)
    try:
        yield
    finally:
        vars(schedule).pop("_compute_loss", None)
        for r in replays:
            r.remove()


class _StageReplay:
    """One stage's captured forward, loss and backward, and their replays.

    Wraps the stage's methods on the instance: `forward_one_chunk` and `backward_one_chunk` to know the
    micro-batch, `forward_maybe_with_nosync` and `backward_maybe_with_nosync` to capture or replay.
    """

    _WRAPPED = (
        "forward_one_chunk",
        "backward_one_chunk",
        "forward_maybe_with_nosync",
        "backward_maybe_with_nosync",
    )

    def __init__(self, trace: MemoryTrace, stage: Any, replayed: range):
        self.trace, self.stage, self.replayed = trace, stage, replayed
        self.mb = -1
        self.captured: dict[
            str, tuple
        ] = {}  # piece -> (span, leaves and structure of what it hands on, shapes)
        self.keys: dict[
            int, dict[int, int]
        ] = {}  # micro-batch -> its storages standing for the captured ones
        stage.forward_one_chunk = functools.partial(self.at_microbatch, stage.forward_one_chunk)
        stage.backward_one_chunk = functools.partial(self.at_microbatch, stage.backward_one_chunk)
        stage.forward_maybe_with_nosync = functools.partial(
            self.run, "forward", stage.forward_maybe_with_nosync
        )
        stage.backward_maybe_with_nosync = functools.partial(self.backward, stage.backward_maybe_with_nosync)

    def remove(self) -> None:
        for name in self._WRAPPED:
            vars(self.stage).pop(name, None)

    def at_microbatch(self, method: Callable, mb: int, *args, **kwargs):
        self.mb = mb
        return method(mb, *args, **kwargs)

    def run(self, piece: str, method: Callable, *args, **kwargs):
        """The forward or the loss of the current micro-batch: run and captured, replayed, or run."""
        if self.mb == _CAPTURED:
            return self._capture(piece, method, *args, **kwargs)
        if self.mb in self.replayed and (piece == "forward" or self.mb in self.keys):
            # What the real piece computes its output from, for autograd: a stage keeps its output's node
            # until backward and the schedule each loss until the step ends, and so what they came from.
            sources = [
                t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            self.keys[self.mb], out = self._replay(piece, self.keys.get(self.mb, {}), sources)
            return out
        return method(*args, **kwargs)

    def backward(self, method: Callable, backward_type: str, bwd_kwargs: dict, last_backward: bool = False):
        if self.mb == _CAPTURED:
            grads, _ = self._capture("backward", method, backward_type, bwd_kwargs, last_backward)
            return grads, None
        if self.mb not in self.keys:
            return method(backward_type, bwd_kwargs, last_backward)
        if backward_type != "full" or last_backward or "backward" not in self.captured:
            raise ReplayError(
                f"stage {self.stage.stage_index}: micro-batch {self.mb}'s backward ({backward_type})"
            )
        _, grads = self._replay("backward", self.keys.pop(self.mb), [])
        return grads, None

    def _capture(self, piece: str, method: Callable, *args, **kwargs):
        mark = self.trace.mark()
        out = method(*args, **kwargs)
        span = self.trace.capture(mark)
        leaves, structure = tree_flatten(out[0] if piece == "backward" else out)
        shapes = {}
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                shapes[self.trace.key_of(t)] = (i, _Shape.of(t))
                leaves[i] = None  # what is captured must not keep micro-batch 1's tensors alive
        made_before = self.keys.get(_CAPTURED, {}) if piece != "forward" else {}
        if any(k not in span.made for k in shapes) or any(
            k not in span.made and k not in made_before for k, _, _ in span.events
        ):  # it hands on a tensor it did not make, or frees one made before it: it does not repeat
            if piece == "backward":
                raise ReplayError(f"stage {self.stage.stage_index}: micro-batch {self.mb}'s backward")
            self.replayed = range(0)  # nothing replayed yet: the stage runs every micro-batch
        self.keys.setdefault(_CAPTURED, {}).update({k: k for k in span.made})
        self.captured[piece] = (span, (leaves, structure), shapes)
        return out

    def _replay(self, piece: str, keys: dict[int, int], sources: list) -> tuple[dict[int, int], Any]:
        span, (leaves, structure), shapes = self.captured[piece]
        leaves = list(leaves)
        make = {key: functools.partial(shape.make, leaves, i, sources) for key, (i, shape) in shapes.items()}
        now = self.trace.replay(span, keys, make)
        return {**keys, **now}, tree_unflatten(leaves, structure)


@dataclass(frozen=True)
class _Shape:
    """What a tensor handed on looks like, to make one like it without keeping it alive."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    storage_elements: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    dtensor: tuple | None  # (mesh, placements, global size, global stride)

    @classmethod
    def of(cls, t: torch.Tensor) -> _Shape:
        dtensor = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        local = t._local_tensor if isinstance(t, DTensor) else t
        elements = local.untyped_storage().nbytes() // local.element_size()
        return cls(
            local.shape,
            local.stride(),
            local.storage_offset(),
            elements,
            local.dtype,
            local.device,
            t.requires_grad,
            dtensor,
        )

    def make(self, leaves: list, index: int, sources: list) -> torch.Tensor:
        """A tensor like the one described, on a storage of its size, put at `leaves[index]`; one that
        requires grad comes from an autograd node on `sources` (a leaf would keep only itself alive)."""
        t = _Made.apply(self, *(sources or [_anchor()])) if self.requires_grad else self.allocate()
        if self.dtensor is not None:
            mesh, placements, size, stride = self.dtensor
            t = DTensor.from_local(t, mesh, placements, run_check=False, shape=size, stride=stride)
        leaves[index] = t
        return t

    def allocate(self) -> torch.Tensor:
        base = torch.empty(self.storage_elements, dtype=self.dtype, device=self.device)
        return base.as_strided(self.size, self.stride, self.offset)


@functools.cache
def _anchor() -> torch.Tensor:
    """What a replayed tensor that requires grad comes from where nothing does: a real, empty tensor that
    no trace sees."""
    with unset_fake_temporarily():
        return torch.empty(0, requires_grad=True)


class _Made(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shape: _Shape, *sources: torch.Tensor) -> torch.Tensor:
        ctx.sources = len(sources)
        return shape.allocate()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None,) * (1 + ctx.sources)
