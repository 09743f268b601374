"""The forward pass every objective shares: the one model part's logits, inside the run's layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from titan_models import documents_from_positions
from titan_parallel import training_context
from titan_train.run_plan import RunPlan


def model_forward(
    parts: list[nn.Module], inputs: torch.Tensor, positions: torch.Tensor | None
) -> torch.Tensor:
    """Logits of the one model part; chat rows pass their positions (conversations restart at 0)."""
    if positions is None:
        return parts[0](inputs)
    return parts[0](inputs, positions=positions)


def layout_context(
    plan: RunPlan,
    parts: list[nn.Module],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor | None = None,
):
    """Loss and context parallelism around a forward pass, as the layout enables them: context
    parallelism shards the batch (with chat rows' `positions`) and the model's sequence buffers along the
    sequence, or, over packed documents, deals the batch per row with each token's document."""
    buffers = [buffer for part in parts for buffer in part.sequence_buffers()]
    batch = [inputs, labels] if positions is None else [inputs, labels, positions]
    return training_context(
        plan.dims,
        plan.options,
        cp_buffers=[inputs, labels, *(b for b, _ in buffers)],
        cp_seq_dims=[1, 1, *(dim for _, dim in buffers)],
        cp_no_restore=[inputs, labels],
        cp_models=parts,
        cp_batch=batch,
        cp_documents=_documents(plan, parts, inputs, positions),
    )


def _documents(
    plan: RunPlan, parts: list[nn.Module], inputs: torch.Tensor, positions: torch.Tensor | None
) -> torch.Tensor | None:
    """Each token's packed document over the whole rows, found before context parallelism splits them:
    conversations restart their positions, block-causal text ends documents at the model's eos."""
    if plan.dims.cp == 1:
        return None
    if positions is not None:
        return documents_from_positions(positions)
    return parts[0].packed_document_ids(inputs)


@contextlib.contextmanager
def whole_sequence_context(plan: RunPlan, forward_context) -> Iterator[None]:
    """The forward context and, under TP, loss parallelism, for objectives that score whole sequences:
    log-probs are taken from the vocabulary-sharded logits. Context parallelism, where such an objective
    takes it, is dealt by the objective itself (`sequence_dealer`), once its sequences are numbered."""
    with training_context(plan.dims, plan.options, context_parallel=False), forward_context():
        yield


def sequence_dealer(plan: RunPlan, parts: list[nn.Module]):
    """Under context parallelism, `deal(batch, positions)`: a context that deals the (batch, seq) tensors
    of `batch` to the ranks per row, with the documents the rows' restarting `positions` give, while
    `parts` attend over the gathered sequence; None without context parallelism."""
    if plan.dims.cp == 1:
        return None
    mesh, options = plan.dims.submesh("cp"), plan.options.context_parallel

    def deal(batch: list[torch.Tensor], positions: torch.Tensor):
        return options.gathered(mesh, batch, documents_from_positions(positions), parts)

    return deal
