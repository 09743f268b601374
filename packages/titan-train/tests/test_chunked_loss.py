"""The chunked cross-entropy: the plain loss's value and gradients, with less memory at its peak."""

import pytest
import torch

from titan_parallel.memory_trace import MemoryTrace
from titan_train.config import load_job_config
from titan_train.registry import cross_entropy_loss, get_model_family
from titan_train.wiring.chunked_loss import chunked_cross_entropy
from titan_train.wiring.loss import build_loss_fn


def _loss_and_grad(loss_fn, logits, labels):
    x = logits.detach().clone().requires_grad_()
    trace = MemoryTrace()
    with trace:
        trace.track([x, labels])
        loss = loss_fn(x, labels)
        loss.backward()
    return loss.detach(), x.grad, trace.result().peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_equals_the_plain_loss_and_gradients_and_peaks_lower(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(2, 1500, 4096) * 4).to(dtype)  # 3000 tokens: two full chunks and a partial one
    labels = torch.randint(0, 4096, (2, 1500))
    labels[0, :7] = -100  # ignored positions count in neither
    plain, plain_grad, plain_peak = _loss_and_grad(cross_entropy_loss, logits, labels)
    chunked, chunked_grad, chunked_peak = _loss_and_grad(chunked_cross_entropy, logits, labels)
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    assert torch.allclose(chunked_grad.float(), plain_grad.float(), rtol=0, atol=1e-6)
    assert (chunked_grad.float() - plain_grad.float()).abs().max() <= 1e-6
    # bf16 logits: the plain loss holds their float32 copy and its log-softmax; float32: the log-softmax.
    assert chunked_peak < (0.65 if dtype == torch.bfloat16 else 0.8) * plain_peak


def test_the_config_switch_and_compile_choose_the_loss():
    spec = get_model_family("llama3")
    assert build_loss_fn(load_job_config([]), spec) is chunked_cross_entropy
    assert build_loss_fn(load_job_config(["--training.chunked_loss", "false"]), spec) is cross_entropy_loss
    compiled = build_loss_fn(load_job_config(["--compile.enable", "--compile.components", "loss"]), spec)
    assert compiled not in (chunked_cross_entropy, cross_entropy_loss)
