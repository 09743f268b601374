"""Packed documents in Qwen3.5: in a row of several documents each computes what it computes alone, in the
full-attention layers (block-causal mask) and in the linear ones (the convolution's window and the
delta-rule state restart at each document), for loss and gradients; documents found from end-of-text ids
(block-causal pretraining) or from positions restarting at 0 (packed chat SFT, preference pairs).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from family_checks import materialised, perturb
from test_qwen3_5_hf import SHAPES, slow_decays

from titan_models.qwen3_5 import Qwen3_5Model

EOS = 1
# A document longer than the delta rule's 64-token chunk, and boundaries inside chunks.
LENGTHS = (37, 70, 21)


def _model(shape: str) -> Qwen3_5Model:
    args = replace(SHAPES[shape], max_seq_len=128, attn_mask_type="block_causal", eos_id=EOS)
    model = materialised(Qwen3_5Model, args, seed=2)
    perturb(model, seed=4)
    slow_decays(model, seed=4)
    return model


def _documents() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    docs = [torch.randint(2, 96, (n,), generator=gen) for n in LENGTHS]
    for doc in docs:
        doc[-1] = EOS
    return docs


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy within one document (its last position predicts nothing)."""
    return F.cross_entropy(logits[0, :-1].float(), tokens[1:], reduction="sum")


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("shape", ["dense", "moe"])
@pytest.mark.parametrize("boundaries", ["eos", "positions"])
def test_a_packed_row_equals_its_documents_run_one_by_one_in_loss_and_gradients(shape, boundaries):
    """Planted: the delta-rule state not emptied at a document boundary fails this test; so does the
    convolution reading across one."""
    model = _model(shape)
    docs = _documents()
    row = torch.cat(docs)[None]
    if boundaries == "eos":
        logits = model(row)
    else:
        positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
        logits = model(row, positions=positions)
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    packed_loss = sum(_loss(logits[:, a:b], doc) for (a, b), doc in zip(pairwise(starts), docs, strict=True))
    packed = _grads(model, packed_loss)

    alone_loss = sum(_loss(model(doc[None]), doc) for doc in docs)
    alone = _grads(model, alone_loss)

    assert abs(packed_loss.item() - alone_loss.item()) <= 1e-5 * alone_loss.item()
    assert packed.keys() == alone.keys() and any(".attention.A_log" in n for n in packed)
    for name, grad in alone.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        assert (packed[name] - grad).abs().max().item() <= 1e-4 * scale + 1e-7, name
