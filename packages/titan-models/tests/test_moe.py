"""The MoE feed-forward: torchtitan's parameter layout, routing against a per-token reference, both
expert kernels, and both load-balancing mechanisms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_models import ModelConfigError
from titan_models.moe import (
    GroupedExperts,
    MoE,
    MoEArgs,
    expert_load,
    experts_for_loop,
    experts_grouped_mm,
    sequence_aux_loss,
    set_aux_loss_scale,
    update_expert_bias,
)

DIM, HIDDEN = 16, 32


class _Listed(torch.nn.Module):
    """A model that lists one MoE layer (FQN ""), as a Decoder lists its blocks' with `moe_layers()`."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe

    def moe_layers(self) -> dict[str, MoE]:
        return {"": self.moe}


def _moe(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    args = MoEArgs(**{"num_experts": 8, "top_k": 2, "num_shared_experts": 1, **kw})
    moe = MoE(args, DIM, HIDDEN)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.3)
    return moe


def _choose(moe: MoE, token: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's expert scores, and the top-k experts picked with `bias` (groups limited first)."""
    a = moe.args
    logits = moe.router.gate.weight @ token
    scores = torch.sigmoid(logits) if a.score_func == "sigmoid" else torch.softmax(logits, dim=0)
    choice = scores + (bias if bias is not None else 0)
    if a.num_expert_groups:
        groups = choice.view(a.num_expert_groups, -1)
        best = groups.topk(2, dim=1).values.sum(1).topk(a.num_limited_groups).indices
        masked = torch.full_like(groups, float("-inf"))
        masked[best] = groups[best]
        choice = masked.view(-1)
    return scores, choice.topk(a.top_k).indices


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: score every expert, pick top-k (with the bias), run each chosen expert alone."""
    a = moe.args
    out = torch.zeros_like(x.reshape(-1, DIM))
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for t, token in enumerate(x.reshape(-1, DIM)):
        scores, chosen = _choose(moe, token, moe.expert_bias)
        w = scores[chosen]
        if a.route_norm:
            w = w / w.sum()
        w = w * a.route_scale
        for e, we in zip(chosen.tolist(), w, strict=True):
            inp = token * we if a.score_before_experts else token
            y = w2[e] @ (F.silu(w1[e] @ inp) * (w3[e] @ inp))
            out[t] += y if a.score_before_experts else we * y
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x.reshape(-1, DIM))
    return out.view_as(x)


def test_parameter_names_and_shapes_are_torchtitans():
    moe = _moe(num_shared_experts=2)
    shapes = {n: tuple(t.shape) for n, t in moe.state_dict().items()}
    assert shapes == {
        "expert_bias": (8,),
        "router.gate.weight": (8, DIM),
        "experts.w1": (8, HIDDEN, DIM),
        "experts.w2": (8, DIM, HIDDEN),
        "experts.w3": (8, HIDDEN, DIM),
        "shared_experts.w1.weight": (2 * HIDDEN, DIM),
        "shared_experts.w2.weight": (DIM, 2 * HIDDEN),
        "shared_experts.w3.weight": (2 * HIDDEN, DIM),
    }
    # Token counts are a buffer but never checkpointed; no bias buffer without load_balance_coeff.
    assert "tokens_per_expert" in dict(moe.named_buffers())
    assert "expert_bias" not in _moe(load_balance_coeff=None).state_dict()


@pytest.mark.parametrize(
    "routing",
    [
        dict(score_func="softmax", score_before_experts=False),
        dict(score_func="sigmoid", route_norm=True, route_scale=2.5, score_before_experts=True),
        dict(
            score_func="sigmoid",
            route_norm=True,
            score_before_experts=False,
            num_expert_groups=4,
            num_limited_groups=2,
        ),
        dict(score_func="softmax", num_shared_experts=0, top_k=3, gate_bias=False),
    ],
)
def test_layer_matches_a_per_token_reference(routing):
    moe = _moe(**routing)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))  # the bias must steer the choice
    x = torch.randn(2, 7, DIM)
    torch.testing.assert_close(moe(x), _reference(moe, x), atol=1e-5, rtol=1e-5)


def test_grouped_mm_and_for_loop_give_equal_outputs_and_gradients():
    torch.manual_seed(0)
    w = [torch.randn(4, HIDDEN, DIM), torch.randn(4, DIM, HIDDEN), torch.randn(4, HIDDEN, DIM)]
    x = torch.randn(11, DIM)
    counts = torch.tensor([3, 0, 6, 2])  # an expert with no token too
    results = []
    for fn in (experts_grouped_mm, experts_for_loop):
        leaves = [t.clone().requires_grad_() for t in (*w, x)]
        out = fn(*leaves[:3], leaves[3], counts)
        out.sum().backward()  # a zero-stride gradient, which _grouped_mm's backward alone rejects
        results.append((out.detach(), [t.grad for t in leaves]))
    (out_g, grads_g), (out_l, grads_l) = results
    torch.testing.assert_close(out_g, out_l, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_g, grads_l, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


def test_experts_compute_in_the_autocast_dtype():
    """Autocast does not cast `torch._grouped_mm`: without the experts' own cast a bf16-autocast run on
    one GPU fed it float32 and missed the bf16 kernel (qwen3 debugmodel_moe on an H200: 1,817 tokens/s
    before the cast, 6,928 after; bench/RESULTS.md). The bf16 call is traced on fake tensors (nothing runs in
    bf16 on this CPU); the float32 one runs (torch 2.11's fake grouped matmul takes only bf16)."""
    experts = GroupedExperts(DIM, HIDDEN, num_experts=4)
    x, counts = torch.randn(11, DIM), torch.tensor([3, 0, 6, 2])
    assert experts(x, counts).dtype == torch.float32
    with torch._subclasses.FakeTensorMode():
        experts = GroupedExperts(DIM, HIDDEN, num_experts=4)
        x, counts = torch.randn(11, DIM), torch.tensor([3, 0, 6, 2])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert experts(x, counts).dtype == torch.bfloat16


def test_padding_rows_past_the_counts_come_out_zero_on_both_paths():
    torch.manual_seed(0)
    w = [torch.randn(2, HIDDEN, DIM), torch.randn(2, DIM, HIDDEN), torch.randn(2, HIDDEN, DIM)]
    x = torch.randn(6, DIM)
    counts = torch.tensor([2, 1])
    for fn in (experts_grouped_mm, experts_for_loop):
        assert fn(*w, x, counts)[3:].abs().max() == 0


def test_layer_gives_equal_outputs_and_gradients_with_either_expert_kernel():
    x = torch.randn(2, 5, DIM)
    grads = []
    for grouped in (True, False):
        moe = _moe(use_grouped_mm=grouped, score_before_experts=False)
        out = moe(x)
        (out * torch.randn_like(out, generator=torch.Generator().manual_seed(1))).sum().backward()
        grads.append((out.detach(), {n: p.grad for n, p in moe.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    for name in grads[0][1]:
        torch.testing.assert_close(grads[0][1][name], grads[1][1][name], atol=1e-4, rtol=1e-4)


def test_force_load_balance_routes_round_robin():
    moe = _moe(debug_force_load_balance=True, top_k=2)
    moe(torch.randn(2, 8, DIM))  # 32 choices over 8 experts
    assert moe.tokens_per_expert.tolist() == [4.0] * 8
    assert expert_load(_Listed(moe)) == {"": 1.0}


def test_expert_bias_moves_towards_balance_once_per_step_and_counts_reset():
    moe = _moe(load_balance_coeff=0.01)
    moe(torch.randn(1, 6, DIM))
    moe(torch.randn(1, 6, DIM))  # a second micro-batch accumulates
    counts = moe.tokens_per_expert.clone()
    assert counts.sum() == 2 * 6 * 2
    load = expert_load(_Listed(moe))[""]
    assert load == pytest.approx((counts.max() / counts.mean()).item())
    seen = []

    def reduce(t):  # stands in for a data-parallel all-reduce: another rank, its counts reversed and 3x ours
        seen.append(t.shape)
        return t + 3 * t.flip(-1)

    update_expert_bias(_Listed(moe), reduce=reduce)
    assert seen == [torch.Size([1, 8])]
    summed = counts + 3 * counts.flip(0)
    # The summed counts turn some expert's sign around, so a bias moved from this rank's counts shows.
    assert not torch.equal(torch.sign(summed.mean() - summed), torch.sign(counts.mean() - counts))
    delta = 0.01 * torch.sign(summed.mean() - summed)
    torch.testing.assert_close(moe.expert_bias, delta - delta.mean())
    assert moe.tokens_per_expert.sum() == 0


@pytest.mark.parametrize("groups", [None, 4])
def test_the_bias_effect_counts_the_tokens_whose_experts_the_bias_changes(groups):
    grouping = {"num_expert_groups": groups, "num_limited_groups": 2} if groups else {}
    moe = _moe(load_balance_coeff=0.01, **grouping)
    x = torch.randn(2, 32, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        moe.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(2)) * 0.3)
        _, indices, scores = moe.router(x.reshape(-1, DIM), moe.expert_bias)
        changed = moe.router.changed_by_bias(scores, indices)
    expected = sum(
        set(_choose(moe, t, moe.expert_bias)[1].tolist()) != set(_choose(moe, t, None)[1].tolist())
        for t in x.reshape(-1, DIM)
    )
    assert 0 < expected < 64 and int(changed) == expected


def test_expert_bias_evens_out_a_skewed_router():
    moe = _moe(load_balance_coeff=0.05, top_k=1, score_func="sigmoid")
    with torch.no_grad():
        moe.router.gate.weight[0] += 1.0  # expert 0 wins most tokens
    x = torch.randn(4, 16, DIM)
    with torch.no_grad():
        moe(x)
        before = expert_load(_Listed(moe))[""]
        update_expert_bias(_Listed(moe))
        for _ in range(15):
            moe(x)
            update_expert_bias(_Listed(moe))
        moe(x)
    assert expert_load(_Listed(moe))[""] < before


def _hand_aux(scores: torch.Tensor, indices: torch.Tensor, batch: int, k: int) -> torch.Tensor:
    """DeepSeek-V3 eq. 17-20 sequence by sequence, written out plainly."""
    num_experts = scores.shape[1]
    total = 0.0
    for s, i in zip(scores.view(batch, -1, num_experts), indices.view(batch, -1, k), strict=True):
        seq_len = s.shape[0]
        f = torch.stack([(i == e).sum() for e in range(num_experts)]).float() * num_experts / (k * seq_len)
        p = (s / s.sum(1, keepdim=True)).mean(0)
        total = total + (f * p).sum()
    return total / batch


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_sequence_aux_loss_adds_coeff_times_its_gradient(score_func):
    coeff, scale = 0.3, 0.5
    x = torch.randn(3, 5, DIM)
    target = torch.randn(3, 5, DIM)
    with_aux = _moe(seq_aux_loss_coeff=coeff, score_func=score_func)
    set_aux_loss_scale(_Listed(with_aux), scale)
    F.mse_loss(with_aux(x), target).backward()
    assert with_aux.last_aux_loss is not None

    plain = _moe(score_func=score_func)
    loss = F.mse_loss(plain(x), target)
    weights, indices, scores = plain.router(x.reshape(-1, DIM), plain.expert_bias)
    aux = _hand_aux(scores, indices, 3, 2)
    torch.testing.assert_close(aux, sequence_aux_loss(scores, indices, 3, 2))
    torch.testing.assert_close(with_aux.last_aux_loss, aux.detach())
    (loss + scale * coeff * aux).backward()
    for (name, p), q in zip(with_aux.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    # The loss did reach the router: without it the gate's gradient differs.
    bare = _moe(score_func=score_func)
    F.mse_loss(bare(x), target).backward()
    assert not torch.allclose(bare.router.gate.weight.grad, with_aux.router.gate.weight.grad)


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(top_k=9), "moe.top_k"),
        (dict(num_expert_groups=3, num_limited_groups=1), "moe.num_expert_groups"),
        (dict(num_expert_groups=8, num_limited_groups=1), "moe.num_expert_groups"),
        (dict(num_expert_groups=4, num_limited_groups=5), "moe.num_limited_groups"),
        (dict(num_expert_groups=4), "moe.num_limited_groups"),
        (dict(num_limited_groups=2), "moe.num_limited_groups"),
        (dict(num_expert_groups=4, num_limited_groups=1, top_k=3), "moe.top_k"),
        (dict(score_func="relu"), "moe.score_func"),
        (dict(load_balance_coeff=0.0), "moe.load_balance_coeff"),
        (dict(seq_aux_loss_coeff=-1.0), "moe.seq_aux_loss_coeff"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(bad, field):
    with pytest.raises(ModelConfigError, match=field) as err:
        MoEArgs(**{"num_experts": 8, "top_k": 2, **bad})
    assert "\n" not in str(err.value)
