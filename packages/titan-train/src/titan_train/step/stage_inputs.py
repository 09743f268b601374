"""What every pipeline stage needs besides the hidden state it receives: where packed documents are.

A block-causal model derives its mask from the token ids, which only the first stage holds; the
other stages are given the ids from the same batch (as torchtitan hands every stage its masks).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_parallel import HasPackedDocuments


def stage_inputs(
    parts: list[nn.Module], inputs: torch.Tensor, positions: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Keyword inputs for every stage's forward: chat rows' `positions` (each stage builds its rotary
    angles and document mask from them), else `doc_ids` for a block-causal model, else none."""
    if positions is not None:
        return {"positions": positions}
    model = parts[0]
    doc_ids = model.packed_document_ids(inputs) if isinstance(model, HasPackedDocuments) else None
    return {} if doc_ids is None else {"doc_ids": doc_ids}
