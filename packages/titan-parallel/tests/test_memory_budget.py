"""`ActivationCheckpointing(mode="memory_budget")`: no block is wrapped, and under `compiler_settings()` torch.compile's
partitioner keeps fewer activations for backward at a lower budget, with the same gradients.

Measured on a compiled 3-block MLP (CPU, inductor): the bytes the compiled graph saves for backward, counted by
`saved_tensors_hooks`, at budget 0.0 against 1.0 (405,248 against 622,592 on 2026-12-02). Planted once: a
`compiler_settings()` that patches nothing saves the same bytes at both budgets and fails the first assertion.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_parallel.activation_checkpoint import ActivationCheckpointing


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Tanh()) for _ in range(3)]
    )


def _saved_bytes_and_grads(budget: float) -> tuple[int, dict[str, torch.Tensor]]:
    torch._dynamo.reset()
    model = _mlp()
    ac = ActivationCheckpointing(mode="memory_budget", memory_budget=budget)
    assert ac.apply(model, dict(model.named_children())) is model
    assert not any("checkpoint" in type(m).__name__.lower() for m in model.modules())
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    with ac.compiler_settings():
        compiled = torch.compile(model)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = compiled(x).square().sum()
        loss.backward()
    return saved[0], {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_lower_memory_budget_saves_fewer_activations_with_the_same_gradients():
    low, low_grads = _saved_bytes_and_grads(0.0)
    high, high_grads = _saved_bytes_and_grads(1.0)
    assert low < 0.8 * high, (low, high)
    for name, grad in high_grads.items():
        torch.testing.assert_close(low_grads[name], grad, rtol=1e-5, atol=1e-6)


def test_the_budget_is_lifted_when_the_settings_are_left():
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    with ActivationCheckpointing(mode="memory_budget", memory_budget=0.25).compiler_settings():
        assert functorch_config.activation_memory_budget == 0.25
    assert functorch_config.activation_memory_budget == before
    with ActivationCheckpointing(mode="full").compiler_settings():
        assert functorch_config.activation_memory_budget == before
