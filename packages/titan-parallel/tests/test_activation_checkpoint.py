"""Activation checkpointing changes memory, never results: every mode gives the gradients of none."""

import copy

import pytest
import torch
from toy_transformer import SEQ, VOCAB, ToyTransformer, cross_entropy

from titan_parallel import ParallelConfigError, apply_ac, blocks_of


def _grads(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = ToyTransformer(n_layers=4)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return model, tokens, _grads(copy.deepcopy(model), tokens)


@pytest.mark.parametrize(
    ("mode", "selective", "recomputed_blocks"),
    [
        ("none", "op", []),
        ("full", "op", [0, 1, 2, 3]),
        ("selective", 2, [0, 2]),
        ("selective", "op", [0, 1, 2, 3]),
    ],
)
def test_checkpointing_mode_gives_the_gradients_of_no_checkpointing(
    reference, mode, selective, recomputed_blocks
):
    model, tokens, expected = reference
    model = copy.deepcopy(model)
    names_before = [n for n, _ in model.named_parameters()]
    apply_ac(model, blocks_of(model), mode=mode, selective=selective)
    # The feed-forward runs again in backward exactly in the blocks that recompute.
    calls = [_count_calls(block.feed_forward.w1) for block in model.layers.values()]
    grads = _grads(model, tokens)
    assert [n for n, _ in model.named_parameters()] == names_before  # checkpoints stay portable
    assert [i for i, c in enumerate(calls) if c[0] == 2] == recomputed_blocks
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def _backward_matmuls(model, tokens, **ac) -> int:
    model = copy.deepcopy(model)
    apply_ac(model, blocks_of(model), **ac)
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    with _CountMatmuls() as counter:
        loss.backward()
    return counter.count


def test_selective_per_op_keeps_every_other_matmul_output_and_recomputes_the_rest(reference):
    model, tokens, expected = reference
    plain = _backward_matmuls(model, tokens, mode="none")
    # A block runs 7 matmuls (wq, wk, wv, wo, w1, w3, w2); the 1st, 3rd, 5th and 7th outputs are kept, so
    # backward runs the 2nd, 4th and 6th again in each of the 4 blocks, as torchtitan's per-op policy does.
    # Full checkpointing runs 6 again (not w2: nothing saved for backward needs its output).
    assert _backward_matmuls(model, tokens, mode="selective", selective="op") == plain + 3 * 4
    assert _backward_matmuls(model, tokens, mode="full") == plain + 6 * 4
    model = copy.deepcopy(model)
    apply_ac(model, blocks_of(model), mode="selective", selective="op")
    grads = _grads(model, tokens)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_unknown_checkpointing_mode_is_refused():
    model = ToyTransformer()
    with pytest.raises(ParallelConfigError, match="'partial' is unknown"):
        apply_ac(model, blocks_of(model), mode="partial")
    with pytest.raises(ParallelConfigError, match="every 0 blocks"):
        apply_ac(model, blocks_of(model), mode="selective", selective=0)


def test_per_op_force_recompute_recomputes_exactly_the_named_linear_matmuls(reference):
    model, tokens, expected = reference
    plain = _backward_matmuls(model, tokens, mode="none")
    kept = _backward_matmuls(model, tokens, mode="selective", selective="op")
    forced = _backward_matmuls(
        model, tokens, mode="selective", selective="op", force_recompute_mm_fqns=("feed_forward.w1",)
    )
    # Matched by weight shape, as the policy sees only ops: w1 and w3 share theirs, so both run again in
    # each of the 4 blocks' backward and are not counted: of the other five (wq, wk, wv, wo, w2) the 2nd
    # and 4th are recomputed, where without forcing w3 was kept and wo and w1 recomputed: one more a block.
    assert (kept, forced) == (plain + 3 * 4, plain + 4 * 4)
    model = copy.deepcopy(model)
    apply_ac(model, blocks_of(model), mode="selective", selective="op", force_recompute_mm_fqns=("w1",))
    grads = _grads(model, tokens)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_checkpoint_settings_reach_torch_checkpoint(reference):
    model, tokens, expected = reference
    model = copy.deepcopy(model)
    settings = {"preserve_rng_state": True, "determinism_check": "none", "early_stop": True, "debug": True}
    apply_ac(model, blocks_of(model), mode="full", checkpoint_kwargs=settings)
    assert all(block.forward.kwargs == settings for block in model.layers.values())
    grads = _grads(model, tokens)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, op):
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


def test_selective_per_op_keeps_the_float8_scales_amax_as_torchtitan_does(reference):
    """The absolute maxima that float8 scales come from are kept, not recomputed (torchtitan's save list
    has aten.max for this): the backward of per-op checkpointing runs no more of them than no checkpointing."""
    from titan_parallel import apply_float8

    model, tokens, _ = reference
    counts = {}
    for mode in ("none", "selective"):
        converted = copy.deepcopy(model)
        apply_float8(converted, recipe="tensorwise", skip_fqns=("output",), emulate=True)
        apply_ac(converted, blocks_of(converted), mode=mode, selective="op")
        loss = cross_entropy(converted(tokens[:, :-1]), tokens[:, 1:])
        with _CountOps(torch.ops.aten.max.default) as counter:
            loss.backward()
        counts[mode] = counter.count
    assert counts["none"] > 0  # the backward casts its gradients, each with an amax
    assert counts["selective"] == counts["none"]
