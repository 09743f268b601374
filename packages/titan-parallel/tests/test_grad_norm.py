"""clip_grad_norm_ returns the gradient norm exact to float32 rounding, however large the tensors."""

import pytest
import torch

from titan_parallel import clip_grad_norm_


def test_norm_of_large_float32_gradients_on_cpu_is_exact_to_rounding():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (2**21, 2**19, 300)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    exact = torch.cat([p.grad.double() for p in params]).norm().item()
    # torch's float32 CPU norm is off by 2.5e-5 relative here.
    assert clip_grad_norm_(params, max_norm=1e9).item() == pytest.approx(exact, rel=1e-6)
    clip_grad_norm_(params, max_norm=exact / 2)
    assert torch.cat([p.grad.double() for p in params]).norm().item() == pytest.approx(exact / 2, rel=1e-6)
