"""A resumable batch loader over a packed or memory-mapped dataset, in-process or with worker processes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_data.datasets.streams import stream_key
from titan_data.datasets.windows import WindowDataset
from titan_data.errors import DataError


class _Batches(IterableDataset):
    """A dataset's windows already batched: one stack per batch instead of a collate per window."""

    def __init__(self, dataset: WindowDataset, batch_size: int):
        self.dataset, self.batch_size = dataset, batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.dataset.batches(self.batch_size)


def worker_streams(owned: list[int], worker: int, num_workers: int, position: int = 0) -> list[int]:
    """The streams worker `worker` reads, so that taking one window from each worker in turn visits the
    rank's streams in the order one process would, starting at window `position` of the rank.

    `carriers`, the largest divisor of the number of streams not above `num_workers`, get streams
    (every `carriers`-th, counted from where the round stands); the other workers get none.
    """
    k = len(owned)
    carriers = max(d for d in range(1, min(num_workers, k) + 1) if k % d == 0)
    if worker >= carriers:
        return []
    return sorted(owned[(position + worker + i * carriers) % k] for i in range(k // carriers))


class _WorkerWindows(IterableDataset):
    """In each worker: its streams' windows, each tagged with its stream and that stream's state after it."""

    def __init__(self, dataset: WindowDataset, num_workers: int):
        self.dataset, self.num_workers = dataset, num_workers

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, bytes]]:
        info = get_worker_info()
        dataset = self.dataset  # this worker's own copy
        position = sum(state.windows_emitted for state in dataset.streams.values())
        mine = worker_streams(dataset.owned, info.id if info else 0, self.num_workers, position)
        if not mine:
            return
        # The other streams leave this copy, so their documents are passed over like other ranks'.
        dataset.owned = mine
        dataset.streams = {j: dataset.streams[j] for j in mine}
        for stream, window in dataset.tagged_windows():
            yield stream, torch.from_numpy(window.astype("int64")), dataset.stream_entry(stream)


class TokenLoader(StatefulDataLoader):
    """Batches of (input, label) from a packed or memory-mapped dataset (chat rows add positions), resumable at any batch boundary.

    `state_dict()` is the dataset's per-stream state: its keys are unique across ranks, so a
    checkpointer can save every rank's entries side by side and deal them out again on load.

    With `num_workers > 0`, worker processes tokenise and pack: the rank's streams are shared out
    among them (see `worker_streams`), each window comes back with its stream's state after it, and
    this process stacks the windows into batches in the order one process reads them. The batches
    and the saved state are therefore those of `num_workers = 0`, and a checkpoint resumes at any
    number of workers or ranks. `pin_memory` page-locks each batch for asynchronous copies to an
    accelerator (it needs one). One iteration is exact; persistent workers are kept for the next.
    """

    def __init__(
        self,
        dataset: WindowDataset,
        batch_size: int,
        *,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
    ):
        if pin_memory and not torch.accelerator.is_available():
            raise DataError(
                "loader: pin_memory page-locks batches for copies to an accelerator, and there is none here; "
                "set pin_memory = false"
            )
        if num_workers == 0 and (persistent_workers or prefetch_factor is not None):
            raise DataError(
                "loader: persistent_workers and prefetch_factor apply to worker processes; set num_workers > 0"
            )
        # Its own generator: each iteration draws a base seed for worker processes, and from the global
        # generator that draw would shift every later random number (dropout masks) by when iteration began,
        # so a resumed run, whose iteration begins at its first step, would draw other masks.
        generator = torch.Generator()
        if num_workers == 0:
            # Workers would tokenise ahead of the saved position; see _WorkerWindows for how they don't.
            super().__init__(
                _Batches(dataset, batch_size), batch_size=None, num_workers=0, generator=generator
            )
        else:
            super().__init__(
                _WorkerWindows(dataset, num_workers),
                batch_size=None,
                num_workers=num_workers,
                persistent_workers=persistent_workers,
                prefetch_factor=prefetch_factor,
                generator=generator,
            )
        self.packed, self.local_batch_size, self.pin = dataset, batch_size, pin_memory
        self._consumed: dict[str, bytes] = {}  # stream -> state after its last window handed out

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batches = super().__iter__() if self.num_workers == 0 else self._from_workers()
        for batch in batches:  # (inputs, labels), and positions for chat rows
            yield tuple(t.pin_memory() for t in batch) if self.pin else batch

    def _from_workers(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # Workers start from what this process has consumed (they copy the dataset when they start).
        self.packed.load_state_dict(self.state_dict())
        self._consumed = {}
        rows: list[torch.Tensor] = []
        for stream, window, entry in super().__iter__():
            self._consumed[stream_key(stream)] = entry
            rows.append(window)
            if len(rows) == self.local_batch_size:
                yield _stack(rows)
                rows = []
        if rows:
            yield _stack(rows)

    @property
    def remote(self) -> bool:
        """Whether the batches come from a source read over a network, which may stop answering mid-run."""
        return self.packed.remote

    def state_dict(self) -> dict[str, Any]:
        return {**self.packed.state_dict(), **self._consumed}

    def close(self) -> None:
        """Stop the worker processes (persistent ones too) and wait for them; a later iteration starts
        new ones. Without workers there is nothing to stop."""
        iterator, self._iterator = self._iterator, None
        # torch's multi-process iterator stops its workers in `_shutdown_workers`, otherwise only when
        # it is garbage-collected.
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.packed.load_state_dict(state)
        self._consumed = {}


def _stack(windows: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    batch = torch.stack(windows)
    if batch.dim() == 3:  # chat rows: (inputs, labels, positions) per window, already shifted
        return tuple(batch[:, i].contiguous() for i in range(batch.shape[1]))
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
