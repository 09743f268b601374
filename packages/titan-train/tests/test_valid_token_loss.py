"""The step's loss over masked micro-batches: the mean over every trained token (a formula written here),
and a micro-batch with no trained token adds nothing, its gradients zero, not NaN."""

import pytest
import torch
import torch.nn.functional as F

from titan_train.wiring.chunked_loss import chunked_cross_entropy
from titan_train.wiring.valid_token_loss import IGNORE_INDEX, ValidTokenWeights


def _torch_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("_mean_loss", [_torch_loss, chunked_cross_entropy], ids=["torch", "chunked"])
def test_weighted_micro_batches_give_the_mean_over_trained_tokens_and_an_empty_one_no_nan(_mean_loss):
    torch.manual_seed(0)
    logits = [torch.randn(1, 6, 11, requires_grad=True) for _ in range(3)]
    labels = [torch.randint(0, 11, (1, 6)) for _ in range(3)]
    labels[0][0, :4] = IGNORE_INDEX
    labels[1][:] = IGNORE_INDEX  # a truncated row whose trained turn was cut off
    weights = ValidTokenWeights()
    weights.begin_step(labels, shares=3)
    loss = sum(weights.wrap(_mean_loss)(x, y) for x, y in zip(logits, labels, strict=True)) / 3
    loss.backward()
    every = torch.cat([x.detach().flatten(0, 1) for x in logits])
    expected = F.cross_entropy(every, torch.cat([y.flatten() for y in labels]), ignore_index=IGNORE_INDEX)
    assert torch.allclose(loss, expected, atol=1e-6)
    assert torch.isfinite(logits[1].grad).all() and not logits[1].grad.any()
    assert logits[0].grad.any() and logits[2].grad.any()
    assert (labels[1] == IGNORE_INDEX).all()  # the caller's labels are not changed
