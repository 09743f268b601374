"""torch.compile per block gives the eager model's loss and gradients, with the same parameter names."""

import copy

import pytest
import torch
from toy_transformer import SEQ, VOCAB, ToyTransformer, cross_entropy

from titan_parallel import apply_ac, apply_compile, blocks_of


@pytest.mark.parametrize(
    ("backend", "ac_mode"),
    # inductor generates kernels (slow to compile on a small CPU, so one block and no checkpointing);
    # aot_eager captures the same full graphs, here through per-op checkpointing, in seconds.
    [("inductor", "none"), ("aot_eager", "selective")],
)
def test_compiled_blocks_match_eager(backend, ac_mode):
    torch.manual_seed(0)
    n_layers = 1 if backend == "inductor" else 2
    eager = ToyTransformer(n_layers=n_layers)
    compiled = copy.deepcopy(eager)
    # Checkpointing first, then compile: the order parallelize() uses.
    apply_ac(compiled, blocks_of(compiled), mode=ac_mode, selective="op")
    apply_compile(compiled, blocks_of(compiled), backend=backend)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (eager, compiled):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert all(block._compiled_call_impl is not None for block in compiled.layers.values())
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
