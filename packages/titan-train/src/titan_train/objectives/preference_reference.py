"""The reference log-probs of a whole preference dataset, computed once before step 1
(`preference.reference = "precompute"`), so no reference model is kept or run while training.

At step 0 the policy holds the starting weights, so the pass runs the policy itself without gradients
(under LoRA with its adapters switched off, as `auto` does): no second copy of the model is built. Each
pair's chosen and rejected sums are kept by the pair's index in the dataset (the windows' fifth row) and
read back by that key each step, whatever window, micro-batch or rank the pair lands in. The table is a
checkpoint state of its own, so a resumed run loads it instead of computing it again with weights that
are no longer the starting ones.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from titan_data import PreferenceDataset
from titan_parallel import adapters_off
from titan_train.objectives.preference_loss import sequence_logps
from titan_train.objectives.preference_step import evaluating, global_sequences, window_slots

logger = logging.getLogger(__name__)


class PrecomputedReference:
    """Per pair of the dataset: the reference's summed completion log-probs of its chosen (column 0) and
    rejected (column 1) sequence. Stateful, so the checkpoint saves it (the same on every rank)."""

    def __init__(self, num_pairs: int, device: torch.device):
        self.logps = torch.zeros(num_pairs, 2, dtype=torch.float32, device=device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"logps": self.logps}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.logps.copy_(state["logps"])

    def lookup(self, pair: torch.Tensor, sequence: torch.Tensor, n: int) -> torch.Tensor:
        """The reference's sums of a micro-batch's `n` sequences, numbered 2k/2k+1 across it (`sequence`),
        their pairs' dataset indices in `pair` at the same positions."""
        index = torch.zeros(n // 2, dtype=torch.int64, device=pair.device)
        placed = sequence >= 0
        index[sequence[placed] // 2] = pair[placed]
        return self.logps[index].reshape(-1)

    def window_sums(self, pair: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
        """Per window (row) of a batch, the reference's sum of its j-th sequence at column j (0 past its
        last): `sequence` numbers the row's sequences, `pair` holds their pairs' dataset indices."""
        placed = sequence >= 0
        values = self.logps[pair.clamp_min(0), sequence.clamp_min(0) % 2].to(torch.float64)
        return window_slots(sequence, torch.where(placed, values, 0.0))


def precompute_reference(
    table: PrecomputedReference,
    dataset: PreferenceDataset,
    parts: list[nn.Module],
    forward: Callable,
    context: Callable,
    *,
    batch_size: int,
    dp_rank: int,
    dp_degree: int,
    group: dist.ProcessGroup | None,
    window_sums: Callable | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> None:
    """Fill `table` in one pass over every pair of `dataset` with the policy's current (starting) weights,
    batches of `batch_size` windows dealt round robin over the data-parallel ranks; every rank runs as
    many forwards (a rank out of batches repeats one and drops it, so sharded layers meet), then the
    shares are summed over the ranks (each pair is written by one).

    Under a pipeline, `window_sums(inputs, labels, positions, sequence)` runs the forward instead (every
    batch filled to `batch_size` windows with copies of its first, which write the same values again)
    and gives each window's sums on the last stage: the table is then summed over `pp_group` too."""
    start = time.perf_counter()
    whole = PreferenceDataset(
        dataset.pairs,
        dataset.seq_len,
        packing=dataset.packing,
        pad_id=dataset.pad_id,
        infinite=False,
        pair_index=True,
    )
    device, seq_len = table.logps.device, dataset.seq_len

    def run_pipelined(batch, keep: bool) -> None:
        inputs, labels, positions, sequence, pair = (t.to(device) for t in batch[:5])
        fill = batch_size - inputs.shape[0]
        inputs, labels, positions, sequence, pair = (
            torch.cat([t, t[:1].expand(fill, *t.shape[1:])])
            for t in (inputs, labels, positions, sequence, pair)
        )
        with context():
            slots = window_sums(inputs, labels, positions, sequence)
        if keep:
            placed = sequence >= 0
            values = slots.gather(1, sequence.clamp_min(0)).float()
            table.logps[pair[placed], sequence[placed] % 2] = values[placed]

    def run(batch, keep: bool) -> None:
        if window_sums is not None:
            return run_pipelined(batch, keep)
        numbered, pairs = global_sequences(batch[3])
        inputs, labels, positions, numbered, pair = (
            t.to(device).reshape(-1, seq_len) for t in (*batch[:3], numbered, batch[4])
        )
        with context():
            logps = sequence_logps(forward(inputs, positions), labels, numbered, 2 * pairs)
        if keep:
            index = torch.zeros(pairs, dtype=torch.int64, device=device)
            placed = numbered >= 0
            index[numbered[placed] // 2] = pair[placed]
            table.logps[index] = logps.sums.view(pairs, 2)

    # Streamed, not listed: a whole padded dataset's windows would not fit in host memory.
    first, total, taken = None, 0, 0
    with torch.no_grad(), contextlib.ExitStack() as stack, evaluating(parts):
        for part in parts:
            stack.enter_context(adapters_off(part))
        for number, batch in enumerate(whole.batches(batch_size)):
            first, total = first if first is not None else batch, total + 1
            if number % dp_degree == dp_rank:
                run(batch, keep=True)
                taken += 1
        for _ in range(math.ceil(total / dp_degree) - taken):
            run(first, keep=False)  # dropped: this rank meets the others' last forward
    for summed_over in (group, pp_group):
        if summed_over is not None:
            dist.all_reduce(table.logps, group=summed_over)
    logger.info(
        "preference: reference log-probs of %d pairs computed in one pass (%d batches, %.1f s)",
        len(dataset.pairs),
        total,
        time.perf_counter() - start,
    )
